"""Run by tests/ray/test_embedded.py as its own process: start mixtrain's embedded Ray, list the processes its
node started, run one task, and print them as JSON."""

import json
import sys

import psutil
import ray

from mixtrain.cluster import connect


@ray.remote
def _square(x: int) -> int:
    return x * x


def main() -> None:
    connect.start_embedded(num_cpus=1, log_to_driver=False, logging_level="ERROR")
    node = ray._private.worker._global_node
    started = sorted(node.all_processes)
    answer = ray.get(_square.remote(7), timeout=60)
    ports = {k: v for k, v in ray.nodes()[0].items() if k.endswith("Port")}  # as the raylet registered them
    agents = [p.cmdline() for p in psutil.Process().children(recursive=True) if "agent.py" in " ".join(p.cmdline())]
    agent_minimal = any("--minimal" in cmd for cmd in agents)
    deps_imported = "aiohttp" in sys.modules  # Ray's own check imports its dashboard packages in the driver
    connect.stop_ray_uninterrupted()
    # A Ray started afterwards in this process, not through mixtrain, is Ray's own again
    from ray._private import node as ray_node
    from ray._private import parameter, services, utils

    restored = ray_node.Node.start_api_server.__name__ == "start_api_server"
    restored = restored and parameter.RayParams.__name__ == "RayParams" and services.get_node.__name__ == "get_node"
    restored = restored and utils.get_dashboard_dependency_error.__name__ == "get_dashboard_dependency_error"
    restored = restored and services.start_raylet.__name__ == "start_raylet"
    out = {"processes": started, "answer": answer, "restored": restored, "agents": agents, "ports": ports}
    print(json.dumps({**out, "agent_minimal": agent_minimal, "deps_imported": deps_imported}))


if __name__ == "__main__":
    main()
