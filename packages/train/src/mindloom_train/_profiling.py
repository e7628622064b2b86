"""The `profiler` section mapped onto MindSpore's profiler (`mindspore.profiler.profile`).

| key | MindSpore |
|---|---|
| `start_step`, `end_step` | `schedule(active=end_step - start_step + 1)`, the profiler started before step `start_step - warmup_steps` |
| `warmup_steps` | `schedule(warmup=...)`: steps run under the profiler whose data is dropped (the first profiled steps pay the profiler's own start-up) |
| `profile_memory` | `profile_memory=True` (operator memory records) |
| `with_stack` | `with_stack=True` (Python call stacks of the operators) |
| `ranks` | which ranks profile (null: every rank) |
| `output_dir` | `tensorboard_trace_handler(dir_name=...)` (null: RUN_DIR/profile); each rank's trace in `rank<R>_<time>_ascend_ms/` there |

Pure Python (the plan); `start` imports MindSpore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProfilePlan:
    rank: int
    first_step: int  # the profiler starts before this step (warmup included)
    start_step: int  # the first step whose trace is kept
    end_step: int
    warmup: int
    active: int
    profile_memory: bool
    with_stack: bool
    output_dir: str
    worker_name: str

    def describe(self) -> str:
        skipped = f", {self.warmup} warmup step(s) before it not kept" if self.warmup else ""
        what = ", ".join(n for n, on in (("memory", self.profile_memory),
                                        ("call stacks", self.with_stack)) if on)  # fmt: skip
        return (f"profiler: rank {self.rank} profiles steps {self.start_step}-{self.end_step}"
                f"{skipped}{'; with ' + what if what else ''}; trace in "
                f"{self.output_dir}/{self.worker_name}_*_ascend_ms")  # fmt: skip


def profiler_plan(pcfg, rank: int, default_dir: str) -> ProfilePlan | None:
    """What this rank profiles, or None (profiler off, or another rank's job)."""
    if not pcfg.enabled or (pcfg.ranks is not None and rank not in pcfg.ranks):
        return None
    warmup = min(pcfg.warmup_steps, max(pcfg.start_step - 1, 0))  # never before step 1
    return ProfilePlan(
        rank=rank, first_step=pcfg.start_step - warmup, start_step=pcfg.start_step,
        end_step=pcfg.end_step, warmup=warmup, active=pcfg.end_step - pcfg.start_step + 1,
        profile_memory=pcfg.profile_memory, with_stack=pcfg.with_stack,
        output_dir=pcfg.output_dir or default_dir, worker_name=f"rank{rank}",
    )  # fmt: skip


def start(plan: ProfilePlan, device_target: str) -> Any:
    """A started `mindspore.profiler.profile` for `plan`; call `.step()` after every step
    from `plan.first_step` on and `.stop()` after `plan.end_step`."""
    from mindspore.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    acts = [ProfilerActivity.CPU]
    if device_target == "Ascend":
        acts.append(ProfilerActivity.NPU)
    elif device_target == "GPU":
        acts.append(ProfilerActivity.GPU)
    prof = profile(
        activities=acts, with_stack=plan.with_stack, profile_memory=plan.profile_memory,
        schedule=schedule(wait=0, warmup=plan.warmup, active=plan.active, repeat=1),
        on_trace_ready=tensorboard_trace_handler(dir_name=plan.output_dir,
                                                 worker_name=plan.worker_name),
    )  # fmt: skip
    prof.start()
    return prof
