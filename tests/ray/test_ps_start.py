"""Parameter-server actors that never come up fail the start within MIXTRAIN_PS_START_TIMEOUT_S, not never."""

from __future__ import annotations

import time

import pytest

from mixtrain.comm import ps_server

pytestmark = pytest.mark.usefixtures("ray_session")


def never_built():
    time.sleep(600)  # a task factory that hangs (a download that never ends, a lock)


def test_parameter_servers_that_hang_while_building_fail_within_the_limit(monkeypatch):
    monkeypatch.setenv("MIXTRAIN_PS_START_TIMEOUT_S", "3")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"parameter-server actor\(s\) did not start within 3 s"):
        ps_server.start(never_built, shards=2, seed=0, compress="none", node_id=None)
    assert time.monotonic() - t0 < 30
