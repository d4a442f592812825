"""Every use of Ray's private interfaces, in one place, each with what it needs from Ray and what happens without.

mixtrain needs Ray 2.52+ (the first that can require a token). Ray's internals move between releases, so each
function here checks for what it uses and, where that is missing, does what Ray does by itself (or raises, where
nothing safe can be done without it). tests/unit/test_ray_shim.py tests each on this Ray and with the internal
taken away (the behaviour of a Ray without it).

| function | Ray internal | without it |
|---|---|---|
| node_params | ray._private.parameter.RayParams (2.x) | required: an embedded Ray could not be kept on loopback |
| lean_head | node.Node.start_api_server, services.get_node, state.GlobalState (2.4x-2.6x) | Ray's own start |
| loopback_as_given | services.resolve_ip_for_localhost (2.x) | Ray's own resolution |
| dashboard_deps_found | utils.get_dashboard_dependency_error, dashboard/optional_deps.py (2.x) | Ray's own check |
| no_dashboard_agent | services.start_raylet, ray._raylet.persist_port and port names (2.5x-2.6x) | Ray's own start |
| (its stand-in) | services._build_python_executable_command_memory_profileable (2.60) | agent unawaited |
| gcs_client | ray._raylet.InnerGcsClient (2.5x-2.6x), else ray._raylet.GcsClient | Ray's client (30 s connect) |
| token_auth_available, reload_auth_config | ray._raylet AuthenticationTokenLoader, Config (2.52+) | refused |
| streaming | the actor option _generator_backpressure_num_objects (2.10+) | unbounded streaming |
| init_kwargs | ray.init(_system_config=...) (2.x) | required |
| ready | every actor's __ray_ready__ method (2.x) | a call of one of the actor's own cheap methods |
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def node_params(node_ip: str, extra: dict[str, Any]) -> Iterator[None]:
    """The node parameters `ray.init` builds in this block get `node_ip` as the node's address (unless given) and
    `extra` where this Ray's RayParams takes all of them. (`ray.init(_node_ip_address="127.0.0.1")` is not the
    same: Ray replaces a loopback address given there with the LAN address.)"""
    from ray._private import parameter

    base = parameter.RayParams
    lean = extra if set(extra) <= set(inspect.signature(base.__init__).parameters) else {}

    class NodeParams(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs = {**lean, **kwargs}
            if kwargs.get("node_ip_address") is None:
                kwargs["node_ip_address"] = node_ip
            super().__init__(*args, **kwargs)

    setattr(parameter, "RayParams", NodeParams)  # noqa: B010  (mypy: a class is not assignable)
    try:
        yield
    finally:
        setattr(parameter, "RayParams", base)  # noqa: B010


@contextmanager
def lean_head(poll_s: float) -> Iterator[None]:
    """No API server (the dashboard's head process, which `ray.init` starts even without a dashboard), and the wait
    for the new raylet to register asked every 20 ms for up to `poll_s` instead of every second. Where this Ray
    lacks either internal, it starts as it would by itself."""
    from ray._private import node, services, state

    start_api_server = getattr(node.Node, "start_api_server", None)
    get_node = getattr(services, "get_node", None)
    if start_api_server is None or get_node is None:
        yield
        return

    def no_api_server(self: Any, *, include_dashboard: bool | None, **kwargs: Any) -> None:
        if include_dashboard:
            start_api_server(self, include_dashboard=include_dashboard, **kwargs)

    def get_node_once_registered(gcs_address: str, node_id: str) -> Any:
        # Ray's get_node blocks, asking the GCS once a second, until the new raylet has registered (0.5-0.6 s
        # after it starts, on an idle 2-core machine): nearly a second lost at every start. Asked every 20 ms
        # first, its one question finds the node. Any trouble here leaves the wait to Ray's own.
        table = state.GlobalState()
        try:
            table._initialize_global_state(services._get_gcs_client_options(gcs_address))
            deadline = time.monotonic() + poll_s
            while time.monotonic() < deadline and all(n.get("NodeID") != node_id for n in table.node_table()):
                time.sleep(0.02)
        except Exception:  # an optimisation only: Ray's own wait below decides
            pass
        finally:
            table.disconnect()
        return get_node(gcs_address, node_id)

    with _patched([(node.Node, "start_api_server", no_api_server), (services, "get_node", get_node_once_registered)]):
        yield


@contextmanager
def loopback_as_given() -> Iterator[None]:
    """A loopback address given to `ray.init` in this block (another process's embedded Ray, which listens on
    loopback only) is connected to as given: Ray replaces it with the machine's LAN address, where nothing
    answers, and waits for minutes."""
    from ray._private import services

    if getattr(services, "resolve_ip_for_localhost", None) is None:
        yield
        return
    with _patched([(services, "resolve_ip_for_localhost", lambda host: host)]):
        yield


@contextmanager
def dashboard_deps_found() -> Iterator[None]:
    """Whether Ray's dashboard packages are installed (which decides whether the node's agent starts `--minimal`)
    answered in this block by finding each package that ray/dashboard/optional_deps.py imports, not by importing
    them all as Ray does: aiohttp, grpc, opentelemetry, prometheus_client, pydantic and more, 0.3-0.4 s of the
    driver's CPU before the raylet even starts, and none of them used by the driver afterwards. The same answer
    for a package installed or missing; one installed but broken (its import fails) counts as found here, where
    Ray's check would start the agent --minimal. Without either internal (or a list it can read), Ray's own
    check."""
    from ray._private import utils

    original = getattr(utils, "get_dashboard_dependency_error", None)
    packages = _dashboard_packages()
    if original is None or not packages:
        yield
        return

    def found() -> ImportError | None:
        missing = [name for name in packages if not _installed(name)]
        return ImportError(f"No module named {missing[0]!r}") if missing else None

    with _patched([(utils, "get_dashboard_dependency_error", found)]):
        yield


AGENT_SERVICES = ("METRICS_AGENT_PORT_NAME", "METRICS_EXPORT_PORT_NAME", "DASHBOARD_AGENT_LISTEN_PORT_NAME")
"""The names (in ray._raylet) of the port files through which the node's dashboard agent tells the raylet where it
serves metrics and HTTP; -1 in one means "not served" (what a Ray installed without its dashboard packages
reports)."""

AGENT_STANDIN = (
    "import os, time; p = os.getppid(); any(time.sleep(0.5) for _ in iter(lambda: os.getppid() == p, False))"
)
"""What the raylet runs in place of its dashboard agent (`python -S -c`, the agent's arguments after it unread): a
process that lives until its raylet goes. The raylet stops when one of its agents exits, so the stand-in waits: the
raylet stops it when it stops itself, and it leaves by itself within 0.5 s of a raylet that was killed (its
parent is then another process)."""


@contextmanager
def no_dashboard_agent() -> Iterator[None]:
    """A raylet started in this block runs without Ray's dashboard agent and registers its node at once.

    The agent's three ports (metrics, metrics export, HTTP) are written as -1, "not served", into the session folder
    before the raylet starts: Ray's raylet reads each from a file the agent writes once it is up (0.7 s after its
    start on an idle 2-core machine, 4-5 s where another Ray holds the agent's HTTP port 52365 and it retries) and
    registers only then, and `ray.init` waits for that registration. And the raylet runs a stand-in
    (AGENT_STANDIN) where it would start the agent: the agent's start is 0.8-0.9 s of CPU (Ray, grpc, aiohttp,
    opentelemetry and its seven modules) and 100 MB or more of memory, on the cores the workers need then, to
    serve what a local run does not use: Ray's metrics export, the state API's logs and node stats, job
    submission (the API server these answer to is not started either: lean_head). The raylet and the workers
    log "Metrics agent not available" once, as on a Ray installed without its dashboard packages. The runtime-env
    agent starts and is awaited as before (workers' environments need it). Where this Ray lacks the internal
    that builds the agent's command, the agent starts and runs, unawaited; without any internal used for the
    port files, Ray's own start."""
    from ray import _raylet
    from ray._private import services

    start_raylet: Callable[..., Any] | None = getattr(services, "start_raylet", None)
    persist_port: Callable[..., Any] | None = getattr(_raylet, "persist_port", None)
    names = [getattr(_raylet, name, None) for name in AGENT_SERVICES]
    try:
        signature = inspect.signature(start_raylet) if start_raylet is not None else inspect.Signature()
    except (TypeError, ValueError):  # no signature to read: Ray's own start
        signature = inspect.Signature()
    needed = {"node_id", "session_dir"}
    if start_raylet is None or persist_port is None or None in names or not needed <= set(signature.parameters):
        yield
        return
    original, write = start_raylet, persist_port
    standin = _agent_standin()

    def start_raylet_without_agent(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind_partial(*args, **kwargs).arguments
        for name in names:
            write(given["session_dir"], given["node_id"], name, -1)
        with _patched(standin):
            return original(*args, **kwargs)

    with _patched([(services, "start_raylet", start_raylet_without_agent)]):
        yield


def _agent_standin() -> list[tuple[Any, str, Callable[..., Any]]]:
    """The patch that has Ray's start_raylet give its raylet the stand-in's command for the dashboard agent's
    (Ray builds each agent's command from `_build_python_executable_command_memory_profileable(component, ...)`,
    the Python to run, followed by the agent's script and arguments); [] where this Ray builds it otherwise."""
    import sys

    from ray._private import ray_constants, services

    build = getattr(services, "_build_python_executable_command_memory_profileable", None)
    agent = getattr(ray_constants, "PROCESS_TYPE_DASHBOARD_AGENT", None)
    if build is None or agent is None:
        return []

    def python_command(component: str, *args: Any, **kwargs: Any) -> Any:
        if component == agent:
            return [sys.executable, "-S", "-c", AGENT_STANDIN]
        return build(component, *args, **kwargs)

    return [(services, "_build_python_executable_command_memory_profileable", python_command)]


def _dashboard_packages() -> list[str]:
    """The modules ray/dashboard/optional_deps.py imports (read, not run); [] where it cannot be read."""
    try:
        spec = importlib.util.find_spec("ray.dashboard.optional_deps")
        if spec is None or spec.origin is None:
            return []
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (ImportError, OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            names += [alias.name for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
            names.append(stmt.module)
    return sorted(set(names))


def _installed(dotted: str) -> bool:
    """Module `dotted` can be found, without importing it or its packages (the top level by every finder, the
    rest on the package's own path)."""
    first, *rest = dotted.split(".")
    spec = importlib.util.find_spec(first)
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


@contextmanager
def _patched(patches: list[tuple[Any, str, Callable[..., Any]]]) -> Iterator[None]:
    """Ray's functions replaced for the block, and put back afterwards whatever happens."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def gcs_client(address: str, timeout_s: float) -> Any:
    """Ray's GCS client (what Ray's own CLI uses): key-value access without starting a driver, connecting within
    `timeout_s`. Without InnerGcsClient, Ray's GcsClient, which connects within 30 s."""
    import ray._raylet

    inner = getattr(ray._raylet, "InnerGcsClient", None)
    if inner is None:
        return ray._raylet.GcsClient(address=address)  # type: ignore[attr-defined]
    return inner.standalone(address, None, int(timeout_s * 1000))


def token_auth_available() -> bool:
    """This Ray can require a token (AuthenticationTokenLoader: Ray 2.52+)."""
    try:
        from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # noqa: F401
    except ImportError:
        return False
    return True


def reload_auth_config() -> None:
    """Ray reads its token settings once, when it is imported: read them again from the environment (as Ray's own
    test utilities do), after the token variables changed."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def streaming(method: Any, ahead: int) -> Any:
    """An actor method as Ray's streaming generator, at most `ahead` pieces ahead of the reader (a private actor
    option; a Ray without it streams unbounded)."""
    return method.options(num_returns="streaming", _generator_backpressure_num_objects=ahead)


def init_kwargs(system_config: dict[str, Any]) -> dict[str, Any]:
    """ray.init's keywords for Ray's internal settings of the Ray mixtrain starts."""
    return {"_system_config": system_config}


def ready(actor: Any, fallback: Callable[[], Any]) -> Any:
    """An object ref that resolves once `actor` has started (its constructor ran, or failed): Ray's own
    `__ray_ready__`, else `fallback()`, a call of one of the actor's own cheap methods (queued behind the
    constructor, so it answers at the same moment)."""
    if hasattr(actor, "__ray_ready__"):
        return actor.__ray_ready__.remote()
    return fallback()
