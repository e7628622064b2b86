"""ParallelDims: the one conversion from a `parallelism` section and the one rule set.

BAD_LAYOUTS is the table of refused layouts and their exact one-line messages; train's
config check gives the same message behind its "config parallelism: " prefix
(packages/train/tests/test_train_parallel_dims.py reads this table from here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mindloom_parallel import ParallelConfigError, ParallelDims

# (parallelism section, training.global_batch_size, training.micro_batch_size, message)
BAD_LAYOUTS = [
    ({"dp": 2}, 12, 4,
     "training.global_batch_size = 12 is not divisible by parallelism.dp * "
     "training.micro_batch_size = 2 * 4 = 8"),
    ({"dp": 2, "micro_batch_num": 2}, 8, 4,
     "training.global_batch_size = 8 != parallelism.dp * training.micro_batch_size * "
     "parallelism.micro_batch_num = 2 * 4 * 2 = 16"),
    ({"pp": 2}, 8, 2,
     "training.global_batch_size = 8 != parallelism.dp * training.micro_batch_size * "
     "parallelism.micro_batch_num = 1 * 2 * 1 = 2"),
    ({"dp": 0}, 8, 8, "parallelism.dp = 0: must be an integer >= 1"),
    ({"micro_batch_num": 0}, 8, 8, "parallelism.micro_batch_num = 0: must be an integer >= 1"),
    ({"zero_stage": 2}, 8, 8,
     "parallelism.zero_stage = 2: only 0 (off) and 1 (optimizer state) exist"),
    ({"sequence_parallel": True}, 8, 8,
     "parallelism.sequence_parallel = true needs tp > 1 (tp = 1): it splits the sequence "
     "over the tensor-parallel group"),
    ({"bucket_size_mb": -1.5}, 8, 8, "parallelism.bucket_size_mb = -1.5: must be a number > 0"),
]  # fmt: skip


@pytest.mark.parametrize("section, gbs, mbs, message", BAD_LAYOUTS)
def test_bad_layouts_give_one_exact_line(section, gbs, mbs, message):
    dims = ParallelDims.from_section(section)
    with pytest.raises(ParallelConfigError) as e:
        dims.check(global_batch_size=gbs, micro_batch_size=mbs)
    assert str(e.value) == message


def test_from_section_reads_a_mapping_or_a_parsed_section_alike():
    keys = {"dp": 2, "tp": 2, "pp": 1, "sequence_parallel": True, "micro_batch_num": 1,
            "zero_stage": 1, "bucket_size_mb": 8.0}  # fmt: skip
    parsed = SimpleNamespace(**keys, comm_timeout_s=600.0)  # train's section has more keys
    assert ParallelDims.from_section(parsed) == ParallelDims.from_section(keys)
    assert ParallelDims.from_section(keys) == ParallelDims(**keys)
    with pytest.raises(ParallelConfigError, match="parallelism.dpp: unknown key"):
        ParallelDims.from_dict({"dpp": 2})


def test_engine_layouts_and_the_micro_batches_a_worker_runs():
    assert not ParallelDims(dp=4).needs_engine
    assert ParallelDims(tp=2).needs_engine and ParallelDims(pp=2).needs_engine
    assert ParallelDims(dp=2, zero_stage=1).needs_engine
    # micro_batch_num 1 is the trainer's gradient accumulation; a pipeline keeps its own
    assert ParallelDims(dp=2, zero_stage=1).for_steps(3).micro_batch_num == 3
    assert ParallelDims(pp=2, micro_batch_num=4).for_steps(3).micro_batch_num == 4
    assert ParallelDims(dp=2, micro_batch_num=2).for_steps(3).micro_batch_num == 2
