"""Placement on a `ray.cluster_utils.Cluster` with declared resources: real placement groups and
actors on a CUDA box, a Mac as Ray 2.60 shows it (GPU + accelerator_type:M2) and CPU-only nodes.
The cluster runs in its own process (tests/ray/cluster_placement.py) so it never touches the
test session's Ray."""

from __future__ import annotations

from tests.conftest import run_cluster_script


def test_each_group_lands_on_its_kind_of_node_and_impossible_requests_fail_at_once():
    out = run_cluster_script("cluster_placement.py", timeout=240)
    explicit = out["explicit"]  # --workers mps:1,cuda:1,cpu:2
    assert (explicit[0]["device"], explicit[0]["node"], explicit[0]["gpus"]) == ("mps", "mac", [0])
    assert (explicit[1]["device"], explicit[1]["node"], explicit[1]["gpus"]) == ("cuda", "cuda-box", [0])
    assert all(w["device"] == "cpu" and w["gpus"] == [] for w in explicit[2:])
    # auto: one worker per GPU, fastest kind first, one CPU worker on each node without a GPU
    assert [(w["device"], w["node"]) for w in out["auto"]] == [
        ("cuda", "cuda-box"),
        ("mps", "mac"),
        ("cpu", "head"),
        ("cpu", "cpu-box"),
    ]
    assert "cuda: 2 needed, 1 in the cluster" in out["impossible"]
    assert "accelerator_type:M2=1" in out["impossible"]  # the message lists what the cluster has
    assert out["impossible_s"] < 5
