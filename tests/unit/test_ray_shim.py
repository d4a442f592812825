"""Ray's private interfaces live in cluster/ray_shim.py (issue 34). Each shim is tested on the Ray installed here
(2.60, in the range mixtrain supports: 2.52+) and with the internal it uses taken away, as a Ray release without it
would be: it falls back to what Ray does by itself, or refuses where nothing safe can be done. No Ray starts here
(tests/ray/test_embedded.py starts one through these shims)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import psutil
import pytest
import ray
import ray._raylet
from ray._private import node, parameter, ray_constants, services, utils

from mixtrain.cluster import ray_shim


def test_this_ray_is_in_the_supported_range_and_has_every_internal_the_shims_use():
    major, minor = (int(p) for p in ray.__version__.split(".")[:2])
    assert (major, minor) >= (2, 52)
    assert hasattr(parameter, "RayParams") and hasattr(node.Node, "start_api_server")
    assert hasattr(services, "get_node") and hasattr(services, "resolve_ip_for_localhost")
    assert hasattr(ray._raylet, "InnerGcsClient") and ray_shim.token_auth_available()


def test_node_params_give_the_node_address_and_the_extra_fields_this_ray_takes_and_put_ray_back():
    original = parameter.RayParams
    with ray_shim.node_params("127.0.0.1", {"no_monitor": True}):
        params = parameter.RayParams()
        assert params.node_ip_address == "127.0.0.1" and params.no_monitor is True
        assert parameter.RayParams(node_ip_address="10.0.0.5").node_ip_address == "10.0.0.5"  # given: kept
    assert parameter.RayParams is original
    with ray_shim.node_params("127.0.0.1", {"a_field_this_ray_lacks": 1}):  # an older RayParams: left out
        assert parameter.RayParams().node_ip_address == "127.0.0.1"


def test_lean_head_patches_only_while_ray_starts_and_falls_back_without_the_internals(monkeypatch):
    start, get_node = node.Node.start_api_server, services.get_node
    with ray_shim.lean_head(1.0):
        assert node.Node.start_api_server is not start and services.get_node is not get_node
    assert node.Node.start_api_server is start and services.get_node is get_node
    monkeypatch.delattr(services, "get_node")  # a Ray without it: nothing is patched
    with ray_shim.lean_head(1.0):
        assert node.Node.start_api_server is start


def test_loopback_is_kept_as_given_only_in_the_block_and_without_the_internal_nothing_changes(monkeypatch):
    resolve = services.resolve_ip_for_localhost
    with ray_shim.loopback_as_given():
        assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    assert services.resolve_ip_for_localhost is resolve
    monkeypatch.delattr(services, "resolve_ip_for_localhost")
    with ray_shim.loopback_as_given():
        assert not hasattr(services, "resolve_ip_for_localhost")


def test_dashboard_deps_are_found_not_imported_with_rays_answer_and_without_the_internals_rays_own(monkeypatch):
    check = utils.get_dashboard_dependency_error
    packages = ray_shim._dashboard_packages()
    assert {"aiohttp", "grpc", "prometheus_client"} <= set(packages)  # read from Ray's own list
    with ray_shim.dashboard_deps_found():
        assert utils.get_dashboard_dependency_error() is None  # installed here (ray[default]), as Ray's check says
    assert utils.get_dashboard_dependency_error is check
    monkeypatch.setattr(ray_shim, "_dashboard_packages", lambda: [*packages, "aiohttp.no_such_module"])
    with ray_shim.dashboard_deps_found():
        error = utils.get_dashboard_dependency_error()
        assert isinstance(error, ImportError) and "aiohttp.no_such_module" in str(error)  # the agent: --minimal
    monkeypatch.setattr(ray_shim, "_dashboard_packages", list)  # Ray's list unreadable: Ray's own check
    with ray_shim.dashboard_deps_found():
        assert utils.get_dashboard_dependency_error is check
    monkeypatch.delattr(utils, "get_dashboard_dependency_error")  # a Ray without it: nothing is patched
    with ray_shim.dashboard_deps_found():
        assert not hasattr(utils, "get_dashboard_dependency_error")


def test_the_agents_ports_are_not_served_before_the_raylet_starts_and_without_the_internals_ray_waits(
    monkeypatch, tmp_path
):
    started = []

    def start_raylet(redis_address, gcs_address, node_id, node_ip_address, session_dir, **rest):  # named as Ray's
        started.append((node_id, sorted(p.name for p in pathlib.Path(session_dir).iterdir()), rest))
        return "raylet"

    monkeypatch.setattr(services, "start_raylet", start_raylet)
    node_id = "ab" * 28
    with ray_shim.no_dashboard_agent():
        assert services.start_raylet(None, "gcs:1", node_id, "127.0.0.1", str(tmp_path), labels="{}") == "raylet"
    assert services.start_raylet is start_raylet  # Ray's own again after the block
    names = [getattr(ray._raylet, name) for name in ray_shim.AGENT_SERVICES]
    assert started == [(node_id, sorted(f"{name}_{node_id}" for name in names), {"labels": "{}"})]
    for name in names:  # Ray's own reader finds "not served", without waiting
        assert ray._raylet.wait_for_persisted_port(str(tmp_path), node_id, name, timeout_ms=0) == -1
    assert ray_shim.AGENT_SERVICES == (
        "METRICS_AGENT_PORT_NAME",
        "METRICS_EXPORT_PORT_NAME",
        "DASHBOARD_AGENT_LISTEN_PORT_NAME",
    )  # the runtime-env agent's is awaited
    monkeypatch.setattr(services, "start_raylet", lambda *args: "no names to bind")  # a signature without them
    with ray_shim.no_dashboard_agent():
        assert services.start_raylet() == "no names to bind"
    monkeypatch.setattr(services, "start_raylet", start_raylet)
    monkeypatch.delattr(ray._raylet, "persist_port")  # a Ray without it: nothing is patched
    with ray_shim.no_dashboard_agent():
        assert services.start_raylet is start_raylet


def test_the_raylet_is_given_the_stand_in_for_the_dashboard_agent_only_and_only_while_it_starts(monkeypatch, tmp_path):
    build = services._build_python_executable_command_memory_profileable
    commands = {}

    def start_raylet(redis_address, gcs_address, node_id, node_ip_address, session_dir, **rest):  # as Ray builds
        for agent in (ray_constants.PROCESS_TYPE_DASHBOARD_AGENT, ray_constants.PROCESS_TYPE_RUNTIME_ENV_AGENT):
            commands[agent] = services._build_python_executable_command_memory_profileable(agent, session_dir)
        return "raylet"

    monkeypatch.setattr(services, "start_raylet", start_raylet)
    with ray_shim.no_dashboard_agent():
        assert services._build_python_executable_command_memory_profileable is build  # not before the raylet
        services.start_raylet(None, "gcs:1", "cd" * 28, "127.0.0.1", str(tmp_path))
        assert services._build_python_executable_command_memory_profileable is build  # nor after it
    assert commands[ray_constants.PROCESS_TYPE_DASHBOARD_AGENT] == [sys.executable, "-S", "-c", ray_shim.AGENT_STANDIN]
    assert commands[ray_constants.PROCESS_TYPE_RUNTIME_ENV_AGENT] == build(  # Ray's own: it starts and is awaited
        ray_constants.PROCESS_TYPE_RUNTIME_ENV_AGENT, str(tmp_path)
    )
    monkeypatch.delattr(ray_constants, "PROCESS_TYPE_DASHBOARD_AGENT")  # a Ray that names it otherwise
    builders = []

    def start_raylet_recording(redis_address, gcs_address, node_id, node_ip_address, session_dir):
        builders.append(services._build_python_executable_command_memory_profileable)

    monkeypatch.setattr(services, "start_raylet", start_raylet_recording)
    with ray_shim.no_dashboard_agent():
        services.start_raylet(None, "gcs:1", "ef" * 28, "127.0.0.1", str(tmp_path))
    assert builders == [build]  # the agent starts (Ray's own command), unawaited: its port files are written
    assert {f"{getattr(ray._raylet, name)}_{'ef' * 28}" for name in ray_shim.AGENT_SERVICES} <= {
        p.name for p in tmp_path.iterdir()
    }


def test_the_stand_in_lives_as_long_as_its_parent_and_reads_no_arguments():
    # what the raylet does with it: start it with the agent's arguments after the command, and stop when it exits
    parent = subprocess.Popen(
        [sys.executable, "-c", _STANDIN_PARENT, ray_shim.AGENT_STANDIN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    standin = psutil.Process(int(parent.stdout.readline()))
    try:
        assert standin.cmdline()[1:4] == ["-S", "-c", ray_shim.AGENT_STANDIN]
        with pytest.raises(psutil.TimeoutExpired):  # it lives while its parent does
            standin.wait(timeout=1.0)
    finally:
        parent.communicate("", timeout=30)  # the parent exits (as a raylet that was killed)
    assert parent.returncode == 0
    standin.wait(timeout=10)  # and the stand-in goes by itself (it looks every 0.5 s)


_STANDIN_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-S", "-c", sys.argv[1], "agent.py", "--node-id=x", "--minimal"])
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_installed_finds_modules_without_importing_them():
    assert ray_shim._installed("json.decoder") and not ray_shim._installed("json.no_such_module")
    assert not ray_shim._installed("no_such_package_here.sub") and not ray_shim._installed("json.decoder.deeper")


def test_the_gcs_client_uses_the_connect_timeout_and_falls_back_to_rays_own(monkeypatch):
    calls = []

    class Inner:
        @staticmethod
        def standalone(address, cluster_id, timeout_ms):
            calls.append((address, timeout_ms))
            return "inner"

    monkeypatch.setattr(ray._raylet, "InnerGcsClient", Inner)
    assert ray_shim.gcs_client("10.0.0.1:6379", 2.5) == "inner" and calls == [("10.0.0.1:6379", 2500)]
    monkeypatch.delattr(ray._raylet, "InnerGcsClient")  # an older Ray: its GcsClient
    monkeypatch.setattr(ray._raylet, "GcsClient", lambda address: f"gcs {address}")
    assert ray_shim.gcs_client("10.0.0.1:6379", 2.5) == "gcs 10.0.0.1:6379"


def test_a_ray_without_token_auth_is_refused(monkeypatch):
    from mixtrain.cluster import auth
    from mixtrain.cluster.state import ClusterError

    monkeypatch.delattr(ray._raylet, "AuthenticationTokenLoader")
    assert not ray_shim.token_auth_available()
    with pytest.raises(ClusterError, match="cannot require a token"):
        auth.require_token_auth()


def test_streaming_asks_for_backpressure():
    class Method:
        def options(self, **kwargs):
            return kwargs

    assert ray_shim.streaming(Method(), 7) == {"num_returns": "streaming", "_generator_backpressure_num_objects": 7}
    assert ray_shim.init_kwargs({"x": 1}) == {"_system_config": {"x": 1}}


def test_ready_asks_rays_own_probe_and_without_it_the_actors_own_method():
    class Probe:
        @staticmethod
        def remote():
            return "ray's probe"

    class Actor:
        __ray_ready__ = Probe()

    assert ray_shim.ready(Actor(), lambda: "info") == "ray's probe"
    assert ray_shim.ready(object(), lambda: "info") == "info"  # a Ray whose actors lack it


def test_no_other_module_reaches_into_ray_internals():
    src = pathlib.Path(ray_shim.__file__).parent.parent
    for path in src.rglob("*.py"):
        if path.name == "ray_shim.py":
            continue
        text = path.read_text()
        for internal in ("ray._private", "ray._raylet", "_generator_backpressure", "_system_config", "__ray_"):
            assert internal not in text, (path, internal)
