"""Pure parts of `mixtrain cluster`: version parity, node address choice, state and token files."""

from __future__ import annotations

import os
import stat

import pytest

from mixtrain.cluster import headnode

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
    env = headnode.auth_env("secret")
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "auth_token")}
    assert stat.S_IMODE(os.stat(tmp_path / "auth_token").st_mode) == 0o600
    assert headnode.load_state() is None and headnode.down() is None
