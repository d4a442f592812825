from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs `pytest -n 2 --dist load` (pytest-xdist): the two processes take tests one by one and end
    within seconds of each other (2026-12-06: 8 s apart in a full run). The tests whose assertions follow measured
    speed (balanced shares, the leave-out advisor: test_balancing) are handed out last. (Until 2026-12-06 this hook
    also marked an xdist_group per folder for `--dist loadgroup`; xdist reads the marks before this hook runs, so
    they never took effect, and the docstring's "side" and "main" processes did not exist.)"""
    items.sort(key=lambda item: item.path.name == "test_balancing.py")  # stable: the rest keep their order


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session: starting Ray costs seconds."""
    import ray

    from mixtrain.cluster import connect

    # Ray workers inherit the environment: make tests.models importable there.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Once one peer's collective timeout has fired, the others get this long to answer before they too are
    # declared lost: 15 s by default (a laptop waking up), 3 s here, where every lost worker is a real one
    os.environ.setdefault("MIXTRAIN_LOST_GRACE_S", "3")
    # A leave-out must save 10 s of the training left by default; the tests' runs last seconds, and the tests
    # of leaving out are about the decision (tests/unit/test_policies.py tests the payback rule)
    os.environ.setdefault("MIXTRAIN_LEAVE_OUT_PAYBACK_S", "0")
    # Fits keep their workers for the next fit that asks for the same ones (ScalingConfig.keep_workers): each
    # new worker process costs about 2 s of CPU to start, and the suite runs hundreds of fits on 2 cores. So
    # nearly every test also trains on reused workers; tests/ray/test_warm_workers.py tests reuse itself
    os.environ.setdefault("MIXTRAIN_KEEP_WORKERS", "1")
    # this session's own Ray, even where another cluster runs on the machine, as mixtrain starts one
    connect.start_embedded(num_cpus=4, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_session) -> str:
    """The session Ray's address, for `mixtrain ... --address`: a CLI run that connects to it skips starting
    (and stopping) a Ray of its own, seconds of CPU each. Tests of the embedded Ray itself do not use it."""
    import ray

    return ray.get_runtime_context().gcs_address


def run_cluster_script(name: str, timeout: float, **env: str) -> dict:
    """Run tests/ray/<name> as its own process (its own ray.cluster_utils.Cluster, apart from the test
    session's Ray) and return the JSON object it prints last."""
    import json
    import subprocess
    import sys

    full_env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", **env}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "ray" / name)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_records(run_dir: Path, kind: str) -> list[dict]:
    """The records of one kind ("round", "plan", "failure", ...) from a run folder's metrics.jsonl."""
    import json

    lines = (Path(run_dir) / "metrics.jsonl").read_text().split("\n")[:-1]  # whole lines: a running run writes on
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (no Ray): what a worker alone in its group holds."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
