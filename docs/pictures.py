"""The manual's pictures of the parallel layer, drawn from the code that decides what they show, so they stay true:
the sequence layouts of parallel/reorder.py, which key / value pieces each ring step brings (parallel/strategies/
ring.py's rotation over a dual_chunk layout) and which rows a halo exchange sends (parallel/strategies/halo.py's
`shifts`). The tests run it.

    PYTHONPATH=. python docs/pictures.py            # writes docs/images/*.png
"""

from __future__ import annotations

import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from parallel.reorder import layout_index
from parallel.strategies.halo import shifts

IMAGES = pathlib.Path(__file__).with_name("images")
SHARDS = 4
COLOURS = plt.get_cmap("tab10").colors


def owners(length: int, layout: str, shards: int = SHARDS) -> np.ndarray:
    """[length]: the device that holds each token (in original order) in `layout`."""
    owner = np.empty(length, np.int32)
    owner[layout_index(length, shards, layout)] = np.repeat(np.arange(shards), length // shards)
    return owner


def draw_layouts(path: pathlib.Path, length: int = 16) -> None:
    """A row of `length` tokens over 4 devices in each layout: which device holds each token, and each device's
    causal work (the keys its queries see)."""
    layouts = ("contiguous", "dual_chunk", "striped")
    figure, axes = plt.subplots(len(layouts), 1, figsize=(8, 3.6), constrained_layout=True)
    for ax, layout in zip(axes, layouts, strict=True):
        owner = owners(length, layout)
        work = np.bincount(owner, weights=np.arange(length) + 1, minlength=SHARDS).astype(int)
        for token, device in enumerate(owner):
            ax.add_patch(plt.Rectangle((token, 0), 1, 1, color=COLOURS[device], ec="white"))
            ax.text(token + 0.5, 0.5, str(token), ha="center", va="center", fontsize=8, color="white")
        ax.set_xlim(0, length), ax.set_ylim(0, 1), ax.set_yticks([]), ax.set_xticks([])
        ax.set_title(f"{layout}: causal work per device {', '.join(map(str, work))}", fontsize=9, loc="left")
    figure.suptitle(
        "A row of 16 tokens (original order) over 4 devices: colour = the device that holds it", fontsize=10
    )
    figure.savefig(path, dpi=110)
    plt.close(figure)


def draw_ring(path: pathlib.Path, length: int = 32) -> None:
    """The causal [query, key] square of a dual_chunk row over 4 devices, each visible pair coloured by the ring
    step that computes it: at step s device r attends to the piece device r - s held (the rotation of the ring)."""
    owner = owners(length, "dual_chunk")
    step = (owner[:, None] - owner[None, :]) % SHARDS  # [query, key]
    shown = np.where(np.tril(np.ones((length, length), bool)), step, -1)
    image = np.ones((length, length, 3))
    for s in range(SHARDS):
        image[shown == s] = COLOURS[s]
    figure, ax = plt.subplots(figsize=(5, 5), constrained_layout=True)
    ax.imshow(image, interpolation="nearest")
    ax.set_xlabel("key (original order)"), ax.set_ylabel("query (original order)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[s]) for s in range(SHARDS)]
    labels = ["step 0: own piece"] + [f"step {s}: piece of device r - {s}" for s in range(1, SHARDS)]
    ax.legend(handles, labels, fontsize=7, loc="upper right")
    ax.set_title("Ring over 4 devices, dual_chunk: which step computes each pair", fontsize=9)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def draw_halo(path: pathlib.Path, length: int = 32, window: int = 6) -> None:
    """The sliding-window [query, key] band of a contiguous row over 4 devices: pairs within a device's own piece,
    and the halo rows (parallel/strategies/halo.py's shifts) it receives from the devices before it."""
    index = layout_index(length, SHARDS, "contiguous")
    owner = owners(length, "contiguous")
    received = np.zeros((SHARDS, length), bool)
    for shift in shifts(index, SHARDS, window):
        for device in range(SHARDS):
            rows = shift.index[device]
            received[device, rows[rows < length]] = True
    query, key = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (key <= query) & (key > query - window)
    image = np.ones((length, length, 3))
    image[visible & (owner[:, None] == owner[None, :])] = COLOURS[0]
    image[visible & received[owner][:, :]] = COLOURS[1]
    figure, ax = plt.subplots(figsize=(5, 5), constrained_layout=True)
    ax.imshow(image, interpolation="nearest")
    ax.set_xlabel("key"), ax.set_ylabel("query")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[c]) for c in (0, 1)]
    ax.legend(handles, ["own piece", "halo: received from the previous device"], fontsize=7, loc="upper right")
    ax.set_title(f"Halo exchange, window {window}, 4 devices of {length // SHARDS} tokens", fontsize=9)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(folder: pathlib.Path = IMAGES) -> list[pathlib.Path]:
    """Draws every picture into `folder`; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    drawn = []
    for name, draw in (("layouts", draw_layouts), ("ring", draw_ring), ("halo", draw_halo)):
        drawn.append(folder / f"{name}.png")
        draw(drawn[-1])
    return drawn


if __name__ == "__main__":
    print("\n".join(str(p) for p in main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else IMAGES)))
