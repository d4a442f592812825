"""Pure parts of `mixtrain cluster`: version parity, node address choice, state and token files, the token
check against real gRPC servers, what `up` prints and the settings each node's Ray starts with."""

from __future__ import annotations

import io
import os
import stat
from concurrent import futures

import grpc
import pytest

from mixtrain.cli.main import _up_message, main
from mixtrain.cluster import auth, exposure, headnode
from mixtrain.cluster.state import NodeState
from tests.conftest import REPO

TOKEN = "a" * 48

HEAD = {"python": "3.11.9", "torch": "2.13.0+cu128", "ray": "2.60.0", "mixtrain": "0.1.0"}


def test_python_version_parity_names_both_versions():
    assert headnode.parity_problems(HEAD, {**HEAD, "python": "3.11.2", "torch": "2.13.0"}) == []
    problems = headnode.parity_problems(HEAD, {**HEAD, "python": "3.12.1"})
    assert problems == ["python: the head has 3.11.9, this machine has 3.12.1"]
    assert headnode.parity_problems(HEAD, {**HEAD, "ray": "2.59.0"}) == [
        "ray: the head has 2.60.0, this machine has 2.59.0"
    ]


def test_a_loopback_node_address_is_refused_with_the_fix():
    with pytest.raises(headnode.ClusterError, match=r"127.0.1.1 .*other machines cannot reach it.*--interface"):
        headnode.pick_node_ip(None, "127.0.1.1", None)
    assert headnode.pick_node_ip(None, "10.1.2.3", None) == "10.1.2.3"
    with pytest.raises(headnode.ClusterError, match=r"127\.0\.0\.1"):
        headnode.pick_node_ip("lo", None, None)
    with pytest.raises(headnode.ClusterError, match=r"--interface 'nope0': no such interface; this machine has .*lo"):
        headnode.pick_node_ip("nope0", None, None)


def test_token_file_is_private_and_auth_env_points_at_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path))
    with pytest.raises(headnode.ClusterError, match="no cluster token"):
        headnode.auth_env()
    env = headnode.auth_env(TOKEN)
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "auth_token")}
    assert stat.S_IMODE(os.stat(tmp_path / "auth_token").st_mode) == 0o600
    assert headnode.load_state() is None and headnode.down() is None


def test_the_token_file_is_0600_after_every_write_and_a_planted_symlink_is_not_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path / "home"))
    path = auth.token_path()
    path.write_text("old-token-" * 3)
    os.chmod(path, 0o644)  # an older mixtrain (or a user) left it readable by everyone
    auth.write_token(TOKEN)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and path.read_text() == TOKEN
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    path.unlink()
    path.symlink_to(victim)
    auth.write_token("b" * 48)
    assert victim.read_text() == "keep me" and not path.is_symlink() and path.read_text() == "b" * 48
    assert stat.S_IMODE(os.stat(tmp_path / "home").st_mode) == 0o700  # MIXTRAIN_HOME is made private
    os.chmod(path, 0o640)  # loosened later: tightened again before Ray is pointed at it
    auth.auth_env()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(headnode.ClusterError, match="not a cluster token"):
        auth.write_token("short")


def test_join_takes_the_token_from_a_file_or_stdin_and_warns_about_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "tok").write_text(TOKEN + "\n")
    assert auth.read_token_arg(None, str(tmp_path / "tok"), io.StringIO()) == TOKEN
    assert auth.read_token_arg(None, "-", io.StringIO(TOKEN + "\n")) == TOKEN
    assert auth.read_token_arg(None, None, io.StringIO("ignored")) is None  # not a terminal: the kept token
    assert capsys.readouterr().err == ""
    assert auth.read_token_arg(TOKEN, None, io.StringIO()) == TOKEN
    assert "--token puts the cluster token on the command line" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not both"):
        auth.read_token_arg(TOKEN, "-", io.StringIO())
    with pytest.raises(ValueError, match=r"--token-file .*nope"):
        auth.read_token_arg(None, str(tmp_path / "nope"), io.StringIO())
    # through the CLI: the warning comes before anything is tried (here: a head that is not there)
    monkeypatch.setenv("MIXTRAIN_CONNECT_TIMEOUT_S", "0.3")
    assert main(["cluster", "join", "127.0.0.1:9", "--token", TOKEN]) == 1
    err = capsys.readouterr().err
    assert err.index("warning: --token puts") < err.index("no Ray head answers at 127.0.0.1:9")


