"""What converting one model family to and from Hugging Face consists of: a tensor table and a config mapping.

A family (models/hf/llama.py, ...) describes itself with one `Family`; models/hf/convert.py only walks these
descriptions, so a new family is added without touching another one (register it in models/hf/families.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from models.config import ModelConfig
from models.stack import block_layout

Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]
Slices = Callable[[ModelConfig], Iterator[tuple[dict, tuple[int, ...]]]]


def check_required(settings: dict, required: dict, what: str) -> None:
    """ValueError unless each key of `required` is absent from `settings` (a config.json or its rope parameters) or
    has the value our model can represent; `what` names the source, e.g. "LlamaForCausalLM: config.json has"."""
    for key, value in required.items():
        if settings.get(key, value) != value:
            raise ValueError(f"{what} {key}={settings[key]!r}; only {key}={value!r} is supported")


def check_unquantized(hf: dict, architecture: str) -> None:
    """ValueError for a config.json with a quantization_config: its weights are not the model's floats."""
    if hf.get("quantization_config"):
        raise ValueError(
            f"{architecture}: config.json has quantization_config "
            f"{hf['quantization_config'].get('quant_method', '')!r}; only unquantized checkpoints are "
            f"supported: dequantize the weights (FP8 ones with their weight_scale_inv) and drop "
            f"quantization_config"
        )


def check_fields(config: ModelConfig, required: dict, architecture: str) -> None:
    """ValueError unless each ModelConfig field in `required` has the value `architecture` represents (export)."""
    for key, value in required.items():
        if getattr(config, key) != value:
            raise ValueError(
                f"{architecture} cannot hold model.{key}={getattr(config, key)!r}; it needs model.{key}={value!r}"
            )


def aux_loss_coef(config: ModelConfig, architecture: str, scopes: tuple[str, ...] = ("pooled",)) -> float:
    """config.json's weight of the load-balancing loss, which `architecture` computes over the tokens of one of
    `scopes` (model.router_aux_loss_scope; transformers' families pool them); ValueError when `config` weighs a loss
    over other tokens."""
    scope = config.router_aux_loss_scope
    if config.router_aux_loss_coef and scope not in scopes:
        raise ValueError(
            f"{architecture} cannot hold model.router_aux_loss_scope={scope!r} with model.router_aux_loss_coef="
            f"{config.router_aux_loss_coef}; its load-balancing loss is over {' or '.join(scopes)}: set "
            f"model.router_aux_loss_scope to that"
        )
    return config.router_aux_loss_coef


def whole(config: ModelConfig) -> Iterator[tuple[dict, tuple[int, ...]]]:
    """One Hugging Face tensor fills the whole parameter."""
    del config
    yield {}, ()


def dense_layers(config: ModelConfig) -> Iterator[tuple[dict, tuple[int, ...]]]:
    """Hugging Face layer i fills slice i of the dense stack (a decoder with expert blocks, models/mixture.py, whose
    layers are alike; `placements` where they may differ)."""
    for layer in range(config.num_dense_layers):
        yield {"layer": layer}, (layer,)


def moe_layers(config: ModelConfig) -> Iterator[tuple[dict, tuple[int, ...]]]:
    """Hugging Face layer num_dense_layers + j fills slice j of the MoE stack."""
    first = config.num_dense_layers
    for layer in range(config.num_layers - first):
        yield {"layer": first + layer}, (layer,)


def moe_experts(config: ModelConfig) -> Iterator[tuple[dict, tuple[int, ...]]]:
    """Expert e of Hugging Face layer num_dense_layers + j fills slice [j, e] of a stacked expert kernel."""
    for fields, (layer,) in moe_layers(config):
        for expert in range(config.num_experts):
            yield dict(fields, expert=expert), (layer, expert)


@dataclass(frozen=True)
class Placement:
    """One stacked block of ours: its `path` in our state and the Hugging Face layer each slice of its leading axis
    holds."""

    path: tuple[str, ...]
    layers: tuple[int, ...]

    def slices(self, config: ModelConfig) -> Iterator[tuple[dict, tuple[int, ...]]]:
        """Hugging Face layer `layers[i]` fills slice i."""
        del config
        for index, layer in enumerate(self.layers):
            yield {"layer": layer}, (index,)

    def expert_slices(self, config: ModelConfig) -> Iterator[tuple[dict, tuple[int, ...]]]:
        """Expert e of Hugging Face layer `layers[i]` fills slice [i, e] of a stacked expert kernel."""
        for fields, index in self.slices(config):
            for expert in range(config.num_experts):
                yield dict(fields, expert=expert), (*index, expert)


# our stacks of blocks -> (their first layer, their layer count)
STACKS = {
    "layers": lambda config: (0, config.num_layers),
    "dense_layers": lambda config: (0, config.num_dense_layers),
    "moe_layers": lambda config: (config.num_dense_layers, config.num_moe_layers),
}


def placements(config: ModelConfig, stack: str) -> list[Placement]:
    """Where the Hugging Face layers of our `stack` (a name in STACKS) are: one stacked block of a stack whose layers
    are alike, or each block of each group of one whose layer kinds differ (models/stack.py's layout)."""
    first, count = STACKS[stack](config)
    if not count:
        return []
    kinds = config.layer_kinds[first : first + count]
    return [
        Placement((stack, *path), tuple(first + index for index in indices)) for path, indices in block_layout(kinds)
    ]


def nothing(config: ModelConfig) -> tuple[tuple[str, ...], ...]:
    """No parameter paths."""
    del config
    return ()


