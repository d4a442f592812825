"""Which interface gloo and NCCL use, chosen again at every formation of the group."""

from __future__ import annotations

import os

import pytest

from mixtrain.comm import netif

ADDRESSES = {"lo": ["127.0.0.1"], "eth0": ["192.168.1.20"]}


@pytest.fixture
def machine(monkeypatch):
    monkeypatch.setattr(netif, "ipv4_addresses", lambda: ADDRESSES)
    monkeypatch.setattr(netif, "_pinned", {}, raising=False)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(var, "")  # recorded, so that what pin_interface sets is undone after the test
        monkeypatch.delenv(var)


@pytest.mark.usefixtures("machine")
def test_each_formation_pins_its_own_interface_loopback_when_every_worker_is_on_this_node():
    assert netif.pin_interface("127.0.0.1", "gloo") == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    # the next formation spans nodes (a replacement on another machine): the node's interface, not loopback
    assert netif.pin_interface("192.168.1.20", "gloo") == "eth0" and os.environ["GLOO_SOCKET_IFNAME"] == "eth0"
    assert netif.pin_interface("127.0.0.1", "nccl") == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"


@pytest.mark.usefixtures("machine")
def test_an_interface_the_user_chose_is_kept_at_every_formation(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # --interface, ScalingConfig.network_interface, or by hand
    assert netif.pin_interface("127.0.0.1", "gloo") == "eth0"
    assert netif.pin_interface("192.168.1.20", "gloo") == "eth0"


@pytest.mark.parametrize("ip,loopback", [("127.0.0.1", True), ("::1", True), ("10.0.0.2", False), ("host", False)])
def test_is_loopback(ip, loopback):
    assert netif.is_loopback(ip) is loopback
