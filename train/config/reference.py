"""The configuration reference (docs/reference.md), generated from the schema: every key of a run's YAML with its
type, default and meaning, the meaning being the field's own comment in the schema's source (the comment on its
lines, else the block of comment lines right above it), so the page cannot drift from the code; a field without a
comment is an error. The tests compare the checked-in page with this output.

    python -m train.config.reference > docs/reference.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize

from train.config.schema import Config

HEADER = """# Configuration reference

Every key of a run's YAML, with its type, its default and what it means, generated from the schema
(`train/config/schema.py`, `models/config.py`) by `python -m train.config.reference > docs/reference.md`; the
tests fail when this page differs from what the schema says. How a config is written, extended and overridden is
in [Configuration](configuration.md).
"""


class UndocumentedField(ValueError):
    """A schema field with no comment to take its meaning from."""


def field_meanings(cls: type) -> dict[str, str]:
    """Field name -> its meaning: the comment on its definition's lines, else the comment lines right above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    (body,) = ast.parse(source).body
    meanings = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        inline = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        meaning = " ".join(inline or above)
        if not meaning:
            raise UndocumentedField(f"{cls.__name__}.{node.target.id} has no comment in the schema to document it")
        meanings[node.target.id] = meaning
    return meanings


def _default(field: dataclasses.Field):
    """A field's default value, or MISSING when it must be given."""
    if field.default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def default_text(field: dataclasses.Field) -> str:
    """The default as YAML would write it ('required' when there is none)."""
    value = _default(field)
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value and value == value.strip() else repr(value)
    return str(value)


def rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every field of `cls` under `prefix`, nested sections expanded."""
    meanings, table = field_meanings(cls), []
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for field in dataclasses.fields(cls):
        key, kind = f"{prefix}.{field.name}", str(hints[field.name])
        nested = _default(field)
        if dataclasses.is_dataclass(nested):
            table.append((key, "section", "", meanings[field.name]))
            table += rows(type(nested), key)
            continue
        table.append((key, kind, default_text(field), meanings[field.name]))
        element = _element_class(cls, field.name)
        if element is not None:
            table += rows(element, f"{key}[]")
    return table


def _element_class(cls: type, name: str) -> type | None:
    """The dataclass a tuple field's entries are (data.mixture's components), else None."""
    module = inspect.getmodule(cls)
    kind = str({f.name: f.type for f in dataclasses.fields(cls)}[name])
    if not kind.startswith("tuple["):
        return None
    element = getattr(module, kind[len("tuple[") :].split(",")[0].strip(), None)
    return element if dataclasses.is_dataclass(element) else None


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference() -> str:
    """The whole page: one table per section of Config."""
    parts = [HEADER]
    for section in dataclasses.fields(Config):
        cls = type(section.default_factory())
        parts.append(f"\n## {section.name}\n\n{inspect.cleandoc(cls.__doc__ or '')}\n")
        parts.append("\n| key | type | default | meaning |\n| --- | --- | --- | --- |\n")
        for key, kind, default, meaning in rows(cls, section.name):
            parts.append(f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(meaning)} |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
