"""Rank <-> (dp, tp, pp) coordinates and the process groups of a layout.

Order (Megatron's): tp varies fastest, then dp, then pp, so a tensor-parallel group is a
block of consecutive ranks (on one node when tp <= GPUs per node):

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from mindloom_parallel._config import ParallelConfig, ParallelConfigError, validate


@dataclass(frozen=True)
class Group:
    """A process group as this rank sees it: the member ranks and our index among them."""

    name: str | None  # None for a one-rank group (no communicator needed)
    ranks: tuple[int, ...]
    index: int
    # the _comm.CommRecorder its timed collectives go to (a ParallelEngine's); None: none
    recorder: Any = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)


def dp_slice(batch: dict, dp_rank: int, dp_size: int) -> dict:
    """This data-parallel rank's contiguous slice of a global batch (dict of [B, ...])."""
    out = {}
    for k, v in batch.items():
        n = v.shape[0]
        if n % dp_size:
            raise ValueError(f"batch[{k!r}] has {n} samples, not divisible by dp = {dp_size}")
        m = n // dp_size
        out[k] = v[dp_rank * m : (dp_rank + 1) * m]
    return out


def rank_coords(rank: int, pcfg: ParallelConfig) -> tuple[int, int, int]:
    """-> (dp_rank, tp_rank, pp_rank)."""
    tp_rank = rank % pcfg.tp
    dp_rank = (rank // pcfg.tp) % pcfg.dp
    pp_rank = rank // (pcfg.tp * pcfg.dp)
    return dp_rank, tp_rank, pp_rank


def coords_rank(dp_rank: int, tp_rank: int, pp_rank: int, pcfg: ParallelConfig) -> int:
    return pp_rank * (pcfg.dp * pcfg.tp) + dp_rank * pcfg.tp + tp_rank


def group_ranks(rank: int, pcfg: ParallelConfig) -> dict[str, tuple[int, ...]]:
    """The member ranks of every group ``rank`` belongs to (pure; used by the tests too).

    tp, dp, pp: the three axes. pp_next / pp_prev: the two-rank group with the neighbouring
    stage (point-to-point). embed: first and last stage (tied embeddings under pp).
    mp: every rank of one model replica (tp x pp), for the global gradient norm.
    """
    d, t, p = rank_coords(rank, pcfg)
    out = {
        "tp": tuple(coords_rank(d, i, p, pcfg) for i in range(pcfg.tp)),
        "dp": tuple(coords_rank(i, t, p, pcfg) for i in range(pcfg.dp)),
        "pp": tuple(coords_rank(d, t, i, pcfg) for i in range(pcfg.pp)),
        "mp": tuple(coords_rank(d, ti, pi, pcfg) for pi in range(pcfg.pp) for ti in range(pcfg.tp)),
        "world": tuple(range(pcfg.world_size)),
    }
    out["pp_next"] = (rank, coords_rank(d, t, p + 1, pcfg)) if p + 1 < pcfg.pp else (rank,)
    out["pp_prev"] = (coords_rank(d, t, p - 1, pcfg), rank) if p > 0 else (rank,)
    last = pcfg.pp - 1
    out["embed"] = (
        (coords_rank(d, t, 0, pcfg), coords_rank(d, t, last, pcfg))
        if pcfg.pp > 1 and p in (0, last)
        else (rank,)
    )
    return out


@dataclass
class ParallelGroups:
    """What ``init_parallel`` returns: this rank's coordinates and its groups."""

    pcfg: ParallelConfig
    rank: int
    world_size: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    tp: Group
    dp: Group
    pp: Group
    mp: Group
    world: Group
    pp_next: Group  # one-rank group on the last stage
    pp_prev: Group  # one-rank group on the first stage
    embed: Group

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pcfg.pp - 1

    def with_recorder(self, recorder) -> ParallelGroups:
        """A copy whose every group times its collectives into ``recorder`` (a
        ``CommRecorder``; ``ParallelEngine`` makes one for its own groups)."""
        kinds = ("tp", "dp", "pp", "mp", "world", "pp_next", "pp_prev", "embed")
        return dataclasses.replace(self, **{
            k: dataclasses.replace(getattr(self, k), recorder=recorder) for k in kinds
        })  # fmt: skip

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} -> dp {self.dp_rank}/{self.pcfg.dp}, "
            f"tp {self.tp_rank}/{self.pcfg.tp}, pp {self.pp_rank}/{self.pcfg.pp}"
        )


def make_groups(rank: int, pcfg: ParallelConfig, create=None) -> ParallelGroups:
    """Groups for ``rank``; ``create(name, ranks)`` makes a communicator (None: don't)."""
    members = group_ranks(rank, pcfg)
    made: dict[tuple[int, ...], str] = {}
    groups = {}
    for kind in ("tp", "dp", "pp", "mp", "world", "pp_next", "pp_prev", "embed"):
        ranks = members[kind]
        if len(ranks) == 1:
            groups[kind] = Group(None, ranks, 0)
            continue
        name = made.get(ranks)
        if name is None:
            if kind == "world" or ranks == tuple(range(pcfg.world_size)):
                name = _world_group_name() if create is not None else "world"
            else:
                name = "ml_" + "_".join(str(r) for r in ranks)
                if create is not None:
                    create(name, list(ranks))
            made[ranks] = name
        groups[kind] = Group(name, ranks, ranks.index(rank))
    d, t, p = rank_coords(rank, pcfg)
    return ParallelGroups(pcfg, rank, pcfg.world_size, d, t, p, **groups)


def _world_group_name() -> str:
    from mindspore.communication import GlobalComm

    return GlobalComm.WORLD_COMM_GROUP


class Communicators:
    """This process's MindSpore communicator (``init`` once) and the groups created on it.

    MindSpore's ``init`` and ``create_group`` are process-wide and may run only once per
    name, so one object per process carries what has been done; ``init_parallel`` takes
    it as an argument (default: ``PROCESS_COMMUNICATORS``), and a caller running several
    layouts in one process passes the same object each time.
    """

    def __init__(self):
        self.initialized = False
        self.created: set[str] = set()

    def init(self) -> tuple[int, int]:
        """-> (rank, world size), initializing communication on the first call."""
        from mindspore.communication import get_group_size, get_rank, init

        if not self.initialized:
            init()
            self.initialized = True
        return get_rank(), get_group_size()

    def create(self, name: str, ranks) -> None:
        from mindspore.communication import create_group

        if name not in self.created:
            create_group(name, list(ranks))
            self.created.add(name)


PROCESS_COMMUNICATORS = Communicators()


def init_parallel(
    pcfg: ParallelConfig, model_cfg=None, comms: Communicators | None = None
) -> ParallelGroups:
    """Initialize communication (under msrun), check the layout, create the process groups.

    One process without msrun (no ``MS_WORKER_NUM`` / ``RANK_SIZE`` in the environment)
    needs no communicator at all; that is the reference run. Calling it again with
    another layout and the same ``comms`` reuses the communicators already made (tests
    run several layouts in one launch).
    """
    launched = any(k in os.environ for k in ("MS_WORKER_NUM", "MS_ROLE", "RANK_SIZE"))
    if not launched:
        validate(pcfg, model_cfg, world_size=1)
        return make_groups(0, pcfg, None)
    comms = PROCESS_COMMUNICATORS if comms is None else comms
    rank, world = comms.init()
    try:
        validate(pcfg, model_cfg, world_size=world)
    except ParallelConfigError as e:
        raise ParallelConfigError(f"rank {rank}: {e}") from None
    return make_groups(rank, pcfg, comms.create)
