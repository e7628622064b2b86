"""The `parallelism` section is refused by mindloom_parallel's rules with mindloom_parallel's
message, whether train's config check, `mindloom launch` or a worker catches it: one
table of bad layouts, BAD_LAYOUTS of the parallel package's test_parallel_dims.py (which
also pins each exact line), read from there; here each line is derived from ParallelDims
itself and must come out of `load_config`, the path every train command takes, behind the
"config parallelism: " prefix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

_DIMS_TESTS = Path(__file__).resolve().parents[2] / "parallel" / "tests" / "test_parallel_dims.py"


def _bad_layouts() -> list:
    spec = importlib.util.spec_from_file_location("parallel_test_parallel_dims", _DIMS_TESTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [(section, gbs, mbs) for section, gbs, mbs, _ in module.BAD_LAYOUTS]


BAD_LAYOUTS = _bad_layouts()


def test_the_table_is_the_parallel_packages():
    assert len(BAD_LAYOUTS) == 8  # every row of the parallel package's table is read


@pytest.mark.parametrize("section, gbs, mbs", BAD_LAYOUTS)
def test_train_config_refuses_a_layout_with_parallels_message(tmp_path, section, gbs, mbs):
    from mindloom_parallel import ParallelConfigError, ParallelDims
    from mindloom_train._config import ConfigError, load_config

    with pytest.raises(ParallelConfigError) as parallel_err:
        ParallelDims.from_section(section).check(global_batch_size=gbs, micro_batch_size=mbs)
    message = str(parallel_err.value)
    assert message.startswith("parallelism.") or message.startswith("training.")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "parallelism": section,
        "training": {"global_batch_size": gbs, "micro_batch_size": mbs},
        "run_dir": str(tmp_path / "run"),
    }))  # fmt: skip
    with pytest.raises(ConfigError) as train_err:
        load_config(path, check_model=False)
    assert str(train_err.value) == f"config parallelism: {message}"