def every(config: ModelConfig) -> bool:
    """True for every configuration."""
    del config
    return True


def never(config: ModelConfig) -> bool:
    """False for every configuration (an architecture that is only read)."""
    del config
    return False


def same(array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Identity transform (embedding tables, norm scales)."""
    del config
    return array


def heads_in_to_hf(kernel: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Input-projection kernel [in, heads, head_dim] -> Hugging Face weight [heads * head_dim, in]."""
    del config
    return kernel.reshape(kernel.shape[0], -1).T


def heads_out_to_hf(kernel: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Output-projection kernel [heads, head_dim, embed] -> Hugging Face weight [embed, heads * head_dim]."""
    del config
    return kernel.reshape(-1, kernel.shape[-1]).T


def transpose(array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Hugging Face Linear weight [out, in] <-> our kernel [in, out]."""
    del config
    return array.T


@dataclass(frozen=True)
class Tensor:
    """Hugging Face tensors named `hf` <-> our parameter at path `ours` of the model's pure state dict.

    `slices(config)` yields (fields, index): `hf.format(**fields)` names one Hugging Face tensor and `index` is
    the leading indices of our parameter it fills (() for all of it, (layer,) in a stacked one, (layer, expert) in
    stacked expert kernels).
    `to_ours(tensor, config)` gives that slice and `to_hf(slice, config)` the tensor back; both only move elements.
    Where one Hugging Face tensor holds several of our parameters (Qwen3.5's in_proj_qkv: our q, k and v), `ours`
    is a tuple of their paths, `to_ours` returns one slice per path and `to_hf` takes them as a tuple.
    """

    hf: str
    ours: tuple[str, ...] | tuple[tuple[str, ...], ...]
    to_ours: Transform = same
    to_hf: Transform = same
    slices: Slices = whole

    @property
    def paths(self) -> tuple[tuple[str, ...], ...]:
        """The paths of the parameters this tensor fills: (ours,) or ours."""
        return self.ours if isinstance(self.ours[0], tuple) else (self.ours,)

    def parts(self, tensor: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, ...]:
        """to_ours as one slice per path of `paths`."""
        value = self.to_ours(tensor, config)
        return value if isinstance(self.ours[0], tuple) else (value,)

    def joined(self, parts: tuple[np.ndarray, ...], config: ModelConfig) -> np.ndarray:
        """to_hf of one slice per path of `paths`."""
        return self.to_hf(parts if isinstance(self.ours[0], tuple) else parts[0], config)


@dataclass(frozen=True)
class Nesting:
    """Where a checkpoint holds the family's model inside a larger one (a text model beside a vision tower):
    `prefixes` are (its tensors' prefix, the table's) for each form the checkpoints write; tensors under a `skipped`
    prefix are the rest of the larger model, left out of an import for `reason`. The default nests nothing."""

    prefixes: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()
    reason: str = ""

    @classmethod
    def multi_token_prediction(cls, model: str, vision: bool = False) -> Nesting:
        """A Qwen3.5-like checkpoint's multi-token-prediction layers (mtp.*) skipped, and with `vision` the vision
        tower of a ConditionalGeneration, whose text model sits under model.language_model.; one log line each."""
        what = "the multi-token-prediction layers"
        what = f"the vision tower and {what}" if vision else what
        return cls(
            prefixes=(("model.language_model.", "model."),) if vision else (),
            skipped=("model.visual.", "mtp.") if vision else ("mtp.",),
            reason=f"{what}, which the {model} model does not use",
        )

    def table_name(self, name: str) -> str:
        """A checkpoint's tensor `name` as the family's table names it: its first matching prefix replaced."""
        for prefix, table in self.prefixes:
            if name.startswith(prefix):
                return table + name.removeprefix(prefix)
        return name

    def skips(self, name: str) -> bool:
        """Whether tensor `name` belongs to the rest of the larger model."""
        return name.startswith(self.skipped)


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture (config.json `architectures[0]`) <-> one `ModelConfig.family`.

    `config_from_hf(config.json dict) -> ModelConfig` (raises ValueError for features it cannot represent),
    `config_to_hf(ModelConfig) -> config.json dict`, `tensors(ModelConfig) -> [Tensor]` (every tensor of a
    checkpoint of that configuration, in the order they are written). A family whose checkpoints may choose a
    layout in config.json that ModelConfig does not record (e.g. a rotary column order) also gives
    `read_tensors(ModelConfig, config.json dict) -> [Tensor]` for reading them.
    `exports(ModelConfig) -> bool` tells whether this architecture is the one a configuration of `family` is
    exported as (where several share a family), and `zeros(ModelConfig)` the paths of parameters that its
    checkpoints do not hold, set to zeros on reading and not written. `nesting` names the tensors of an architecture
    that holds the model inside a larger one (read only: such a family's `exports` is `never`).
    """

    architecture: str
    family: str
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    tensors: Callable[[ModelConfig], list[Tensor]]
    read_tensors: Callable[[ModelConfig, dict], list[Tensor]] | None = None
    exports: Callable[[ModelConfig], bool] = every
    zeros: Callable[[ModelConfig], tuple[tuple[str, ...], ...]] = nothing
    nesting: Nesting = Nesting()

    def tensors_to_read(self, config: ModelConfig, hf_config: dict) -> list[Tensor]:
        """The tensors of a checkpoint with config.json `hf_config`: read_tensors if given, else tensors."""
        return self.read_tensors(config, hf_config) if self.read_tensors else self.tensors(config)
