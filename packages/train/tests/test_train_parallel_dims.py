"""The `parallelism` section is refused by mindloom_parallel's rules with mindloom_parallel's
message, whether train's config check, `mindloom launch` or a worker catches it: one
table, one message per bad layout (the same table as the parallel package's
test_parallel_dims.py), here through `load_config`, the path every train command takes."""

from __future__ import annotations

import pytest
import yaml

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
def test_train_config_refuses_a_layout_with_parallels_message(tmp_path, section, gbs, mbs,
                                                              message):  # fmt: skip
    from mindloom_parallel import ParallelConfigError, ParallelDims
    from mindloom_train._config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "parallelism": section,
        "training": {"global_batch_size": gbs, "micro_batch_size": mbs},
        "run_dir": str(tmp_path / "run"),
    }))  # fmt: skip
    with pytest.raises(ConfigError) as train_err:
        load_config(path, check_model=False)
    with pytest.raises(ParallelConfigError) as parallel_err:
        ParallelDims.from_section(section).check(global_batch_size=gbs, micro_batch_size=mbs)
    assert str(train_err.value) == f"config parallelism: {message}"
    assert str(parallel_err.value) == message
