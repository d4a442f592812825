"""`mixtrain env`: everything a bug report needs, from this machine."""

from __future__ import annotations

import platform
from typing import Any

import torch

from mixtrain.compat import platform_info, versions

SETTINGS = (
    "RAY_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "PYTORCH_ENABLE_MPS_FALLBACK",
    "CUDA_VISIBLE_DEVICES",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)
"""Environment variables that change what mixtrain, torch or Ray do (plus every MIXTRAIN_* one)."""
OPTIONAL = ("matplotlib", "tensorboardX", "tensorboard", "mlflow-skinny", "mlflow", "wandb", "scikit-learn", "rich")
"""Distributions some features use: report plots, TensorBoard files, the loggers, the digits data, live progress."""


def bug_report() -> dict[str, Any]:
    """Everything a bug report needs, from this machine: `mixtrain env`."""
    import os
    import socket
    from importlib import metadata

    from mixtrain import devices
    from mixtrain.cluster.state import load_state
    from mixtrain.comm.netif import hostname_trap, ipv4_addresses

    optional: dict[str, str | None] = {}
    for name in OPTIONAL:
        try:
            optional[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            optional[name] = None
    state = load_state()
    return {
        "versions": versions(),
        "python_implementation": platform.python_implementation(),
        "platform": platform_info(),
        "torch_build": {
            "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "mps_built": torch.backends.mps.is_built(),
            "mps_available": torch.backends.mps.is_available(),
            "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
            "threads": torch.get_num_threads(),
        },
        "devices": [d.as_dict() for d in devices.local_devices()],
        "network": {
            "hostname": socket.gethostname(),
            "hostname_warning": hostname_trap(),
            "interfaces": {k: v for k, v in ipv4_addresses().items() if v},
        },
        "cluster": None if state is None else cluster_report(state),
        "settings": {k: v for k, v in sorted(os.environ.items()) if k in SETTINGS or k.startswith("MIXTRAIN_")},
        "optional_packages": optional,
    }


def cluster_report(state: Any) -> dict[str, Any]:
    """This machine's node of a mixtrain cluster: is it running, does its head require the token (asked over
    the network), and which TCP addresses its processes listen on."""
    import stat

    from mixtrain.cluster import exposure
    from mixtrain.cluster.auth import token_check, token_path
    from mixtrain.cluster.state import not_ours

    gone = not_ours(state)
    path = token_path()
    auth: dict[str, Any] = {"token_file": str(path), "token_file_mode": None, "check": "not checked: not running"}
    if path.exists():
        auth["token_file_mode"] = f"{stat.S_IMODE(path.stat().st_mode):04o}"
    if gone is None and path.exists():
        required, how = token_check(state.address, path.read_text().strip(), timeout_s=3.0)
        auth["mode"] = {True: "token required", False: "NOT ENFORCED", None: "unknown"}[required]
        auth["check"] = how
    return {
        "role": state.role,
        "address": state.address,
        "node_ip": state.node_ip,
        "running": gone is None,
        "not_running_because": gone,
        "auth": auth,
        "listening": exposure.listening(state.pgid) if gone is None else [],
    }


def _format_cluster(c: dict[str, Any] | None) -> list[str]:
    if c is None:
        return ["cluster: none started here"]
    if not c["running"]:
        return [f"cluster: {c['role']} of {c['address']} recorded, not running ({c['not_running_because']})"]
    a = c["auth"]
    lines = [
        f"cluster: {c['role']} of {c['address']} as {c['node_ip']}",
        f"  ray auth: {a.get('mode', 'unknown')}: {a['check']}; token file {a['token_file']} ({a['token_file_mode']})",
        "  listening (this node's Ray processes; * = every interface):",
    ]
    for sock in c["listening"]:
        where = "*" if sock["all"] else sock["ip"]
        lines.append(f"    {where}:{sock['port']}  {sock['process']}")
    return lines


def format_bug_report(r: dict[str, Any]) -> str:
    from mixtrain.cluster.headnode import format_devices

    v, t, net = r["versions"], r["torch_build"], r["network"]
    lines = [
        f"mixtrain {v['mixtrain']}",
        f"python   {v['python']} ({r['python_implementation']}) at {r['platform']['executable']}",
        f"torch    {v['torch']} (cuda {t['cuda'] or 'none'}, cuda available {t['cuda_available']}, "
        f"mps built {t['mps_built']}, mps available {t['mps_available']}, gloo {t['gloo']}, {t['threads']} threads)",
        f"ray      {v['ray']}",
        f"numpy    {v['numpy']}",
        f"os       {r['platform']['os']} ({r['platform']['machine']})",
        "devices:",
        *format_devices(r["devices"]),
        f"network: hostname {net['hostname']}; "
        + ", ".join(f"{k} {' '.join(ips)}" for k, ips in sorted(net["interfaces"].items())),
    ]
    if net["hostname_warning"]:
        lines.append(f"  warning: {net['hostname_warning']}; give `cluster up/join` --interface or --node-ip")
    lines += _format_cluster(r["cluster"])
    settings = r["settings"]
    lines.append("settings: " + (", ".join(f"{k}={val}" for k, val in settings.items()) or "none set"))
    opt = r["optional_packages"]
    lines.append("optional: " + ", ".join(f"{k} {val or 'missing'}" for k, val in opt.items()))
    return "\n".join(lines)
