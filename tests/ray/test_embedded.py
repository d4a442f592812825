"""The embedded Ray mixtrain starts on a laptop: only the processes a local run needs."""

from tests.conftest import run_cluster_script


def test_the_embedded_ray_starts_without_the_api_server_and_the_monitors_and_runs_tasks():
    out = run_cluster_script("embedded_lean.py", timeout=120)
    # GCS, raylet and its agents; no autoscaler monitor, log monitor or API server (dashboard head), each of
    # which costs a second or more of CPU at start-up and some of it all through the run
    assert {"gcs_server", "raylet"} <= set(out["processes"]), out
    assert not {"monitor", "log_monitor", "dashboard"} & set(out["processes"]), out
    assert out["answer"] == 49
    assert out["restored"], out
