"""Runs inside `ray start` (RAY_START_HOOK), before it starts any process.

The Ray Client server listens on port 10001 of the node's address whenever Ray's client dependencies are
installed, and `ray start` has no flag to turn it off (`--ray-client-server-port` accepts only 1024-65535).
mixtrain's drivers talk to the GCS directly, so the head starts without it.
"""

from __future__ import annotations

from typing import Any


def harden(ray_params: Any, head: bool) -> None:
    ray_params.ray_client_server_port = None