def test_up_prints_where_the_token_is_and_joins_that_keep_it_off_the_command_line(tmp_path):
    state = NodeState(role="head", address="10.0.0.1:6379", node_ip="10.0.0.1", pgid=1, log="head.log")
    text = _up_message(state, tmp_path / "auth_token")
    assert f"the token is in {tmp_path / 'auth_token'}" in text and "unencrypted" in text
    assert "join 10.0.0.1:6379 --token-file auth_token" in text
    assert f"cat {tmp_path / 'auth_token'} | mixtrain cluster join 10.0.0.1:6379 --token-file -" in text
    assert "--token " not in text
    assert "travels encrypted" in _up_message(state, tmp_path / "auth_token", tls=True)


def test_a_ray_without_token_authentication_is_refused(monkeypatch):
    import ray

    assert auth.require_token_auth() == ray.__version__
    monkeypatch.setattr(ray, "__version__", "2.51.0")
    with pytest.raises(headnode.ClusterError, match=r"Ray 2\.51\.0 cannot require a token.*ray\[default\]>=2\.52"):
        auth.require_token_auth()


def test_pyproject_requires_ray_with_tokens_torch_without_the_weights_only_holes_and_safetensors():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "ray[default]>=2.52" in deps and "torch>=2.10" in deps
    assert any(d.startswith("safetensors") for d in deps)


