"""What the training loop and a step runner exchange (`_runner` chooses the runner): the
inputs of one step, its result, the runner protocol, the batch as tensors, the parameters
from a checkpoint, and the stop flags' encoding.

The stop rule, the same for every runner: the loop acts on the `stop` and `time_up` of the
`StepResult`, never on a flag only this rank has seen. With several ranks these are each
rank's flags as it entered the step's collective, OR-ed over the ranks (so every rank saves,
evaluates and leaves at the same step; a signal that arrives later is carried into the next
step); with one rank there is nobody to agree with and they are read after the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mindloom_train import _checkpoint as ck
from mindloom_train._throughput import ThroughputWindow

__all__ = ["StepInputs", "StepResult", "StepRunner", "load_params", "tensors"]

Flags = Callable[[], tuple[bool, bool]]  # this rank's (stop requested, time limit passed) now


@dataclass(frozen=True)
class StepResult:
    loss: float
    gnorm: float
    ok: bool  # the update was applied
    stop: bool  # agreed: a stop signal reached some rank
    time_up: bool  # agreed: some rank passed training.time_limit_s
    comm_s: float = 0.0  # time in collectives, where the host can time them (the engine)
    rank_step_s: float = 0.0


@dataclass
class StepInputs:
    """What the loop hands a runner for one step."""

    step: int  # the update being computed (1-based)
    batches: Iterator[dict[str, np.ndarray]]  # the loader: grad_accum_steps micro-batches
    hyper: Callable[..., Any]  # keyword overrides -> the step's hyper vector
    flags: Flags
    faults: dict[str, Any] = field(default_factory=dict)  # test-only hyper overrides


class StepRunner(Protocol):
    """What the loop calls. Two optional methods (found with `getattr`, so a runner
    without them keeps the gathered checkpoint, `checkpoint_shards` / `load`):
    `own_shards() -> _ckpt_own.OwnShards | None`, the files this rank writes itself into
    a distributed checkpoint with their metadata.json chunks (global offsets), and
    `load_plan() -> _ckpt_own.LayoutState | None`, the blocks it holds, read at resume
    (balanced loading) and assigned with its `load`."""

    def step(self, inp: StepInputs) -> StepResult: ...
    def eval_loss(self, batch: dict[str, np.ndarray]) -> float: ...
    def checkpoint_shards(self) -> tuple[dict, dict] | None: ...
    def load(self, tensors: dict[str, np.ndarray], where: str) -> None: ...
    def load_weights(self, tensors: dict[str, np.ndarray], where: str) -> None: ...
    def comm_fields(self, window: ThroughputWindow, probe: bool) -> dict[str, Any]: ...
    def extra_fields(self) -> dict[str, Any]: ...


def tensors(batch: dict[str, np.ndarray]):
    from mindspore import Tensor

    return (
        Tensor(batch["tokens"]),
        Tensor(batch["labels"]),
        Tensor(batch["position_ids"]),
        Tensor(batch["segment_ids"]),
        Tensor(batch["loss_mask"]),
    )


def load_params(params, arrays: dict[str, np.ndarray], where: str) -> None:
    """Every parameter from `arrays`, by name, shapes checked; no other name allowed."""
    import mindspore as ms

    ck.check_tensor_names({p.name for p in params}, set(arrays), where)
    for p in params:
        arr = arrays[p.name]
        if tuple(arr.shape) != tuple(p.shape):
            raise ck.CheckpointError(
                f"{where}: tensor {p.name!r} has shape {list(arr.shape)}, the model expects {list(p.shape)}"
            )
        p.set_data(ms.Tensor(arr, p.dtype))


# The stop slot of the hyper vector is averaged over the data-parallel ranks inside the
# compiled step. A stop signal adds 1 and a passed time limit adds 1 / (2 dp), so the mean
# times dp is (ranks stopping) + (ranks out of time) / (2 dp): both are read back from it.
def _encode_flags(stop: bool, time_up: bool, dp: int) -> float:
    return (1.0 if stop else 0.0) + (0.5 / dp if time_up else 0.0)


def _decode_flags(mean: float, dp: int) -> tuple[bool, bool]:
    total = mean * dp
    n_stop = math.floor(total + 0.25)
    return n_stop > 0, total - n_stop > 0.25 / dp
