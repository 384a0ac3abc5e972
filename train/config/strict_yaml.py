"""YAML as the config system reads it (run configs, their `base:` files, model YAMLs, an import's model.yaml, the
values of overrides): a syntax error, or a key given twice in one mapping (which PyYAML would settle silently on the
last), raises ConfigError naming where, the line and, for a repeated key, the key and both of its lines."""

from __future__ import annotations

import collections.abc
import typing

import yaml

from models.config import ConfigError

MERGE = "tag:yaml.org,2002:merge"  # `<<: *defaults`: keys beside it are meant to replace the merged ones


class RepeatedKey(yaml.YAMLError):
    """A mapping states `key` twice: at `first` and at `second` (yaml Marks)."""

    def __init__(self, key: typing.Any, first: yaml.Mark, second: yaml.Mark):
        super().__init__(key)
        self.key, self.first, self.second = key, first, second

    def where(self) -> str:
        """`lines 2 and 5`, or `line 3, columns 8 and 17` for two on one line (a flow mapping)."""
        if self.first.line == self.second.line:
            return f"line {self.first.line + 1}, columns {self.first.column + 1} and {self.second.column + 1}"
        return f"lines {self.first.line + 1} and {self.second.line + 1}"


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that raises RepeatedKey for a mapping stating one key twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[typing.Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE:
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, collections.abc.Hashable):
                continue  # SafeLoader refuses it
            if key in seen:
                raise RepeatedKey(key, seen[key], key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, where: str) -> typing.Any:
    """`text` read as YAML; a syntax error or a repeated key raises ConfigError naming `where` and the lines."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except RepeatedKey as error:
        raise ConfigError(
            f"{where}: key {error.key!r} is given twice in one mapping ({error.where()}); YAML would keep only the "
            f"last: give it once"
        ) from None
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None)
        if problem is None:  # an error without a position, e.g. a control character in the text
            raise ConfigError(f"{where} is not valid YAML: {' '.join(str(error).split())}") from None
        context, start, mark = "", error.context_mark, error.problem_mark
        if error.context and start:
            context = f" ({error.context} from line {start.line + 1}, column {start.column + 1})"
        raise ConfigError(
            f"{where} is not valid YAML: line {mark.line + 1}, column {mark.column + 1}: {problem}{context}"
        ) from None
