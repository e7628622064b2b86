"""The clean run's config: a typed dataclass tree, parsed from YAML or a dict, then checked.

Edges go one way: `parse_config` (defaults overlaid with the user's keys, unknown keys
refused with their dotted name) -> `CleanConfig` -> `check_config` (values: finite numbers,
fractions, the filters', MinHash's and the web steps' own checks). `load_config` is both.
`CleanConfig.to_dict()` is the plain form that travels to ranks and is recorded in
`.work/run.json` and `report.json` (same keys, same order as `DEFAULTS`).
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from mindloom_data._filters import build_filters
from mindloom_data._minhash import MinHasher
from mindloom_data._normalize import check_normalize_config
from mindloom_data._safe_yaml import check_finite, load_yaml, shown
from mindloom_data._web import WEB_DEFAULTS, check_web_config

__all__ = ["DEFAULTS", "CleanConfig", "CleanError", "check_config", "load_config", "parse_config"]


class CleanError(Exception):
    """A problem with the inputs, the output directory or the config (one line)."""


@dataclass
class NormalizeConfig:
    enabled: bool = True
    nfkc: bool = True
    keep_cjk_punctuation: bool = True
    ansi: bool = True
    control: bool = True
    whitespace: bool = True
    zh_simplified: bool = False

    def normalizer_kwargs(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "enabled"}


@dataclass
class MinHashConfig:
    enabled: bool = True
    num_perm: int = 112
    bands: int = 14
    rows: int = 8
    ngram: int = 5
    cjk_ngram: int = 5
    seed: int = 1
    probe_bands: int = 14
    threshold: float | None = 0.7
    verify: bool = True

    def hasher(self) -> MinHasher:
        return MinHasher(
            num_perm=self.num_perm, bands=self.bands, rows=self.rows, ngram=self.ngram,
            cjk_ngram=self.cjk_ngram, seed=self.seed, probe_bands=self.probe_bands,
        )  # fmt: skip


@dataclass
class ParagraphConfig:
    enabled: bool = True
    min_chars: int = 30


@dataclass
class DedupConfig:
    exact: bool = True
    minhash: MinHashConfig = field(default_factory=MinHashConfig)
    paragraph: ParagraphConfig = field(default_factory=ParagraphConfig)


@dataclass
class OutputConfig:
    jsonl: bool = False
    removed: bool = True
    keep_work: bool = False


@dataclass
class CleanConfig:
    text_key: str = "text"
    id_key: str = "id"  # the records' own id; without one a document is "source:line"
    txt_mode: str = "paragraph"
    partitions: int = 4
    max_bad_fraction: float | None = None
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    filters: dict = field(default_factory=dict)  # name -> params or false (build_filters)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    # The web steps' sections stay plain mappings: _web owns their keys (WEB_DEFAULTS).
    html_key: str | None = None
    extract: dict = field(default_factory=lambda: copy.deepcopy(WEB_DEFAULTS["extract"]))
    repair: dict = field(default_factory=lambda: copy.deepcopy(WEB_DEFAULTS["repair"]))
    language: dict = field(default_factory=lambda: copy.deepcopy(WEB_DEFAULTS["language"]))
    url_filter: dict = field(default_factory=lambda: copy.deepcopy(WEB_DEFAULTS["url_filter"]))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CleanConfig:
        """The tree of a complete plain config (as `to_dict` gives; no checks)."""
        return _build(cls, d)

    @property
    def split_output(self) -> bool:
        return bool(self.language["enabled"] and self.language.get("split_output"))


def _build(cls, d: dict):
    kwargs = {}
    for f in fields(cls):
        v = d[f.name]
        sub = _SUBTREES.get((cls, f.name))
        kwargs[f.name] = _build(sub, v) if sub is not None else copy.deepcopy(v)
    return cls(**kwargs)


_SUBTREES = {
    (CleanConfig, "normalize"): NormalizeConfig,
    (CleanConfig, "dedup"): DedupConfig,
    (CleanConfig, "output"): OutputConfig,
    (DedupConfig, "minhash"): MinHashConfig,
    (DedupConfig, "paragraph"): ParagraphConfig,
}

DEFAULTS: dict = CleanConfig().to_dict()


# --- parsing ------------------------------------------------------------------------------


def parse_config(source: str | os.PathLike | dict | CleanConfig | None) -> CleanConfig:
    """DEFAULTS overlaid with a YAML file or a dict; unknown keys refused (no value checks)."""
    if isinstance(source, CleanConfig):
        return copy.deepcopy(source)
    if source is None:
        user = {}
    elif isinstance(source, dict):
        user = source
    else:
        path = Path(source)
        try:  # bounded: no alias bombs, no oversized files (see _safe_yaml)
            user = load_yaml(path) or {}
        except ValueError as exc:
            raise CleanError(str(exc)) from None
        if not isinstance(user, dict):
            raise CleanError(f"config {path} must be a mapping at the top level")
    cfg = copy.deepcopy(DEFAULTS)
    _overlay(cfg, user, "")
    return CleanConfig.from_dict(cfg)


def _overlay(base: dict, user: dict, prefix: str) -> None:
    for k, v in user.items():
        name = f"{prefix}{shown(k)}"
        if k not in base:
            raise CleanError(f"unknown config key {name} (known: {', '.join(base)})")
        if k == "filters":
            if not isinstance(v, dict):
                raise CleanError("filters must be a mapping")
            base[k] = v
        elif isinstance(base[k], dict):
            if isinstance(v, bool) and "enabled" in base[k]:
                base[k]["enabled"] = v
            elif not isinstance(v, dict):
                raise CleanError(f"config key {name} must be a mapping")
            else:
                _overlay(base[k], v, name + ".")
        else:
            base[k] = v


# --- checks -------------------------------------------------------------------------------


def check_config(cfg: CleanConfig) -> CleanConfig:
    """Refuse a bad value with one line naming its key; returns `cfg` (the web check makes
    the block list's path absolute, ranks may run elsewhere)."""
    plain = cfg.to_dict()
    try:  # finite numbers everywhere: a NaN must never reach report.json
        check_finite(plain)
    except ValueError as exc:
        raise CleanError(str(exc)) from None
    _fraction("max_bad_fraction", cfg.max_bad_fraction)
    _fraction("dedup.minhash.threshold", cfg.dedup.minhash.threshold)
    mc = cfg.dedup.paragraph.min_chars
    if isinstance(mc, bool) or not isinstance(mc, int) or mc < 0:
        raise CleanError(
            f"config key dedup.paragraph.min_chars must be an integer >= 0, got {shown(mc)}"
        )
    try:
        check_normalize_config(plain["normalize"])
        build_filters(cfg.filters)
        if cfg.dedup.minhash.enabled:
            cfg.dedup.minhash.hasher()
        check_web_config(plain)
    except (ValueError, TypeError) as exc:
        raise CleanError(shown(str(exc), 300)) from None
    cfg.url_filter = plain["url_filter"]
    if not isinstance(cfg.partitions, int) or cfg.partitions < 1:
        raise CleanError("partitions must be a positive integer")
    return cfg


def _fraction(key: str, v) -> None:
    if v is None or v is False:  # off
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise CleanError(f"config key {key} must be a number in [0, 1], got {shown(v)}")


def load_config(source: str | os.PathLike | dict | CleanConfig | None) -> CleanConfig:
    """The run's config: parsed, then checked."""
    return check_config(parse_config(source))
