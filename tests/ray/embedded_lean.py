"""Run by tests/ray/test_embedded.py as its own process: start mixtrain's embedded Ray, list the processes its
node started, run one task, and print them as JSON."""

import json
import sys
import time

import psutil
import ray

from mixtrain.cluster import connect, ray_shim


@ray.remote
def _square(x: int) -> int:
    return x * x


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> None:
    connect.start_embedded(num_cpus=1, log_to_driver=False, logging_level="ERROR")
    node = ray._private.worker._global_node
    started = sorted(node.all_processes)
    answer = ray.get(_square.remote(7), timeout=60)
    ports = {k: v for k, v in ray.nodes()[0].items() if k.endswith("Port")}  # as the raylet registered them
    children = {p.pid: p.cmdline() for p in psutil.Process().children(recursive=True)}
    standins = [pid for pid, cmd in children.items() if cmd[1:4] == ["-S", "-c", ray_shim.AGENT_STANDIN]]
    agents = [" ".join(cmd).strip() for cmd in children.values() if "Agent" in " ".join(cmd[:1])]  # Ray names them
    agent_minimal = any("--minimal" in children[pid] for pid in standins)  # the arguments Ray gave the agent
    deps_imported = "aiohttp" in sys.modules  # Ray's own check imports its dashboard packages in the driver
    connect.stop_ray_uninterrupted()
    deadline = time.monotonic() + 10  # the raylet stops its agents; a stand-in left alone goes within 0.5 s
    while any(map(_alive, standins)) and time.monotonic() < deadline:
        time.sleep(0.1)
    standins_left = [pid for pid in standins if _alive(pid)]
    # A Ray started afterwards in this process, not through mixtrain, is Ray's own again
    from ray._private import node as ray_node
    from ray._private import parameter, services, utils

    restored = ray_node.Node.start_api_server.__name__ == "start_api_server"
    restored = restored and parameter.RayParams.__name__ == "RayParams" and services.get_node.__name__ == "get_node"
    restored = restored and utils.get_dashboard_dependency_error.__name__ == "get_dashboard_dependency_error"
    restored = restored and services.start_raylet.__name__ == "start_raylet"
    builder = services._build_python_executable_command_memory_profileable
    restored = restored and builder.__name__ == "_build_python_executable_command_memory_profileable"
    out = {"processes": started, "answer": answer, "restored": restored, "agents": agents, "ports": ports}
    out |= {"standins": len(standins), "standins_left": standins_left}
    print(json.dumps({**out, "agent_minimal": agent_minimal, "deps_imported": deps_imported}))


if __name__ == "__main__":
    main()
