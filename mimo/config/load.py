"""YAML -> dataclasses, collecting every problem instead of stopping at the first.

Errors are `(dotted.path, reason)` pairs so the CLI can print one line per
problem and users can fix a whole file in one go.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, List, Tuple, Union

import yaml

from .schema import MimoConfig

Problem = Tuple[str, str]
# Returned by the converters for a value that could not be converted, so that
# a legitimate None (an optional field) is not mistaken for a failure.
_INVALID = object()


class ConfigError(ValueError):
    """Raised with every problem found; str() gives the CLI's lines."""

    def __init__(self, problems: List[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(f"error: {p}: {r}" for p, r in self.problems))


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _type_name(args[0])
    if origin in (list, List):
        return "a list of " + _type_name(typing.get_args(tp)[0]) + "s"
    if origin in (dict, Dict):
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _convert(tp, value: Any, path: str, problems: List[Problem]):
    """Convert one YAML value to `tp`; record a problem and return _INVALID on mismatch."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, path, problems)
    if value is None and (dataclasses.is_dataclass(tp) or origin in (dict, Dict)):
        value = {}  # a section left empty in YAML (`encoders:` with its entries commented out): its defaults
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            problems.append((path, f"must be {_type_name(tp)}, got {value!r}"))
            return _INVALID
        _, vtype = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                problems.append((f"{path}.{k}", "keys must be strings"))
                return _INVALID
            out[k] = _convert(vtype, v, f"{path}.{k}", problems)
        return _INVALID if any(v is _INVALID for v in out.values()) else out
    if origin in (list, List):
        if not isinstance(value, list):
            problems.append((path, f"must be {_type_name(tp)}, got {value!r}"))
            return _INVALID
        (etype,) = typing.get_args(tp)
        out = [_convert(etype, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return _INVALID if any(v is _INVALID for v in out) else out
    # bool is a subclass of int in Python; `tp: 2` must not be True and `frozen: 1` not a bool.
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads `1e-4` (no dot) as a string; accept it as a number.
            try:
                value, ok = float(value), True
            except ValueError:
                ok = False
    elif tp is Any:
        ok = True  # a field whose values its own check reads (attention_kernel: mimo.config.kernel)
    elif tp is str:
        # YAML 1.1 reads a bare `off` (also `no`, `false`) as False and `on` as True: a text field
        # written `replan: off` means the word.
        if isinstance(value, bool):
            value = "on" if value else "off"
        ok = isinstance(value, str)
    else:  # pragma: no cover - schema uses only the types above
        ok = True
    if not ok:
        problems.append((path, f"must be {_type_name(tp)}, got {value!r}"))
        return _INVALID
    return value


def _build(cls, data: Any, path: str, problems: List[Problem]):
    if not isinstance(data, dict):
        problems.append((path or "<root>", f"must be a mapping, got {data!r}"))
        return _INVALID
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            problems.append((_join(path, key), f"unknown key (valid keys: {', '.join(sorted(fields))})"))
    kwargs = {}
    missing = False
    for name, f in fields.items():
        sub = _join(path, name)
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], sub, problems)
            if kwargs[name] is _INVALID:
                missing = True
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append((sub, "required field is missing"))
            missing = True
    if missing:
        return _INVALID
    # A field given explicitly as null falls back to its default.
    kwargs = {k: v for k, v in kwargs.items() if v is not None or fields[k].default is None}
    return cls(**kwargs)


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def without_data(raw: Dict[str, Any]) -> Dict[str, Any]:
    """`raw` with mock data in place of its data section (its seq_length and seed kept): for the tools
    that build the model and never read its data (HF export, logits), so that the records, tokenizer
    and media of a training config need not exist where they run."""
    raw = dict(raw)
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    raw["data"] = {"kind": "mock", **{k: data[k] for k in ("seq_length", "seed") if k in data}}
    return raw


def apply_overrides(raw: Dict[str, Any], overrides: List[str]) -> Dict[str, Any]:
    """Apply `a.b.c=value` strings (value parsed as YAML) to a raw config dict."""
    problems: List[Problem] = []
    for item in overrides:
        if "=" not in item:
            problems.append((item, "override must look like dotted.path=value"))
            continue
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            problems.append((item, "override must look like dotted.path=value (a field name is empty)"))
            continue
        node = raw
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                problems.append((key, f"cannot set a key under non-mapping {p!r}"))
                break
        else:
            try:
                node[parts[-1]] = load_yaml(text)
            except yaml.YAMLError as exc:
                problems.append((key, f"cannot parse {text!r} as a YAML value ({yaml_problem(exc)})"))
            except RecursionError:
                problems.append((key, "cannot parse the value as YAML (nested too deeply)"))
    if problems:
        raise ConfigError(problems)
    return raw


class _NoDuplicateKeys(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key written twice in one mapping is an error: plain YAML
    keeps the last value, so a field set twice (say after a paste) would silently drop the first.
    Keys brought in by a merge (`<<: *base`) may still be overridden; a mapping merged in is held to
    the same rule."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self._check_unique(node)
        return super().construct_mapping(node, deep)

    def _check_unique(self, node: yaml.MappingNode) -> None:
        first = {}
        for i, (key_node, value_node) in enumerate(node.value):
            if key_node.tag == "tag:yaml.org,2002:merge":
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source in sources:
                    if isinstance(source, yaml.MappingNode):
                        self._check_unique(source)
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                j = first.setdefault(key, i)
            except TypeError:  # an unhashable key: the base class names that problem
                continue
            if j != i:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"key {key!r} written twice (first at line {node.value[j][0].start_mark.line + 1})",
                    key_node.start_mark)


def load_yaml(stream) -> Any:
    """`yaml.safe_load`, refusing duplicate keys in a mapping."""
    return yaml.load(stream, Loader=_NoDuplicateKeys)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's problem and where, in one line."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


def read_yaml(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = load_yaml(f)
    except FileNotFoundError:
        raise ConfigError([(path, "no such file")]) from None
    except IsADirectoryError:
        raise ConfigError([(path, "is a directory, not a YAML file")]) from None
    except UnicodeDecodeError:
        raise ConfigError([(path, "not UTF-8 text (a YAML config is text)")]) from None
    except OSError as exc:
        raise ConfigError([(path, f"cannot read it ({exc.strerror or exc})")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([(path, f"invalid YAML: {yaml_problem(exc)}")]) from None
    except RecursionError:  # PyYAML builds nested collections recursively
        raise ConfigError([(path, "invalid YAML: nested too deeply")]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([("<root>", "the config must be a mapping")])
    return raw


def build_config(raw: Dict[str, Any]) -> Tuple[MimoConfig, List[Problem]]:
    """Dataclasses from a raw dict, plus the problems found on the way.

    Raises ConfigError when the dataclasses cannot be built at all (a wrong
    type, a missing field); unknown keys are only reported, so that semantic
    validation can still run and the user sees every problem at once.
    """
    problems: List[Problem] = []
    raw = dict(raw)
    raw.setdefault("data", {})
    raw.setdefault("parallelism", {})
    cfg = _build(MimoConfig, raw, "", problems)
    if cfg is _INVALID:
        raise ConfigError(problems)
    language = (raw.get("model") or {}).get("language")
    if cfg.data.packing and cfg.data.kind != "mock" and isinstance(language, dict) and "attention" not in language:
        # Packed samples must not attend to each other, and only bitfield attention masks by document:
        # packing without an attention named takes it (one named otherwise is still an error).
        cfg.model.language.attention = "bitfield"
    return cfg, problems
