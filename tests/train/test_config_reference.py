"""docs/reference.md is what `python -m train.config.reference` generates from the schema (every key, its type, default
and the meaning its comment in the schema gives), and a field the schema leaves without a comment is refused."""

import dataclasses

import pytest

from tests.train.tiny_run import REPO
from train.config import reference
from train.config.schema import Config


def test_the_checked_in_reference_is_the_schema_s():
    page = (REPO / "docs" / "reference.md").read_text()
    assert page == reference.reference(), (
        "docs/reference.md is stale: python -m train.config.reference > docs/reference.md"
    )


def test_every_key_of_every_section_is_in_the_reference():
    page = reference.reference()
    for section in dataclasses.fields(Config):
        for field in dataclasses.fields(type(section.default_factory())):
            assert f"| `{section.name}.{field.name}` |" in page


@dataclasses.dataclass(frozen=True)
class Documented:
    # the block above a field is its meaning when it has no comment of its own
    above: int = 1
    inline: str = "x"  # its own comment
    nested: tuple[int, ...] = ()  # first line of a comment
    # ...that a block above does not extend


@dataclasses.dataclass(frozen=True)
class Undocumented:
    documented: int = 1  # a meaning
    bare: int = 2


def test_meanings_come_from_the_schema_s_comments():
    assert reference.field_meanings(Documented) == {
        "above": "the block above a field is its meaning when it has no comment of its own",
        "inline": "its own comment",
        "nested": "first line of a comment",
    }
    with pytest.raises(reference.UndocumentedField, match=r"Undocumented\.bare has no comment"):
        reference.field_meanings(Undocumented)
