"""The cluster token: where it is kept, how it reaches another machine, and proof that the head demands it.

Ray enforces token authentication (RAY_AUTH_MODE=token) from 2.52 on: every gRPC and HTTP entry point of
its processes refuses a request without the token. What the token does not do is hide anything: Ray sends
it, and all other traffic, in clear text, so whoever can read the network can read the token. docs/security.md's
security section says what that means and what to use on a network you do not trust.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from mixtrain._constants import CONNECT_TIMEOUT_S, env_float
from mixtrain._files import atomic_write
from mixtrain.cluster import ray_shim
from mixtrain.cluster.state import ClusterError, home, load_state
from mixtrain.errors import InputValueError

MIN_RAY = (2, 52)
"""The first Ray with token authentication; pyproject.toml requires it too."""
_TOKEN = re.compile(r"[\x21-\x7e]{16,512}")  # printable, no whitespace: it is sent as an HTTP/2 header value
_KV_GET = "/ray.rpc.InternalKVGcsService/InternalKVGet"  # a read-only call that every GCS serves


def token_path() -> Path:
    return home() / "auth_token"


def write_token(token: str, path: Path | None = None) -> Path:
    """Keep `token` in token_path() (or `path`), mode 0600 whatever was there before: a new private file is
    written and renamed over the old one (a symlink planted there is replaced, never written through)."""
    token = token.strip()
    if not _TOKEN.fullmatch(token):
        raise ClusterError(
            "that is not a cluster token (16 to 512 printable characters without spaces); copy the file "
            "that `mixtrain cluster up` names (its auth_token) to this machine and pass --token-file"
        )
    return atomic_write(path or token_path(), lambda f: f.write(token.encode()))  # a new file, 0600


def read_token_arg(token: str | None, token_file: str | None, stdin: TextIO) -> str | None:
    """The token `cluster join` was given: --token TEXT, or --token-file PATH ('-': standard input). With
    neither: None when this machine keeps one already, else asked for without echo at a terminal."""
    if token is not None and token_file is not None:
        raise InputValueError("cluster join: give --token-file or --token, not both")
    if token is not None:
        print(
            "warning: --token puts the cluster token on the command line, where every user of this machine can "
            "read it (ps) and your shell history keeps it; use --token-file PATH, or --token-file - to pipe it in",
            file=sys.stderr,
        )
        return token
    if token_file == "-":
        return stdin.read().strip()
    if token_file is not None:
        try:
            return Path(token_file).expanduser().read_text().strip()
        except OSError as exc:
            raise InputValueError(f"--token-file {token_file!r}: {exc.strerror or exc}") from None
    if token_path().exists() or not stdin.isatty():
        return None  # the one kept here; without one, auth_env says how to give it
    import getpass

    return getpass.getpass("cluster token (the head's auth_token file; not echoed): ")


def auth_env(token: str | None = None, path: Path | None = None) -> dict[str, str]:
    """Environment for a Ray process or driver of this cluster: token mode, the token read from our file
    (RAY_AUTH_TOKEN_PATH, so the token itself is in no process's arguments or environment). `path`: another file
    than the one this machine keeps (a new head's, until it is known to work)."""
    if token is not None:
        write_token(token, path)
    path = path or token_path()
    if not path.exists():
        raise ClusterError(
            f"no cluster token in {path}: on the head, run `mixtrain cluster up`; elsewhere give the head's "
            "token file with --token-file PATH (or pipe it in)"
        )
    if path.stat().st_mode & 0o077:  # someone loosened it: the token is the key to every node
        os.chmod(path, 0o600)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def require_token_auth() -> str:
    """The installed Ray's version, after checking that it enforces token authentication."""
    import ray

    parts = tuple(int(p) for p in re.findall(r"\d+", ray.__version__)[:2])
    if not ray_shim.token_auth_available():
        parts = (0, 0)
    if parts < MIN_RAY:
        want = ".".join(map(str, MIN_RAY))
        raise ClusterError(
            f"Ray {ray.__version__} cannot require a token, so anyone on the network could run code on this "
            f"cluster; install Ray {want} or newer on every machine (pip install 'ray[default]>={want}')"
        )
    return ray.__version__


def apply_auth_env(env: dict[str, str]) -> None:
    """Put the token settings into this process. Ray reads them once, when it is imported, so its config
    and token cache are reloaded too (as Ray's own test utilities do)."""
    require_token_auth()
    os.environ.update(env)
    ray_shim.reload_auth_config()


def use_cluster_token(address: str) -> None:
    """For a driver (`mixtrain train --address`): use this machine's cluster token for its own
    cluster's address unless the user set one."""
    state = load_state()
    if state is not None and state.address == address and not os.environ.get("RAY_AUTH_TOKEN"):
        apply_auth_env(auth_env())


_TLS_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def tls_on() -> bool:
    """Whether Ray's own TLS is asked for (RAY_USE_TLS): then its gRPC traffic, the token with it, is encrypted."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def _channel(address: str) -> Any:
    """A gRPC channel to `address` as Ray's own clients open it: plain, or with Ray's TLS (RAY_USE_TLS=1 and
    the three RAY_TLS_* files: this node's certificate and key, and the CA that signed every node's)."""
    import grpc

    if not tls_on():
        return grpc.insecure_channel(address)
    missing = [name for name in _TLS_FILES if not os.environ.get(name)]
    if missing:
        raise ClusterError(f"RAY_USE_TLS is set but {', '.join(missing)} is not: Ray needs all three TLS files")
    cert, key, ca = (Path(os.environ[name]).read_bytes() for name in _TLS_FILES)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(address, credentials)


def token_check(address: str, token: str, timeout_s: float | None = None) -> tuple[bool | None, str]:
    """Ask the GCS at `address` for a key twice over plain gRPC: without the token (it must refuse) and with
    it (it must answer, so the refusal was about the token). (True, how) when the token is required,
    (False, how) when a call without it was served, (None, why) when the check itself could not run."""
    import grpc

    timeout = env_float(CONNECT_TIMEOUT_S) if timeout_s is None else timeout_s
    with _channel(address) as channel:
        call = channel.unary_unary(_KV_GET, request_serializer=bytes, response_deserializer=bytes)
        try:
            call(b"", timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                return None, f"the GCS at {address} did not answer the check: {exc.code().name} {exc.details()}"
        else:
            return False, f"the GCS at {address} served a call that carried no token"
        try:
            call(b"", timeout=timeout, metadata=[("authorization", f"Bearer {token}")])
        except grpc.RpcError as exc:
            return None, f"the GCS at {address} refused this cluster's own token too: {exc.code().name}"
    return True, f"the GCS at {address} refused a call without the token and served one with it"


def prove_token_required(address: str, token: str) -> None:
    """Raise ClusterError unless the head at `address` refuses a call that carries no token."""
    required, how = token_check(address, token)
    if required:
        return
    if required is False:
        raise ClusterError(
            f"token authentication is NOT enforced: {how}, so anyone who reaches it can run code on this "
            f"machine. This Ray did not honour RAY_AUTH_MODE=token; the head was stopped"
        )
    raise ClusterError(f"could not confirm that the head requires its token ({how}); the head was stopped")
