"""From device groups and the cluster's nodes to one Ray bundle per worker. Pure functions.

How a kind of device becomes a Ray resource request:
- cpu: {"CPU": c}.
- gpu: {"CPU": c, "GPU": g}; the worker uses CUDA or MPS, whatever its node has.
- cuda / mps: the same, narrowed to the right machines. Nodes started with `mixtrain cluster
  up/join` (and the embedded local Ray) carry custom resources "cuda" and "mps", which say it
  exactly. On a plain Ray cluster an Apple GPU is a "GPU" with accelerator type "M1".."M4"
  (Ray 2.60), so CUDA and Apple GPUs are told apart by accelerator type.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from mixtrain.config import DeviceGroup, ScalingConfig
from mixtrain.errors import InputValueError

_APPLE = re.compile(r"^accelerator_type:M\d")
NODE_ID_LABEL = "ray.io/node-id"
_MARK = 0.001  # a sliver of a resource that only some nodes have: a node selector, as Ray Train does


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    resources: dict[str, float]

    @property
    def is_mac(self) -> bool:
        return self.resources.get("mps", 0) > 0 or any(_APPLE.match(k) for k in self.resources)

    @property
    def gpus(self) -> float:
        return self.resources.get("GPU", 0.0)

    @property
    def accelerator_types(self) -> list[str]:
        return [k.split(":", 1)[1] for k in self.resources if k.startswith("accelerator_type:")]


@dataclass(frozen=True)
class WorkerSpec:
    """What rank `rank` asks Ray for, and what it asks its node for."""

    rank: int
    device: str
    bundle: dict[str, float]
    label_selector: dict[str, str]
    threads: int
    precision: str


def nodes_from_ray(raw: Sequence[dict[str, Any]]) -> list[NodeInfo]:
    """The alive nodes of `ray.nodes()`, head first."""
    nodes = [
        NodeInfo(n["NodeID"], n.get("NodeManagerAddress", "?"), dict(n.get("Resources", {})))
        for n in raw
        if n.get("Alive")
    ]
    return sorted(nodes, key=lambda n: "node:__internal_head__" not in n.resources)


def auto_groups(nodes: Sequence[NodeInfo]) -> list[DeviceGroup]:
    """One worker per GPU (CUDA or Apple), then one CPU worker per node without a GPU, each
    pinned to its node. Ranks go fastest kind first, so rank 0 (the rendezvous and the source
    of broadcasts) is on a GPU when there is one."""
    by_kind: dict[str, list[DeviceGroup]] = {"cuda": [], "mps": [], "cpu": []}
    for node in nodes:
        cpus = node.resources.get("CPU", 0.0)
        if node.is_mac and (node.gpus > 0 or node.resources.get("mps", 0) > 0):
            # An older Ray counts no Apple "GPU", only the "mps" resource that `cluster join` registers.
            gpu = {} if node.gpus > 0 else {"GPU": 0.0, "mps": 1.0}
            by_kind["mps"].append(
                DeviceGroup(
                    device="mps",
                    num_workers=1,
                    resources_per_worker={"CPU": min(1.0, cpus), **gpu},
                    node=node.node_id,
                )
            )
        elif node.gpus >= 1:
            n = int(node.gpus)
            by_kind["cuda"].append(
                DeviceGroup(
                    device="cuda",
                    num_workers=n,
                    resources_per_worker={"CPU": min(1.0, cpus / n), "GPU": 1.0},
                    node=node.node_id,
                )
            )
        elif cpus >= 1:
            by_kind["cpu"].append(
                DeviceGroup(
                    device="cpu", num_workers=1, resources_per_worker={"CPU": float(int(cpus))}, node=node.node_id
                )
            )
    groups = by_kind["cuda"] + by_kind["mps"] + by_kind["cpu"]
    if not groups:
        raise RuntimeError(f"groups='auto' found no usable device in the cluster: {describe(nodes)}")
    return groups


def resolve_scaling(scaling: ScalingConfig, nodes: Sequence[NodeInfo]) -> ScalingConfig:
    """A config with concrete groups: "auto" becomes groups from the inventory."""
    if not scaling.is_auto:
        return scaling
    return replace(scaling, groups=auto_groups(nodes))


def _narrow(group: DeviceGroup, nodes: Sequence[NodeInfo], bundle: dict[str, float]) -> None:
    """Add the resources that keep a cuda/mps worker off the other kind of GPU node."""
    if group.device not in ("cuda", "mps") or group.node is not None or group.accelerator_type:
        return
    want_mac = group.device == "mps"
    amount = bundle.get("GPU", 1.0)
    if any(n.resources.get(group.device, 0) > 0 for n in nodes):  # registered by mixtrain: exact
        bundle[group.device] = amount
        if want_mac and not any(n.is_mac and n.gpus > 0 for n in nodes):
            bundle.pop("GPU", None)  # an older Ray that does not count Apple GPUs as "GPU"
        return
    mine_nodes = [n for n in nodes if n.gpus > 0 and n.is_mac == want_mac]
    if not mine_nodes:
        bundle[group.device] = amount  # none of this kind: the request fails at once, naming it
        return
    if not any(n.gpus > 0 and n.is_mac != want_mac for n in nodes):
        return  # only this kind of GPU in the cluster: "GPU" is exact
    mine = {t for n in mine_nodes for t in n.accelerator_types}
    if len(mine) != 1:
        raise InputValueError(
            f"DeviceGroup(device={group.device!r}): this cluster has both CUDA and Apple GPUs and nothing tells "
            f"them apart for this group (accelerator types {sorted(mine) or 'unknown'}). Start the nodes with "
            "`mixtrain cluster up` / `mixtrain cluster join` (they label cuda and mps), or set accelerator_type"
        )
    bundle[f"accelerator_type:{mine.pop()}"] = _MARK


def worker_specs(scaling: ScalingConfig, nodes: Sequence[NodeInfo]) -> list[WorkerSpec]:
    """One spec per rank, in group order."""
    specs: list[WorkerSpec] = []
    for group in scaling.device_groups():
        bundle = group.resources()
        if group.accelerator_type:
            bundle[f"accelerator_type:{group.accelerator_type}"] = _MARK
        _narrow(group, nodes, bundle)
        selector = {NODE_ID_LABEL: group.node} if group.node else {}
        for _ in range(group.num_workers):
            specs.append(
                WorkerSpec(
                    len(specs),
                    group.device,
                    dict(bundle),
                    selector,
                    scaling.threads_for(bundle["CPU"]),
                    group.precision or scaling.precision,
                )
            )
    return specs


def infeasible(specs: Sequence[WorkerSpec], nodes: Sequence[NodeInfo]) -> str | None:
    """Why the cluster can never hold these bundles (totals, not free resources), or None."""
    totals: dict[str, float] = {}
    for node in nodes:
        for k, v in node.resources.items():
            totals[k] = totals.get(k, 0.0) + v
    need: dict[str, float] = {}
    for s in specs:
        for k, v in s.bundle.items():
            need[k] = need.get(k, 0.0) + v
    short = [
        f"{k}: {v:g} needed, {totals.get(k, 0):g} in the cluster"
        for k, v in need.items()
        if v > totals.get(k, 0) + 1e-9
    ]
    if short:
        return "; ".join(short)
    for s in specs:
        fits = [
            n
            for n in nodes
            if all(n.resources.get(k, 0) + 1e-9 >= v for k, v in s.bundle.items())
            and all(n.node_id == v for v in s.label_selector.values())
        ]
        if not fits:
            want = ", ".join(f"{k}={v:g}" for k, v in s.bundle.items())
            where = f" on node {s.label_selector[NODE_ID_LABEL][:12]}" if s.label_selector else ""
            return f"worker {s.rank} ({s.device}) needs {want}{where} and no node has that much"
    return None


def format_resources(res: dict[str, float]) -> str:
    """Resources as a person reads them: Ray's bookkeeping keys (node:, memory, bundles) left out."""
    keys = [k for k in sorted(res) if not k.startswith(("node:", "memory", "object_store_memory", "bundle_group"))]
    return ", ".join(f"{k}={res[k]:g}" for k in keys) or "nothing"


def describe(nodes: Sequence[NodeInfo]) -> str:
    return (
        "; ".join(f"node {n.ip} ({n.node_id[:8]}): {format_resources(n.resources)}" for n in nodes) or "no alive nodes"
    )
