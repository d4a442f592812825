"""Device groups -> Ray bundles, the 'auto' groups, and fast refusal of impossible requests."""

from __future__ import annotations

import pytest

from mixtrain import DeviceGroup, ScalingConfig
from mixtrain.cluster.placement import NodeInfo, auto_groups, infeasible, resolve_scaling, worker_specs
from mixtrain.config import parse_workers

HEAD = {"node:__internal_head__": 1.0}
LINUX_GPU = NodeInfo("n-cuda", "10.0.0.1", {"CPU": 8, "GPU": 2, "accelerator_type:A100": 1, **HEAD})
MAC = NodeInfo("n-mac", "10.0.0.2", {"CPU": 10, "GPU": 1, "accelerator_type:M2": 1})  # Ray 2.60 on a Mac
CPU_BOX = NodeInfo("n-cpu", "10.0.0.3", {"CPU": 4})


def labelled(node: NodeInfo, **extra: float) -> NodeInfo:
    """The node as `mixtrain cluster up/join` starts it: cuda/mps custom resources."""
    return NodeInfo(node.node_id, node.ip, {**node.resources, **extra})


def test_auto_makes_one_worker_per_gpu_and_a_cpu_worker_per_gpuless_node_fastest_first():
    groups = auto_groups([CPU_BOX, MAC, LINUX_GPU])
    assert [(g.device, g.num_workers, g.node) for g in groups] == [
        ("cuda", 2, "n-cuda"),
        ("mps", 1, "n-mac"),
        ("cpu", 1, "n-cpu"),
    ]
    assert groups[2].resources() == {"CPU": 4.0}
    scaling = resolve_scaling(ScalingConfig(groups="auto"), [CPU_BOX, MAC, LINUX_GPU])
    assert scaling.num_workers == 4
    specs = worker_specs(scaling, [CPU_BOX, MAC, LINUX_GPU])
    assert [s.label_selector["ray.io/node-id"] for s in specs] == ["n-cuda", "n-cuda", "n-mac", "n-cpu"]
    assert specs[0].bundle == {"CPU": 1.0, "GPU": 1.0}
    assert specs[3].threads == 4


def test_auto_on_a_cpu_only_laptop_is_one_worker_with_every_core():
    [group] = auto_groups([NodeInfo("me", "127.0.0.1", {"CPU": 2, **HEAD})])
    assert (group.device, group.num_workers, group.resources()) == ("cpu", 1, {"CPU": 2.0})


def test_cuda_and_mps_are_told_apart_by_custom_resources_when_nodes_carry_them():
    nodes = [labelled(LINUX_GPU, cuda=2), labelled(MAC, mps=1)]
    specs = worker_specs(ScalingConfig(groups=parse_workers("cuda:2,mps:1,cpu:1")), nodes)
    assert [s.device for s in specs] == ["cuda", "cuda", "mps", "cpu"]
    assert specs[0].bundle == {"CPU": 1.0, "GPU": 1.0, "cuda": 1.0}
    assert specs[2].bundle == {"CPU": 1.0, "GPU": 1.0, "mps": 1.0}
    assert specs[3].bundle == {"CPU": 1.0}
    assert infeasible(specs, nodes) is None


def test_on_a_plain_ray_cluster_cuda_and_mps_are_told_apart_by_accelerator_type():
    specs = worker_specs(
        ScalingConfig(groups=[DeviceGroup(device="cuda"), DeviceGroup(device="mps")]), [LINUX_GPU, MAC]
    )
    assert specs[0].bundle == {"CPU": 1.0, "GPU": 1.0, "accelerator_type:A100": 0.001}
    assert specs[1].bundle == {"CPU": 1.0, "GPU": 1.0, "accelerator_type:M2": 0.001}


def test_an_older_ray_mac_with_only_the_mps_resource_gets_no_gpu_request():
    old_mac = NodeInfo("old", "10.0.0.4", {"CPU": 8, "mps": 1})
    [spec] = worker_specs(ScalingConfig(groups=[DeviceGroup(device="mps")]), [LINUX_GPU, old_mac])
    assert spec.bundle == {"CPU": 1.0, "mps": 1.0}
    assert infeasible([spec], [LINUX_GPU, old_mac]) is None


