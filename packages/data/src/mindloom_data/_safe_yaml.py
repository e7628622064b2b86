"""YAML configs loaded with bounded cost, and config values echoed with bounded size.

`yaml.safe_load` executes nothing, but it expands aliases: a 1.4 KB file of nested
anchors (`b: [*a, *a, ...]`, each level nine times the last) becomes gigabytes in
memory and in any error message that shows it. `load_yaml` composes the node graph
(aliases stay shared references, so composing is cheap), refuses more than
`MAX_ALIASES` alias uses, a recursive alias, or a document whose fully expanded size
is over `MAX_NODES` nodes, and only then constructs Python objects. A file over
`MAX_BYTES` is refused before it is read. Every error is one line naming the file.
`shown` cuts any value to `MAX_SHOWN` characters for an error message.
"""

from __future__ import annotations

import math
import os

__all__ = ["MAX_ALIASES", "MAX_BYTES", "MAX_NODES", "check_finite", "load_yaml", "shown"]

MAX_BYTES = 1 << 20
MAX_ALIASES = 100
MAX_NODES = 100_000
MAX_SHOWN = 80


def shown(value, limit: int = MAX_SHOWN) -> str:
    """`repr(value)` (a string as is) cut to `limit` characters, for one-line errors."""
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _expanded_size(root, path: str) -> int:
    """Nodes of the document with every alias expanded, counted without expanding it."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    uses = 0
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            active.discard(key)
            total = 1
            for child in _children(node):
                total += sizes[id(child)]
                if total > MAX_NODES:
                    raise ValueError(
                        f"config {path}: YAML aliases expand to more than {MAX_NODES} nodes; "
                        "write the values out instead of nesting anchors"
                    )
            sizes[key] = total
            continue
        if key in sizes:
            uses += 1
            if uses > MAX_ALIASES:
                raise ValueError(
                    f"config {path}: more than {MAX_ALIASES} YAML alias uses; "
                    "write the values out instead"
                )
            continue
        if key in active:
            raise ValueError(f"config {path}: a YAML alias refers to itself (recursive)")
        active.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in active:
                raise ValueError(f"config {path}: a YAML alias refers to itself (recursive)")
            stack.append((child, False))
    return sizes[id(root)]


def _children(node) -> list:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return []


def load_yaml(path: str | os.PathLike):
    """The YAML document in `path` (safe types only, bounded; see the module docstring).

    Raises `ValueError` with one line naming the file (and the line, for a syntax error).
    """
    import yaml

    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        if size > MAX_BYTES:
            raise ValueError(f"config {path} is {size} bytes, more than {MAX_BYTES}")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"config {path} is not UTF-8 text (byte {exc.start})") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        raise ValueError(f"invalid YAML in {path}{where}: {shown(str(problem), 200)}") from None
    except RecursionError:
        raise ValueError(f"config {path}: YAML nested too deeply") from None
    finally:
        loader.dispose()


def check_finite(value, key: str = "") -> None:
    """Every float in a (nested) config is finite; ValueError naming the key otherwise."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"config key {key or '(top level)'} must be a finite number, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_finite(v, f"{key}[{i}]")
