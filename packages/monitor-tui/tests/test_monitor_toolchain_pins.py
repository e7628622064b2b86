"""The snapshot tests' toolchain is pinned and installed as pinned (issue 22 item 5).

`pytest-textual-snapshot` 1.1.0, which an unpinned resolver picks, reads the recorded
snapshots as an "unknown snapshot collection" although the rendered text is identical: the
snapshot tests are only meaningful under the versions they were recorded with. This test
fails when a pin is loosened in hatch.toml or when the environment holds other versions.
"""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import tomllib

HATCH_TOML = Path(__file__).resolve().parents[3] / "hatch.toml"
# what the snapshots under __snapshots__/ were recorded with
RECORDED_UNDER = {"pytest-textual-snapshot": "1.0.0", "syrupy": "7.0.2"}


def _monitor_test_requirements() -> list[str]:
    envs = tomllib.loads(HATCH_TOML.read_text())["envs"]
    return [*envs["default"]["dependencies"], *envs["monitor"]["extra-dependencies"]]


def test_every_monitor_test_tool_is_pinned_exactly():
    reqs = _monitor_test_requirements()
    loose = [r for r in reqs if not re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", r)]
    assert loose == [], f"{HATCH_TOML}: not pinned exactly: {loose}"
    pins = dict(r.split("==") for r in reqs)
    for name, recorded in RECORDED_UNDER.items():
        assert pins.get(name) == recorded, (name, pins.get(name), recorded)


def test_the_environment_holds_the_pinned_versions():
    pins = dict(r.split("==") for r in _monitor_test_requirements() if "==" in r)
    installed = {name: version(name) for name in pins}
    assert installed == pins
