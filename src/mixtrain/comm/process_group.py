"""The gloo process group among workers: rendezvous at rank 0, explicit timeouts, teardown."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from datetime import timedelta

import torch.distributed as dist

from mixtrain.comm.netif import unreachable_hint
from mixtrain.errors import InputValueError


class RendezvousError(RuntimeError):
    """A peer never arrived at the rendezvous, or the group could not be formed."""


class Rendezvous:
    """Rank 0's side of one formation: a TCPStore server that the ranks (rank 0 too) connect to, listening on
    `host` only (127.0.0.1 when every worker is on one node), and a random key prefix for this formation.

    TCPStore has no authentication, and given a port it listens on every interface whatever `host` says; so the
    socket is made here, bound to `host` on a port the OS picks (no window in which another process can take it),
    and handed to the store. The prefix travels to the other ranks through Ray (which checks its token), so keys
    written blindly (the fixed names of before, mixtrain/arrived/N) count for nothing; one connected while the
    store is open can still list its keys (TCPStore serves that to anyone) and so learn the prefix: what keeps
    strangers out is the address (loopback when it can be) and the short time it is open. close() stops the
    server: the group no longer needs it once every rank has formed it (join_group)."""

    def __init__(self, host: str, timeout_s: float) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as listener:
            listener.bind((host, 0))
            listener.listen(128)
            self.port: int = listener.getsockname()[1]
            self._server: dist.TCPStore | None = dist.TCPStore(
                host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
                master_listen_fd=listener.fileno(),
            )
            listener.detach()  # the store's now: it closes it when it stops
        self.host = host
        self.prefix = secrets.token_hex(16)

    def close(self) -> None:
        """Stop the server (its port closes; the ranks' connections to it end). Safe to call twice."""
        self._server = None


def choose_backend(
    requested: str, kinds: list[str], nccl_available: bool, shared_gpu: tuple[int, int] | None = None
) -> str:
    """gloo through CPU buffers for any mix; NCCL only when every worker is CUDA, has it, and has a GPU of its
    own (`shared_gpu`: two workers that share one card, which NCCL refuses: "Duplicate GPU detected")."""
    all_cuda = all(k == "cuda" for k in kinds)
    if requested == "nccl" and not (all_cuda and nccl_available):
        raise InputValueError(
            f"backend='nccl' needs every worker on CUDA with NCCL available, but the devices are {kinds}"
            f"{'' if nccl_available else ' and this torch has no NCCL'}; use backend='gloo' or 'auto'"
        )
    if requested == "nccl" and shared_gpu is not None:
        a, b = shared_gpu
        raise InputValueError(
            f"backend='nccl': workers {a} and {b} share one GPU, and NCCL takes one worker per GPU; give each "
            "worker a GPU of its own (resources_per_worker={'GPU': 1}), or use backend='gloo' or 'auto' "
            "(which use gloo for workers that share a card)"
        )
    if requested == "auto":
        return "nccl" if all_cuda and nccl_available and shared_gpu is None else "gloo"
    return requested


def group_backend(requested: str, devices: list[tuple[str, str, str, bool]]) -> tuple[str, str | None]:
    """The collective backend of a group, from each worker's (node, device kind, device uuid, NCCL available): the
    one choice both doors make (a Task's bring-up, a loop's). Also why NCCL was passed over where every worker is
    CUDA and two share one card (None otherwise), for the start-of-run notes."""
    kinds = [kind for _, kind, _, _ in devices]
    sharing = shared_gpu([(node, kind, uuid) for node, kind, uuid, _ in devices])
    backend = choose_backend(requested, kinds, all(nccl for *_, nccl in devices), sharing)
    if sharing is not None and requested == "auto" and all(k == "cuda" for k in kinds):
        return backend, f"backend gloo, not NCCL: workers {sharing[0]} and {sharing[1]} share one GPU"
    return backend, None


def shared_gpu(devices: list[tuple[str, str, str]]) -> tuple[int, int] | None:
    """The first two workers (by rank) on one physical GPU, from each worker's (node, device kind, device
    uuid); None when every GPU has one worker. Devices without a uuid (CPUs) are never shared."""
    seen: dict[tuple[str, str], int] = {}
    for rank, (node, kind, uuid) in enumerate(devices):
        if kind != "cuda" or not uuid:
            continue
        if (node, uuid) in seen:
            return seen[(node, uuid)], rank
        seen[(node, uuid)] = rank
    return None


NCCL_ERRORS_AS_EXCEPTIONS = {
    # 2 = CleanUpOnly: on a timed-out or failed collective the watchdog aborts the communicator and leaves the
    # process alone; torch's default (3, SkipCleanUp) and 1 (TearDown) end the whole process instead, and a
    # worker that is killed cannot roll back and rejoin.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # wait() blocks until the collective is done and raises there when it times out or is aborted, so the
    # failure reaches the step loop as a Python exception (is_peer_failure) instead of a later CUDA hang.
    "TORCH_NCCL_BLOCKING_WAIT": "1",
}


def nccl_errors_as_exceptions() -> None:
    """Make a lost NCCL peer a Python exception in this process (read when the NCCL group is created)."""
    for name, value in NCCL_ERRORS_AS_EXCEPTIONS.items():
        if os.environ.get(name, value) != value:
            logging.getLogger("mixtrain").warning(
                "%s=%s would end this worker on a lost peer; mixtrain sets %s", name, os.environ[name], value
            )
        os.environ[name] = value


def join_group(
    *,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    prefix: str,
    rendezvous_timeout_s: float,
    collective_timeout_s: float,
    backend: str = "gloo",
    rendezvous: Rendezvous | None = None,
) -> None:
    """Join the default process group through rank 0's store at host:port, under this formation's key `prefix`;
    raises RendezvousError within the timeout if a peer is missing. Rank 0 passes its `rendezvous`, which is
    closed here once every rank has formed the group (gloo needs the store no more; NCCL may, to set up
    communicators later, so its store stays open until the worker leaves), or when forming failed."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if backend == "nccl":
        nccl_errors_as_exceptions()
    store, timeout = None, timedelta(seconds=rendezvous_timeout_s)
    try:
        # every rank connects as a client, rank 0 too: the group holds no reference to the server, which can
        # then be stopped while the group lives on
        store = dist.TCPStore(host, port, world_size=None, is_master=False, timeout=timeout)
        keys = dist.PrefixStore(f"mixtrain/{prefix}", store)
        # Every rank announces itself and waits for all: a missing peer fails here, within
        # the rendezvous timeout, instead of inside the first collective.
        keys.set(f"arrived/{rank}", "1")
        keys.wait([f"arrived/{r}" for r in range(world_size)], timeout)
        dist.init_process_group(
            backend, store=keys, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
        )
        # A rank done with init_process_group reads no more keys; the last one to finish may still be reading
        # its peers' addresses while the others are done, so rank 0 waits for all before it stops the store.
        keys.set(f"formed/{rank}", "1")
        if rendezvous is not None and backend != "nccl":
            keys.wait([f"formed/{r}" for r in range(world_size)], timeout)
            rendezvous.close()
    except (RuntimeError, dist.DistStoreError) as exc:  # DistStoreError is a RuntimeError; named for clarity
        if rendezvous is not None:
            rendezvous.close()
        hint = unreachable_hint(host, port) if store is None else None  # only when rank 0 was never reached
        advice = hint or f"Check that every node can reach {host}:{port} (firewall, wrong interface)"
        raise RendezvousError(
            f"rank {rank} of {world_size} could not form the {backend} group at {host}:{port} within "
            f"{rendezvous_timeout_s:.0f} s (MIXTRAIN_RENDEZVOUS_TIMEOUT_S): a peer did not arrive or cannot reach "
            f"rank 0's address. {advice}. Cause: {exc}"
        ) from exc


def leave_group() -> None:
    """Tear the group down; safe to call when none exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


class PeerLostError(RuntimeError):
    """A peer (or the parameter server waiting on it) did not answer within the collective timeout."""


_PEER_FAILURE_MARKS = (
    "gloo/transport",  # gloo: "Connection closed by peer", "Timed out waiting ... for recv", resets
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "NCCL communicator was aborted",
    "NCCL error",
)


def is_peer_failure(exc: BaseException) -> bool:
    """True when `exc` comes from a collective whose peer died or stopped answering (not from this
    worker's own code or device): the worker is healthy and can rejoin a re-formed group."""
    if isinstance(exc, (dist.DistNetworkError, dist.DistBackendError, PeerLostError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(mark in text for mark in _PEER_FAILURE_MARKS)


def is_peer_silence(exc: BaseException) -> bool:
    """True when a peer failure is a collective that timed out (a peer silent for the whole collective
    timeout), not a connection its peer closed (a process that died, or left the group on purpose)."""
    text = str(exc).lower()
    return isinstance(exc, PeerLostError) or "timed out" in text or "timeout" in text
