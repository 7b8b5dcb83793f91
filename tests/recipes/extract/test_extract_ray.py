"""``--engine ray``: Ray Data actors write the same files as the local engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from paths import REPO

from avpipe.recipes.extract import run_extract

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

ROOT = Path(REPO)
SAMPLES = ROOT / "samples"


def tree(out) -> dict:
    out = Path(out)
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def local_ray():
    # the workers import this checkout's avpipe
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "AVPIPE_DISABLE_GPU": "1"}})
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_ray_outputs_equal_local(local_ray, tmp_path, fmt):
    a, b = tmp_path / "local", tmp_path / "ray"
    s1 = run_extract(SAMPLES, preset="quickstart", out_dir=a, devices="cpu", shard_size=4,
                     format=fmt)
    s2 = run_extract(SAMPLES, preset="quickstart", out_dir=b, devices="cpu,cpu", shard_size=4,
                     format=fmt, engine="ray")
    assert s1.complete and s2.complete, s2.failures
    assert s2.total_written == s1.total_written == 18
    assert tree(a) == tree(b)
    # resume on Ray: nothing to do
    s3 = run_extract(SAMPLES, preset="quickstart", out_dir=b, devices="cpu,cpu", shard_size=4,
                     format=fmt, engine="ray")
    assert s3.total_written == 0 and s3.skipped == 18 and tree(b) == tree(a)
