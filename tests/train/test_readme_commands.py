"""The `python -m train` commands of README.md and the manual (docs/*.md) work as written: each one's arguments parse
and its config and overrides load (the paths it names stand in for by small files here), and the data examples
train a step on such files."""

import re
import shlex

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.train.test_config import fake_import
from tests.train.tiny_run import REPO, SMALL, records
from train.__main__ import arguments, main
from train.config import load_config

COMMAND = re.compile(r"python -m train (?P<args>.*)")


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_commands() -> list[tuple[str, list[str]]]:
    """('page:line', arguments) of each `python -m train` command in the bash blocks of README.md and docs/:
    continuation lines joined, comments and what follows `&` or `;` left out, a loop's `$i` as 0."""
    return [(f"{page.name}:{line}", argv) for page in PAGES for line, argv in page_commands(page)]


def page_commands(page) -> list[tuple[int, list[str]]]:
    """(line, arguments) of each `python -m train` command in the bash blocks of one markdown page."""
    commands, block, joined, first = [], False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        first = first or number
        joined += line.rstrip("\\").rstrip() + " "
        if line.endswith("\\"):
            continue
        match = COMMAND.search(joined.split(" #")[0])
        if match:
            text = re.split(r"[&;]", match["args"])[0].replace("$i", "0")
            commands.append((first, shlex.split(text)))
        joined, first = "", 0
    return commands


COMMANDS = readme_commands()


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """README path -> a small file or folder of the same kind here."""
    root = tmp_path_factory.mktemp("readme")
    books = root / "books"
    (books / "shelf").mkdir(parents=True)
    text = "def f(x):\n    return x + 1\n" * 40
    for name in ("a.txt", "shelf/b.txt", "c.txt"):
        (books / name).write_text(text)
    (books / "notes.md").write_text("not a .txt: left out by data.file_pattern")
    (root / "corpus.jsonl").write_text("".join(f'{{"content": "{text * 2!r}"}}\n' for _ in range(20)))
    pq.write_table(pa.table({"text": [text] * 20}), root / "corpus.parquet")
    imported = fake_import(root / "imported")
    return {
        "/data/books/": f"{books}/",
        "/data/corpus.jsonl": str(root / "corpus.jsonl"),
        "/data/corpus.parquet": str(root / "corpus.parquet"),
        "imported/NAME": str(imported),
        "runs/": f"{root}/runs/",
    }


def replaced(argv: list[str], stand_ins: dict[str, str]) -> list[str]:
    out = []
    for arg in argv:
        for path, stand_in in stand_ins.items():
            arg = arg.replace(f"={path}", f"={stand_in}")
        out.append(arg)
    return out


def test_the_readme_has_training_commands():
    assert len(COMMANDS) >= 10 and all(argv[0].endswith(".yaml") or argv[0].startswith("--") for _, argv in COMMANDS)


@pytest.mark.parametrize("argv", [argv for _, argv in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_each_readme_command_parses_and_its_config_loads(argv, stand_ins):
    args = arguments().parse_intermixed_args(replaced(argv, stand_ins))
    config = load_config(REPO / args.config, args.overrides, init_params=False)
    assert config.train.steps > 0


@pytest.mark.parametrize("source", ["/data/books/", "/data/corpus.jsonl"])
def test_the_readme_data_examples_train(source, stand_ins, tmp_path):
    """The data commands as written (tiny model, one step): the folder with its `*.txt` pattern, the JSONL field."""
    (argv,) = [argv for _, argv in COMMANDS if f"data.source={source}" in argv]
    output = tmp_path / "run"
    argv = [*replaced(argv, stand_ins), *SMALL, "train.steps=1", "train.sample_tokens=0", "train.eval_batches=0"]
    argv.append(f"train.output_dir={output}")
    assert main(argv) == 0
    assert [row["step"] for row in records(output)] == [1]
