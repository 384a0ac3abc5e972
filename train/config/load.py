"""Reading a run config: YAML files with `base:` inheritance, dotted overrides, typed sections.

Precedence, lowest first: checkpoint.init_from's import when the config says `model_from_init: true`
(train/config/imported.py), the config's files (each `base:` under the file that names it), command-line overrides.
A key a file states twice raises `ConfigError` naming the file, the key and both lines (train/config/strict_yaml.py),
and an unknown key or a value of the wrong type one naming the key, the value and what is allowed; `load_config` then
validates the relations between values (train/config/validate.py) and extends the model to model.context_length
(models.config.extend_context), logging how.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import types
import typing
import warnings

import yaml

from models.config import ConfigError, extend_context, require
from train.config.imported import MODEL_FROM_INIT, MODEL_YAML, import_layer
from train.config.schema import Config
from train.config.strict_yaml import parse_yaml
from train.config.validate import validate

log = logging.getLogger(__name__)


def _read_yaml(path: pathlib.Path, seen: tuple[pathlib.Path, ...] = ()) -> dict:
    """Reads one YAML file and merges it over its `base:` files (a path or a list, relative to it)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config {path}: `base:` cycle through {[str(p) for p in seen]}")
    if path.is_dir():
        inside = " (a run directory's is its config.yaml)" if (path / "config.yaml").is_file() else ""
        raise ConfigError(f"config {path} is a directory; give a YAML file{inside}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config {path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset {error.start}); "
            f"save it as UTF-8"
        ) from None
    raw = parse_yaml(text, f"config {path}") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path}: top level must be a mapping, got {type(raw).__name__}")
    merged: dict = {}
    for base in _base_paths(raw.pop("base", []), path):
        _merge(merged, _read_yaml(path.parent / base, (*seen, path)))
    _merge(merged, raw)
    return merged


def _base_paths(bases: typing.Any, path: pathlib.Path) -> list[str]:
    """The `base:` value of config `path` as a list of paths; ConfigError when it is not a path or a list of them."""
    paths = [bases] if isinstance(bases, str) else bases
    if not isinstance(paths, list) or not all(isinstance(base, str) for base in paths):
        raise ConfigError(
            f"config {path}: base={bases!r} is not allowed; base: is a file path or a list of file paths "
            f"(relative to {path.parent})"
        )
    return paths


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def parse_override(text: str) -> tuple[list[str], typing.Any]:
    """`train.steps=100` -> (["train", "steps"], 100): the value read as YAML, except for a key whose type is str,
    which takes the text as written unless YAML reads it as a string too (quotes then come off): `*.txt` (a YAML
    alias), `123`, `yes` or `null` stay text there."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, value = text.split("=", 1)
    keys = key.strip().split(".")
    if _field_type(keys) is str:
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = None
        return keys, parsed if isinstance(parsed, str) else value
    return keys, parse_yaml(value, f"override {text!r}") if value else ""


def warn_repeated(overrides: typing.Sequence[str]) -> None:
    """A warning for each key a command line overrides twice with different values (the last is used)."""
    given: dict[str, str] = {}
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        if given.get(key, text) != text:
            log.warning("override %s given twice (%r, then %r): the last is used", key, given[key], text)
        given[key] = text


def _field_type(keys: list[str]):
    """The declared type of the Config field at dotted `keys` (None when the path names no field)."""
    cls = Config
    for key in keys[:-1]:
        cls = typing.get_type_hints(cls).get(key) if dataclasses.is_dataclass(cls) else None
    return typing.get_type_hints(cls).get(keys[-1]) if dataclasses.is_dataclass(cls) else None


def load_config(
    path: str | pathlib.Path | None, overrides: typing.Sequence[str] = (), *, init_params: bool = True
) -> Config:
    """Reads a YAML config (or the defaults when path is None), applies overrides, takes the model from
    checkpoint.init_from's import when the config says `model_from_init: true`, validates, and extends the model to
    model.context_length. init_params=False (a plan): nothing reads init_from's parameters, so it is set to "" once
    the model is taken from it, and need not exist otherwise."""
    raw = _read_yaml(pathlib.Path(path)) if path else {}
    for text in overrides:
        _set(raw, *parse_override(text), f"override {text!r}")
    raw = _over_import(raw)
    if not init_params:
        _set(raw, ["checkpoint", "init_from"], "", "init_params=False")
    config = from_dict(Config, raw, "")
    validate(config)
    model, extension = extend_context(config.model)
    if extension:
        log.info(extension)
    return dataclasses.replace(config, model=model)


def _set(raw: dict, keys: list[str], value: typing.Any, what: str) -> None:
    """raw[keys[0]][keys[1]]... = value, making sections on the way; ConfigError (naming `what`) for a non-section."""
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{what}: {key} is not a section")
    node[keys[-1]] = value


def _over_import(raw: dict) -> dict:
    """`raw` merged over checkpoint.init_from's import (imported.import_layer) when it says `model_from_init: true`
    (the key removed: a resolved config states its whole model). A rope_scaling in `raw` drops the import's
    max_position_embeddings unless `raw` states that too: it was what the import's rope covers."""
    wanted = raw.pop(MODEL_FROM_INIT, False)
    require(isinstance(wanted, bool), f"{MODEL_FROM_INIT}={wanted!r} must be true or false")
    if not wanted:
        return raw
    checkpoint = raw.get("checkpoint")
    init_from = checkpoint.get("init_from", "") if isinstance(checkpoint, dict) else ""
    layer = import_layer(init_from)
    model = raw.get("model")
    if isinstance(model, dict) and "rope_scaling" in model and "max_position_embeddings" not in model:
        layer["model"]["max_position_embeddings"] = 0  # it said what the import's rope covers, which is replaced
    log.info("the model of %s, under the config's model keys", pathlib.Path(init_from) / MODEL_YAML)
    _merge(layer, raw)
    return layer


