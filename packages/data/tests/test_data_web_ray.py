"""The web steps through the Ray executor (one local Ray instance, 2 CPUs): the same
output bytes as one local worker."""

import sys
from pathlib import Path

import fastwarc  # noqa: F401  (the web extra; the data env installs it)
import ray
from mindloom_data import clean
from mindloom_data._executors import RayExecutor

sys.path.insert(0, str(Path(__file__).parent))
from web_util import ARTICLE_PAGES, http_response, warc_record, write_warc  # noqa: E402


def _outputs(out: Path) -> dict:
    skip = ("report.json", "summary.txt")
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".work" not in p.parts and p.name not in skip
    }


def test_web_pipeline_through_ray_matches_one_worker(tmp_path, monkeypatch):
    # test_data_ray_cluster.py (earlier in the same process) runs its throwaway cluster with
    # token authentication off, and Ray keeps that setting for the driver; the local GCS
    # started here must agree with it, or it refuses the driver
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    src = tmp_path / "in"
    src.mkdir()
    recs = [
        warc_record(url, http_response(html.encode()), n=i)
        for i, (url, html) in enumerate(ARTICLE_PAGES)
    ]
    for k in range(3):
        write_warc(src / f"p{k}.warc.gz", recs[k:] + recs[:1], gz=k != 1)
    cfg = {"language": {"enabled": True, "languages": ["zh", "en"], "split_output": True}}
    local = clean(src, tmp_path / "local", config=cfg, workers=1, progress=False)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 1024**2)  # fmt: skip
    try:
        viaray = clean(src, tmp_path / "ray", config=cfg, executor=RayExecutor(), progress=False)
    finally:
        ray.shutdown()
    assert _outputs(tmp_path / "ray") == _outputs(tmp_path / "local")
    local.pop("seconds"), viaray.pop("seconds")
    assert viaray == local
    assert local["steps"]["language"]["removed"] == {"language_de": 3}
