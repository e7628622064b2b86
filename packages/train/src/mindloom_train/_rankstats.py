"""Per-rank memory and throughput fields of a step record (issue 18: memory per rank).

Every rank measures its own row at a log step every rank reaches; the rows travel in the
all-gather the runner already makes there for the communication share, and rank 0 writes
them as lists in rank order (one record, a `*_ranks` field per quantity, like
`comm_share_ranks`):

- `mem_rss_mb_ranks`: resident set now (host memory), MiB;
- `mem_peak_mb_ranks`: the process's peak resident set so far (VmHWM), MiB;
- `mem_device_peak_mb_ranks`: the device allocator's peak, MiB, where the backend reports
  one (Ascend, GPU); absent on the CPU backend;
- `samples_per_s_ranks`: the samples this rank computes per step (global batch / dp) over
  its mean step time in the log interval.
"""

from __future__ import annotations

from typing import Any

from mindloom_train._metrics import mem_rss_mb, peak_rss_mb

_NO_DEVICE = -1.0


def device_peak_mb() -> float | None:
    """The device allocator's peak (MindSpore's runtime.max_memory_allocated), MiB; None
    on the CPU backend or where MindSpore does not report it."""
    try:
        import mindspore as ms

        if ms.get_context("device_target") == "CPU":
            return None
        return float(ms.runtime.max_memory_allocated()) / 2**20
    except Exception:  # an older MindSpore, or no device runtime: nothing to report
        return None


def memory_row(mean_step_s: float) -> list[float]:
    """This rank's (rss, peak rss, device peak or -1, mean step time)."""
    dev = device_peak_mb()
    return [mem_rss_mb(), peak_rss_mb(), _NO_DEVICE if dev is None else dev, mean_step_s]


def rank_fields(rows, samples_per_rank: float) -> dict[str, Any]:
    """The `*_ranks` fields from every rank's `memory_row`, in rank order."""
    rows = [[float(x) for x in r] for r in rows]
    out: dict[str, Any] = {
        "mem_rss_mb_ranks": [r[0] for r in rows],
        "mem_peak_mb_ranks": [r[1] for r in rows],
        "samples_per_s_ranks": [samples_per_rank / r[3] if r[3] > 0 else None for r in rows],
    }
    if all(r[2] >= 0 for r in rows):
        out["mem_device_peak_mb_ranks"] = [r[2] for r in rows]
    return out


def state_bytes(runner) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of the model state this rank holds, from the
    runner's own tensors: its local parameters (a tensor-parallel slice, a pipeline
    stage), one gradient per parameter in its dtype plus the fp32 accumulation buffers
    of a multi-micro-batch step, and the AdamW moments it keeps (ZeRO-1: its share)."""
    par = getattr(runner, "par", None)
    if par is not None:  # the engine: ZeroAdamW keeps the moments it owns
        params, acc = list(par.params), []
        moments = [*par.opt.exp_avg.values(), *par.opt.exp_avg_sq.values()]
    else:
        ts = runner.train_step
        params, acc = list(runner.params), list(ts.acc or ())
        moments = [*ts.exp_avg, *ts.exp_avg_sq]
    p = sum(int(t.nbytes) for t in params)
    return p, p + sum(int(t.nbytes) for t in acc), sum(int(t.nbytes) for t in moments)


def log_state_bytes(runner, log) -> tuple[int, int, int]:
    """At start, one line per rank: what the layout leaves on this rank."""
    p, g, o = state_bytes(runner)
    log(f"memory: params {p}, grads {g}, optimizer {o} bytes on this rank")
    return p, g, o