# keys that did something once and no longer do: read with a warning (a run directory's config.yaml may hold them)
RETIRED = {
    "parallel.fused_attention": "cuDNN attention is parallel.attention_kernel=cudnn, the default (auto) on Hopper GPUs",
}


def from_dict(cls, raw: typing.Any, prefix: str):
    """Builds dataclass `cls` from a mapping, checking every key and type (a RETIRED key is dropped, with a
    warning)."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if f"{prefix}{key}" in RETIRED:
            warnings.warn(f"config key '{prefix}{key}' is ignored: {RETIRED[f'{prefix}{key}']}", stacklevel=2)
            continue
        if key not in names:
            raise ConfigError(f"unknown key '{prefix}{key}'; allowed keys in {where}: {', '.join(names)}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs and _required(f)]
    if missing:
        raise ConfigError(f"{where} needs {', '.join(f'{prefix}{name}' for name in missing)}; got {raw!r}")
    return cls(**kwargs)


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _coerce(hint, value, key: str):
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key + ".")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        for option in options:
            try:
                return _coerce(option, value, key)
            except ConfigError:
                continue
        names = " or ".join("null" if option is type(None) else _type_name(option) for option in options)
        raise ConfigError(f"{key}={value!r} has type {type(value).__name__}; expected {names}")
    if origin is tuple and isinstance(value, list | tuple):  # tuple[T, ...]: a YAML list of T
        item = typing.get_args(hint)[0]
        return tuple(_coerce(item, element, f"{key}[{i}]") for i, element in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is type(None) and value is None:
        return None
    if isinstance(hint, type) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{key}={value!r} has type {type(value).__name__}; expected {_type_name(hint)}")


def _type_name(hint) -> str:
    """'float', 'a list of int', ... for a config field's type."""
    if typing.get_origin(hint) is tuple:
        return f"a list of {typing.get_args(hint)[0].__name__}"
    return getattr(hint, "__name__", str(hint))


def to_dict(config: Config) -> dict:
    """The config as nested plain dicts and lists (what config.yaml and a checkpoint's `meta` hold)."""
    return dataclasses.asdict(
        config, dict_factory=lambda items: {k: list(v) if isinstance(v, tuple) else v for k, v in items}
    )
