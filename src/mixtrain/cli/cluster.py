"""`mixtrain cluster up|join|status|down`: a cluster of your own machines, one parser and one function per verb."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixtrain.cli.flag_types import _positive_int, _text
from mixtrain.errors import InputValueError

if TYPE_CHECKING:  # Ray is imported only by the verbs that need it
    from mixtrain.cluster.state import NodeState


def add_parser(sub: Any) -> None:
    cluster = sub.add_parser("cluster", help="start, join, inspect or stop a cluster of your machines")
    verbs = cluster.add_subparsers(dest="verb", required=True)
    _add_up_parser(verbs)
    _add_join_parser(verbs)
    status = verbs.add_parser("status", help="every node with its devices and versions")
    status.add_argument("--address", help="HOST:PORT of the head (default: this machine's cluster)")
    verbs.add_parser("down", help="stop the Ray processes that up/join started on this machine")


def _node_flags(p: argparse.ArgumentParser) -> None:
    """How this node joins the network: shared by `up` and `join`."""
    p.add_argument(
        "--interface", type=_text, help="network interface other machines reach this one on (e.g. en0, eth0)"
    )
    p.add_argument("--node-ip", help="this node's LAN address (instead of --interface)")
    p.add_argument("--num-cpus", type=_positive_int, help="CPUs this node offers (default: all)")
    p.add_argument("--temp-dir", help="Ray's temporary folder on this node (default /tmp/ray)")


def _add_up_parser(verbs: Any) -> None:
    up = verbs.add_parser(
        "up",
        help="start the head node here (token authentication, proven before it returns)",
        description="Start the head node here with token authentication on (the head must refuse a call without "
        "the token, or it is stopped again), without the Ray Client server, the dashboard or metrics export. The "
        "token is kept in $MIXTRAIN_HOME/auth_token (mode 0600) and never printed. Ray sends it unencrypted: on a "
        "network you do not trust, use a WireGuard/Tailscale interface (--interface) or Ray's TLS.",
    )
    up.add_argument("--port", type=_positive_int, default=6379, help="the head's port (default 6379)")
    up.add_argument("--dashboard", action="store_true", help="start Ray's dashboard too, on 127.0.0.1 only")
    _node_flags(up)


def _add_join_parser(verbs: Any) -> None:
    join = verbs.add_parser(
        "join",
        help="join this machine to a head",
        description="Join this machine to the head at ADDRESS. Give the head's token file with --token-file PATH "
        "(or --token-file - to read it from standard input); without either, the token this machine keeps is "
        "used, or asked for without echo.",
    )
    join.add_argument("address", help="HOST:PORT that `mixtrain cluster up` printed")
    join.add_argument("--token-file", metavar="PATH", help="the head's auth_token file; '-' reads standard input")
    join.add_argument(
        "--token", help="the token itself (visible to every user in the process list and kept in shell history)"
    )
    _node_flags(join)


def cmd_cluster(args: argparse.Namespace) -> int:
    verbs = {"up": _up, "join": _join, "status": _status, "down": _down}
    return verbs[args.verb](args)


def up_message(state: NodeState, token: Path, tls: bool = False) -> str:
    """What `cluster up` prints: where the token is and join commands that keep it off every command line."""
    wire = "Ray's TLS is on, so it travels encrypted" if tls else "Ray sends it unencrypted (docs/security.md)"
    return "\n".join(
        [
            f"head running at {state.address} (log: {state.log})",
            f"token authentication is on (a call without the token was refused); the token is in {token}",
            f"(mode 0600). It opens every machine of the cluster, and {wire}.",
            "on each other machine, with the same Python, torch and mixtrain versions, copy that file over and run:",
            f"  mixtrain cluster join {state.address} --token-file auth_token",
            "or pipe it, so it is written nowhere on the way:",
            f"  ssh {state.node_ip} cat {token} | mixtrain cluster join {state.address} --token-file -",
            "then train from this machine with:",
            f"  mixtrain train --address {state.address} --workers auto",
        ]
    )


def _up(args: argparse.Namespace) -> int:
    import platform

    from mixtrain.cluster import headnode
    from mixtrain.cluster.auth import tls_on

    state = headnode.up(
        port=args.port,
        interface=args.interface,
        node_ip=args.node_ip,
        num_cpus=args.num_cpus,
        temp_dir=args.temp_dir,
        dashboard=args.dashboard,
    )
    print(up_message(state, headnode.token_path(), tls_on()))
    if platform.system() == "Darwin":
        print(headnode.MAC_HEAD_ADVICE)
    return 0


def _join(args: argparse.Namespace) -> int:
    from mixtrain.cluster import headnode
    from mixtrain.cluster.auth import read_token_arg

    state = headnode.join(
        args.address,
        token=read_token_arg(args.token, args.token_file, sys.stdin),
        interface=args.interface,
        node_ip=args.node_ip,
        num_cpus=args.num_cpus,
        temp_dir=args.temp_dir,
    )
    print(f"joined {state.address} as {state.node_ip} (log: {state.log}); leave with `mixtrain cluster down`")
    return 0


def _status(args: argparse.Namespace) -> int:
    from mixtrain.cluster import headnode

    current = headnode.load_state()
    address = args.address or (current.address if current else None)
    if address is None:
        raise InputValueError("cluster status: no --address and this machine has no cluster; run `mixtrain cluster up`")
    headnode.use_cluster_token(address)
    print(headnode.format_status(headnode.status(address)))
    return 0


def _down(args: argparse.Namespace) -> int:
    from mixtrain.cluster import headnode

    gone = headnode.down()
    if gone is None:
        print("no mixtrain cluster runs here")
    elif gone[1] is None:
        print(f"stopped the Ray {gone[0].role} for {gone[0].address}")
    else:
        print(f"nothing to stop: the Ray {gone[0].role} for {gone[0].address} is gone ({gone[1]}); record removed")
    return 0
