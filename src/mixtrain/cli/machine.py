"""`mixtrain devices` and `mixtrain env`: what this machine has, for a look or for a bug report."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_devices_parser(sub: Any) -> None:
    sub.add_parser("devices", help="list this machine's devices", description="List this machine's devices.")


def add_env_parser(sub: Any) -> None:
    env = sub.add_parser(
        "env",
        help="everything a bug report needs: OS, Python, torch, Ray, mixtrain, devices, network",
        description="Print the platform, versions, devices, this machine's cluster and the settings that "
        "change mixtrain's behaviour; paste it into a bug report.",
    )
    env.add_argument("--json", action="store_true", help="one JSON object instead of text")


def cmd_devices(args: argparse.Namespace) -> int:
    import socket

    from mixtrain import compat, devices
    from mixtrain.cluster.headnode import format_devices

    v = compat.versions()
    print(f"{socket.gethostname()}: python {v['python']}, torch {v['torch']}, ray {v['ray']}, mixtrain {v['mixtrain']}")
    print("\n".join(format_devices([d.as_dict() for d in devices.local_devices()])))
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from mixtrain.cli import envinfo  # imports torch

    report = envinfo.bug_report()
    print(json.dumps(report, indent=2) if args.json else envinfo.format_bug_report(report))
    return 0
