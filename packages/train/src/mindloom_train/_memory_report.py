"""The memory estimate as a table, and the trainer's and launcher's pre-flight check."""

from __future__ import annotations

from mindloom_train._memory_devices import GiB, MiB, _cfg_error, check_precision
from mindloom_train._memory_estimate import Estimate, estimate

# ---------------------------------------------------------------------------------------
# output


def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def format_table(est: Estimate, compact: bool = False) -> str:
    lay = est.layout
    head = (
        f"memory estimate per rank (most-loaded: pipeline stage {lay['most_loaded_stage']} of "
        f"{lay['pp']}; dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} zero={lay['zero_stage']}; "
        f"micro-batch {lay['micro_batch_size']} x {lay['seq_length']}, recompute "
        f"{lay['recompute']}; params {lay['param_dtype']}, compute {lay['compute_dtype']})"
    )
    lines = [head]
    for name, val in est.components.items():
        lines.append(f"  {name:24s} {_fmt(val):>12s}")
    if not compact:
        lines.append(f"  {'(activations per layer)':24s} {_fmt(est.per_layer_activation):>12s}")
        if lay["pp"] > 1:
            per = ", ".join(_fmt(x) for x in est.stage_totals)
            lines.append(f"  {'(total per stage)':24s} {per}")
    lines.append(f"  {'total':24s} {_fmt(est.total):>12s}")
    lines.append(f"  {'usable on ' + est.device:24s} {_fmt(est.usable):>12s}  ({est.device_note})")
    pct = 100.0 * est.total / est.usable if est.usable else float("inf")
    lines.append(f"  verdict: {est.verdict} ({pct:.0f}% of usable)")
    for note in est.notes:
        lines.append(f"  note: {note}")
    if est.suggestions:
        lines.append("  what would make it fit (one change each):")
        for sug in est.suggestions:
            mark = "fits" if sug["fits"] else "still too big"
            lines.append(f"    {sug['change']:52s} {_fmt(sug['total']):>12s}  {mark}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# the trainer's and the launcher's check


def preflight(cfg, vocab_size: int | None, world: int, log, mcfg=None,
              ranks_per_host: int | None = None) -> Estimate:  # fmt: skip
    """Precision check, then the estimate printed compactly to `log`; a run that would not
    fit is refused (ConfigError, exit 2) unless training.ignore_memory_estimate."""
    check_precision(cfg, mcfg)
    est = estimate(
        cfg, nproc=world, vocab_size=vocab_size, mcfg=mcfg, ranks_per_host=ranks_per_host
    )
    for line in format_table(est, compact=True).splitlines():
        log(line)
    if not est.fits:
        if getattr(cfg.training, "ignore_memory_estimate", False):
            log(
                "memory: the estimate exceeds the device; training.ignore_memory_estimate=true, going on"
            )
        else:
            raise _cfg_error(
                f"memory: the estimate {_fmt(est.total)} per rank exceeds the usable "
                f"{_fmt(est.usable)} on {est.device} (table above; `mindloom estimate-memory` "
                "shows what would fit); --set training.ignore_memory_estimate=true overrides"
            )
    return est
