"""YAML text and `--set` overrides -> the schema's dataclasses, every value coerced to its
field's type; one ConfigError line naming the key for anything else. `yaml.safe_load`
semantics, with aliases refused."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mindloom_train._errors import ConfigError

# Anything echoed from a config into a message is cut to this many characters: a hostile
# or mistaken value (a megabyte string, a huge nested list) must not become the message.
MAX_ECHO = 200


def show(value: Any) -> str:
    """repr(value) for an error message, at most MAX_ECHO characters (then an ellipsis)."""
    text = reprlib_repr(value)
    return text if len(text) <= MAX_ECHO else text[: MAX_ECHO - 1] + "\u2026"


def reprlib_repr(value: Any) -> str:
    # reprlib bounds the work as well as the text: a deeply shared structure (YAML
    # aliases, if they ever got through) is never expanded in full just to be cut
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = MAX_ECHO
    r.maxlist = r.maxdict = r.maxtuple = r.maxset = 32
    r.maxlevel = 4
    return r.repr(value)


_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(inf|nan)$", re.I)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _bad(key: str, value: Any, want: str) -> ConfigError:
    return ConfigError(f"config key {key}: expected {want}, got {show(value)}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:  # `X | None`: X's own, more precise, message
            raise errors[0]
        raise _bad(key, value, _type_name(tp))
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise _bad(key, value, "one of " + _type_name(tp))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _bad(key, value, _type_name(tp))
        (item,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _bad(key, value, "a mapping")
        return dict(value)
    from_mapping = getattr(tp, "from_mapping", None)
    if from_mapping is not None:  # a section that reads its own keys (the model section)
        if not isinstance(value, dict):
            raise _bad(key, value, "a mapping")
        return from_mapping(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise _bad(key, value, "true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(key, value, "an integer")
        if not -(2**63) <= value < 2**63:
            raise _bad(key, value, "an integer that fits in 64 bits")
        return value
    if tp is float:
        # Every number of every section passes here (the model section too): one place
        # refuses inf and nan, which no setting means and which a checkpoint (JSON)
        # could not even record.
        if isinstance(value, bool):
            raise _bad(key, value, "a number")
        if isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise _bad(key, value, "a finite number")
            return float(value)
        if isinstance(value, float):
            number = value
        # YAML 1.1 reads `1e-3` as a string; accept any plain number spelling
        elif isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            number = float(value)
        else:
            raise _bad(key, value, "a number")
        if not math.isfinite(number):
            raise _bad(key, value, "a finite number")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise _bad(key, value, "a string")
        return value
    raise _bad(key, value, _type_name(tp))


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix or '<top>'}: expected a mapping, got {show(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    removed = getattr(cls, "removed", {})
    for key in data:
        if key not in names:
            name = key if isinstance(key, str) and len(key) <= MAX_ECHO else show(key)
            where = f"{prefix}.{name}" if prefix else str(name)
            if key in removed:
                raise ConfigError(f"config key {where}: {removed[key]}")
            raise ConfigError(
                f"config key {where}: unknown key (known: {', '.join(sorted(names))})"
            )
    kwargs = {}
    for name in names:
        if name in data:
            kwargs[name] = _coerce(f"{prefix}.{name}" if prefix else name, data[name], hints[name])
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {show(item)}: expected section.key=value")
    key, raw = item.split("=", 1)
    path = [k for k in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"--set {show(item)}: expected section.key=value")
    try:
        value = _safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        problem = show(getattr(exc, "problem", None) or "invalid YAML")[1:-1]
        raise ConfigError(
            f"--set {show(key)[1:-1]}: cannot parse value {show(raw)} ({problem})"
        ) from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {'.'.join(path)}: {part} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


class _NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses every alias (`*name`) before expanding anything.

    A few nested aliases expand to billions of nodes ("billion laughs"): 1.4 KB of YAML
    took 34 s and 2.1 GB and made a 722 MB error message. Run configs are small and
    flat; `--set` and separate configs replace what anchors would share.
    """

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*{show(event.anchor)[1:-1]}) are not supported in a "
                "run config; write the value out", event.start_mark,
            )  # fmt: skip
        return super().compose_node(parent, index)


def _safe_load(text: str) -> Any:
    loader = _NoAliasLoader(text)  # what yaml.safe_load does, with this SafeLoader
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {p}: not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p}: unreadable ({exc})") from None
    try:
        data = _safe_load(text)  # a SafeLoader: a config must not run code
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if len(problem) > MAX_ECHO:
            problem = problem[: MAX_ECHO - 1] + "\u2026"
        raise ConfigError(f"config file {p}:{where}: invalid YAML ({problem})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping, got {show(data)}")
    return data