def _kv_server(require: str | None) -> tuple[grpc.Server, str]:
    """A real gRPC server answering the GCS's InternalKVGet: with `require`, only calls carrying that token
    (as Ray's enforcing GCS does), else every call (a Ray that ignored RAY_AUTH_MODE)."""

    def kv_get(request: bytes, context: grpc.ServicerContext) -> bytes:
        given = dict(context.invocation_metadata()).get("authorization")
        if require is not None and given != f"Bearer {require}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken")
        return b""

    handler = grpc.method_handlers_generic_handler(
        "ray.rpc.InternalKVGcsService", {"InternalKVGet": grpc.unary_unary_rpc_method_handler(kv_get)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_the_token_check_passes_only_a_head_that_refuses_calls_without_the_token():
    enforcing, address = _kv_server(require=TOKEN)
    try:
        assert auth.token_check(address, TOKEN, timeout_s=5)[0] is True
        auth.prove_token_required(address, TOKEN)
        required, how = auth.token_check(address, "b" * 48, timeout_s=5)  # the refusal must be about the token
        assert required is None and "refused this cluster's own token" in how
    finally:
        enforcing.stop(None)
    open_server, address = _kv_server(require=None)
    try:
        with pytest.raises(headnode.ClusterError, match=r"token authentication is NOT enforced.*served a call"):
            auth.prove_token_required(address, TOKEN)
    finally:
        open_server.stop(None)


def test_every_node_starts_without_the_parts_mixtrain_does_not_use(monkeypatch):
    env = headnode.node_env("eth7", head=True)
    assert env["RAY_START_HOOK"] == "mixtrain.cluster.ray_hook.harden"
    assert "RAY_START_HOOK" not in headnode.node_env(None, head=False)  # a worker node starts no client server
    assert env["RAY_enable_metrics_collection"] == "false" and env["GLOO_SOCKET_IFNAME"] == "eth7"
    # objects nobody holds are freed within 10 ms, as in the embedded Ray (the parameter servers' traffic)
    assert env["RAY_free_objects_period_milliseconds"] == "10"
    assert headnode.node_env(None, head=False)["RAY_free_objects_period_milliseconds"] == "10"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env
    # `cluster down` stops the node at once: no drain on SIGTERM (a value the user set is kept)
    assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"
    monkeypatch.setenv("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "5")
    assert headnode.node_env(None, head=False)["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "5"
    assert exposure.ray_start_args(head=True) == [
        "--include-dashboard=false",
        "--dashboard-host=127.0.0.1",
        "--no-monitor",
        "--include-log-monitor=false",
    ]
    assert exposure.ray_start_args(head=False) == ["--include-log-monitor=false"]
    assert "--include-dashboard=true" in exposure.ray_start_args(head=True, dashboard=True)

    class Params:
        ray_client_server_port = 10001

    from mixtrain.cluster.ray_hook import harden

    params = Params()
    harden(params, True)
    assert params.ray_client_server_port is None


def test_a_mac_node_is_told_to_be_one_of_several_and_to_advertise_its_lan_address(monkeypatch):
    # macOS-only behaviour, so the platform call is patched: Ray on a Mac refuses to join a multi-node
    # cluster and reports 127.0.0.1 as the node's address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
    import platform

    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    for head in (True, False):
        assert headnode.node_env(None, head=head)["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert "--node-ip-address=192.168.1.20" in headnode._common_args("192.168.1.20", None, None)
    assert "desktop the head" in headnode.MAC_HEAD_ADVICE and "sleeps" in headnode.MAC_HEAD_ADVICE


def _tls_files(tmp_path) -> dict[str, str]:
    """A CA and one node certificate for 127.0.0.1, as Ray's TLS guide makes them (every node signed by one CA)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("ca"))
        .issuer_name(name("ca"))
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    node = (
        x509.CertificateBuilder()
        .subject_name(name("node"))
        .issuer_name(name("ca"))
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = {
        "RAY_TLS_CA_CERT": ca.public_bytes(pem),
        "RAY_TLS_SERVER_CERT": node.public_bytes(pem),
        "RAY_TLS_SERVER_KEY": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    }
    for var, data in files.items():
        (tmp_path / var).write_bytes(data)
    return {var: str(tmp_path / var) for var in files}


def test_the_token_check_speaks_rays_tls_when_the_cluster_uses_it(tmp_path, monkeypatch):
    # RAY_USE_TLS=1: Ray's gRPC servers demand a certificate signed by the cluster's CA (mutual TLS); the
    # check must present this node's, as Ray's own clients do, or `cluster up` could never prove the token
    files = _tls_files(tmp_path)
    for var, path in files.items():
        monkeypatch.setenv(var, path)
    monkeypatch.setenv("RAY_USE_TLS", "1")

    def kv_get(request: bytes, context: grpc.ServicerContext) -> bytes:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken")
        return b""

    handler = grpc.method_handlers_generic_handler(
        "ray.rpc.InternalKVGcsService", {"InternalKVGet": grpc.unary_unary_rpc_method_handler(kv_get)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    read = {var: open(path, "rb").read() for var, path in files.items()}
    credentials = grpc.ssl_server_credentials(
        [(read["RAY_TLS_SERVER_KEY"], read["RAY_TLS_SERVER_CERT"])],
        root_certificates=read["RAY_TLS_CA_CERT"],
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        assert auth.token_check(f"127.0.0.1:{port}", TOKEN, timeout_s=5)[0] is True
        monkeypatch.delenv("RAY_TLS_CA_CERT")
        with pytest.raises(headnode.ClusterError, match="RAY_USE_TLS is set but RAY_TLS_CA_CERT is not"):
            auth.token_check(f"127.0.0.1:{port}", TOKEN, timeout_s=5)
    finally:
        server.stop(None)


def test_cluster_up_on_a_mac_recommends_the_desktop_as_head(monkeypatch, capsys, tmp_path):
    import platform

    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path))
    state = NodeState(role="head", address="192.168.1.20:6379", node_ip="192.168.1.20", pgid=1, log="head.log")
    monkeypatch.setattr(headnode, "up", lambda **kw: state)  # starting Ray is not what is shown here
    for system, advised in (("Linux", False), ("Darwin", True)):
        monkeypatch.setattr(platform, "system", lambda s=system: s)
        assert main(["cluster", "up"]) == 0
        assert (headnode.MAC_HEAD_ADVICE in capsys.readouterr().out) is advised


@pytest.fixture
def fake_head(tmp_path, monkeypatch):
    """`cluster up` with its outside calls faked: `ray start` is a real process leading its own group (`sleep`),
    the head answers at once. Yields the spawned processes."""
    import subprocess

    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path / "home"))
    spawned: list[subprocess.Popen] = []

    def spawn(args, env, log):
        spawned.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
        return spawned[-1]

    class Gcs:
        def internal_kv_put(self, *args, **kwargs) -> None:
            pass

    monkeypatch.setattr(headnode, "_spawn", spawn)
    monkeypatch.setattr(headnode, "apply_auth_env", lambda env: None)  # not this test process's Ray settings
    monkeypatch.setattr(headnode, "check_reachable", lambda address, timeout_s=None: None)
    monkeypatch.setattr(headnode, "_gcs", lambda address: Gcs())
    monkeypatch.setattr(headnode, "prove_token_required", lambda address, token: None)
    yield spawned
    for proc in spawned:
        proc.kill()
        proc.wait()


def _up():
    return headnode.up(port=6379, interface=None, node_ip="10.0.0.1", num_cpus=None, temp_dir=None)


@pytest.mark.parametrize("fails", ["token check", "record"])
def test_a_failed_up_stops_the_head_and_keeps_the_token_this_machine_had(fake_head, monkeypatch, fails):
    # the kept token may be another head's (this machine joined it before): a failed `up` must not rotate it,
    # and a head whose start could not be recorded must not keep running where `down` cannot find it
    auth.write_token(TOKEN)
    if fails == "token check":
        boom = headnode.ClusterError("token authentication is NOT enforced")
        monkeypatch.setattr(headnode, "prove_token_required", lambda address, token: (_ for _ in ()).throw(boom))
    else:
        monkeypatch.setattr(headnode, "record", lambda **kw: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises((headnode.ClusterError, OSError)):
        _up()
    [proc] = fake_head
    assert proc.wait(timeout=30) is not None  # stopped
    assert auth.token_path().read_text() == TOKEN and headnode.load_state() is None
    assert [p.name for p in auth.token_path().parent.glob("auth_token*")] == ["auth_token"]


def test_a_good_up_keeps_the_heads_token_once_it_is_recorded(fake_head):
    auth.write_token(TOKEN)
    state = _up()
    [proc] = fake_head
    assert proc.poll() is None and state.pgid == proc.pid and headnode.load_state() == state
    kept = auth.token_path().read_text()
    assert kept != TOKEN and kept == (auth.token_path().parent / headnode.HEAD_TOKEN).read_text()
    assert stat.S_IMODE(os.stat(auth.token_path()).st_mode) == 0o600


def _hanging_gcs() -> tuple[grpc.Server, str, object]:
    """A gRPC server that gives a cluster id (so Ray's client connects) and then never answers a KV call:
    a GCS that accepted the connection and hangs."""
    import threading

    from ray.core.generated import gcs_service_pb2

    release = threading.Event()

    def cluster_id(request: bytes, context: grpc.ServicerContext) -> bytes:
        return gcs_service_pb2.GetClusterIdReply(cluster_id=os.urandom(28)).SerializeToString()

    def hang(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(120)
        return b""

    handlers = [
        grpc.method_handlers_generic_handler(
            "ray.rpc.NodeInfoGcsService", {"GetClusterId": grpc.unary_unary_rpc_method_handler(cluster_id)}
        ),
        grpc.method_handlers_generic_handler(
            "ray.rpc.InternalKVGcsService",
            {name: grpc.unary_unary_rpc_method_handler(hang) for name in ("InternalKVGet", "InternalKVPut")},
        ),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=handlers)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", release


def test_gcs_key_value_calls_give_up_after_the_connect_timeout(monkeypatch):
    import threading

    monkeypatch.setenv("MIXTRAIN_CONNECT_TIMEOUT_S", "1")
    server, address, release = _hanging_gcs()
    outcomes: list[BaseException | None] = []

    def call(what) -> None:
        try:
            what(address)
            outcomes.append(None)
        except BaseException as exc:  # whatever it is, it must come
            outcomes.append(exc)

    try:
        for what in (headnode.head_card, lambda address: headnode._put_card(address)):
            thread = threading.Thread(target=call, args=(what,), daemon=True)
            thread.start()
            thread.join(timeout=15)
            assert not thread.is_alive(), "a key-value call waited on a hanging GCS for more than 15 s"
        assert all(exc is not None and "Deadline" in str(exc) for exc in outcomes), outcomes
    finally:
        release.set()  # type: ignore[attr-defined]
        server.stop(None)
