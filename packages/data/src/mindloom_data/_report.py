"""Per-step counts and the final report (`report.json` plus a readable `summary.txt`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MAX_EXAMPLES = 3
SNIPPET = 160


@dataclass
class StepStats:
    """Documents and bytes in and out of one step, and why documents were removed."""

    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    removed: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def drop(self, reason: str, doc_id: str, text: str) -> None:
        self.removed[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            snippet = text[:SNIPPET] + ("..." if len(text) > SNIPPET else "")
            ex.append({"id": doc_id, "text": snippet})

    def merge(self, other: StepStats) -> None:
        self.docs_in += other.docs_in
        self.docs_out += other.docs_out
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.removed.update(other.removed)
        for k, v in other.examples.items():
            ex = self.examples.setdefault(k, [])
            ex.extend(v[: MAX_EXAMPLES - len(ex)])

    def to_dict(self) -> dict:
        return {
            "docs_in": self.docs_in,
            "docs_out": self.docs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "removed": dict(sorted(self.removed.items())),
            "examples": {k: self.examples[k] for k in sorted(self.examples)},
        }

    @classmethod
    def from_dict(cls, d: dict) -> StepStats:
        return cls(
            d["docs_in"], d["docs_out"], d["bytes_in"], d["bytes_out"],
            Counter(d["removed"]), {k: list(v) for k, v in d["examples"].items()},
        )  # fmt: skip


def merge_steps(parts: list[dict]) -> dict[str, StepStats]:
    """Merge `{step: StepStats.to_dict()}` mappings from several ranks, keeping step order."""
    out: dict[str, StepStats] = {}
    for part in parts:
        for name, d in part.items():
            out.setdefault(name, StepStats()).merge(StepStats.from_dict(d))
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def summary_text(report: dict) -> str:
    """The report as a few readable lines."""
    lines = []
    r = report["read"]
    lines.append(
        f"read {r['documents']} documents ({_mb(r['bytes'])}) from {r['files']} files"
        + (f" in {report['seconds']:.1f}s" if "seconds" in report else "")
    )
    if r["bad"]:
        lines.append("bad input (skipped, counted):")
        for k, v in r["bad"].items():
            where = ", ".join(r["examples"].get(k, [])[:3])
            lines.append(f"  {k:<22} {v:>9}   e.g. {where}")
    lines.append(
        f"{'step':<18} {'docs in':>10} {'docs out':>10} {'bytes in':>12} {'bytes out':>12}"
    )
    for name, s in report["steps"].items():
        lines.append(
            f"{name:<18} {s['docs_in']:>10} {s['docs_out']:>10} {_mb(s['bytes_in']):>12} {_mb(s['bytes_out']):>12}"
        )
        for reason, n in s["removed"].items():
            ex = s["examples"].get(reason, [])
            eg = f"   e.g. {ex[0]['id']}: {ex[0]['text'][:60]!r}" if ex else ""
            lines.append(f"  - {reason:<24} {n:>8}{eg}")
    c = report.get("clusters")
    if c and c["count"]:
        lines.append(
            f"near-duplicate clusters: {c['count']} (largest {c['largest'][0]['size'] if c['largest'] else 0} docs)"
        )
        for cl in c["largest"][:3]:
            lines.append(f"  kept {cl['kept']} removed {cl['size'] - 1}, e.g. {cl['members'][:2]}")
    o = report["output"]
    lines.append(f"kept {o['documents']} documents ({_mb(o['bytes'])}) in {o['shards']} shards")
    return "\n".join(lines)