def test_auto_on_an_older_ray_mac_asks_for_mps_not_gpu():
    old_mac = NodeInfo("old", "10.0.0.4", {"CPU": 8, "mps": 1})
    scaling = resolve_scaling(ScalingConfig(groups="auto"), [LINUX_GPU, old_mac])
    specs = worker_specs(scaling, [LINUX_GPU, old_mac])
    assert [s.device for s in specs] == ["cuda", "cuda", "mps"]
    assert specs[2].bundle == {"CPU": 1.0, "GPU": 0.0, "mps": 1.0}
    assert infeasible(specs, [LINUX_GPU, old_mac]) is None


def test_fractional_gpus_and_ray_train_knobs_keep_their_meaning():
    scaling = ScalingConfig(
        num_workers=4, use_gpu=True, resources_per_worker={"CPU": 2, "GPU": 0.5}, accelerator_type="A100"
    )
    specs = worker_specs(scaling, [LINUX_GPU])
    assert all(s.device == "gpu" for s in specs)
    assert specs[0].bundle == {"CPU": 2.0, "GPU": 0.5, "accelerator_type:A100": 0.001}
    assert specs[0].threads == 2
    assert infeasible(specs, [LINUX_GPU]) is None
    assert "GPU: 2.5 needed, 2 in the cluster" in infeasible(
        worker_specs(ScalingConfig(num_workers=5, use_gpu=True, resources_per_worker={"GPU": 0.5}), [LINUX_GPU]),
        [LINUX_GPU],
    )  # type: ignore[operator]


def test_impossible_requests_say_what_is_missing():
    assert infeasible(
        worker_specs(ScalingConfig(groups=parse_workers("mps:1")), [LINUX_GPU, CPU_BOX]), [LINUX_GPU, CPU_BOX]
    ) == ("mps: 1 needed, 0 in the cluster")
    big = worker_specs(ScalingConfig(groups=[DeviceGroup(resources_per_worker={"CPU": 6})] * 2), [LINUX_GPU, CPU_BOX])
    assert infeasible(big, [LINUX_GPU, CPU_BOX]) is None  # 12 of 12 CPUs, but:
    too_big = worker_specs(ScalingConfig(groups=[DeviceGroup(resources_per_worker={"CPU": 9})]), [LINUX_GPU, CPU_BOX])
    assert infeasible(too_big, [LINUX_GPU, CPU_BOX]) == "worker 0 (cpu) needs CPU=9 and no node has that much"


def test_ambiguous_gpus_without_labels_or_types_are_refused_with_the_fix():
    untyped = NodeInfo("x", "10.0.0.9", {"CPU": 8, "GPU": 1})
    with pytest.raises(ValueError, match=r"both CUDA and Apple GPUs.*mixtrain cluster up"):
        worker_specs(ScalingConfig(groups=parse_workers("cuda:1")), [untyped, MAC])


@pytest.mark.parametrize(
    ("text", "want"),
    [("3", 3), ("auto", "auto"), ("cuda:1,mps,cpu:2", [("cuda", 1), ("mps", 1), ("cpu", 2)])],
)
def test_workers_flag(text, want):
    got = parse_workers(text)
    if isinstance(want, list):
        assert [(g.device, g.num_workers) for g in got] == want  # type: ignore[union-attr]
    else:
        assert got == want


@pytest.mark.parametrize("text", ["0", "tpu:1", "cuda:x", "cuda:0", ","])
def test_bad_workers_flag_names_the_item_and_the_form(text):
    with pytest.raises(ValueError, match=r"--workers .*(cuda:1,mps:1,cpu:2)"):
        parse_workers(text)


def test_group_config_errors_name_field_value_and_fix():
    with pytest.raises(ValueError, match=r"DeviceGroup.device='tpu': use one of cpu, gpu, cuda, mps"):
        DeviceGroup(device="tpu")
    with pytest.raises(ValueError, match=r"a CPU worker cannot hold a GPU; use device='gpu'"):
        DeviceGroup(device="cpu", resources_per_worker={"GPU": 1})
    with pytest.raises(ValueError, match=r"ScalingConfig.groups='some': use 'auto'"):
        ScalingConfig(groups="some")
    with pytest.raises(ValueError, match=r"ScalingConfig.backend='mpi': use one of auto, gloo, nccl"):
        ScalingConfig(backend="mpi")
    assert ScalingConfig(groups=parse_workers("cuda:1,cpu:2")).num_workers == 3  # type: ignore[arg-type]
