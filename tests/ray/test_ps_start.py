"""Parameter-server actors: a start that hangs fails within MIXTRAIN_PS_START_TIMEOUT_S, not never; the weights
every push of an update gets back are one object in the store."""

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


def test_every_push_of_a_step_gets_the_same_weights_object():
    """The shard puts its new weights in the store once per update and every waiting push gets a reference to
    that one object: the store holds the slice once a step, whatever the number of workers."""
    import numpy as np
    import ray
    import torch

    from mixtrain.comm.replicas import flat_on_host
    from tests.models import factory, make_task

    [shard] = ps_server.start(factory("mlp", "sgd"), shards=1, seed=0, compress="none", node_id=None)
    try:
        torch.manual_seed(0)
        task = make_task("mlp", "sgd")
        params = list(task.model.parameters())
        weights = flat_on_host(params).numpy()
        sd = task.optimizer.state_dict()
        ray.get(shard.load.remote(2, weights, {}, sd["param_groups"], None))
        grads = [np.full_like(weights, 0.5), np.full_like(weights, 1.5)]
        stats = np.zeros(1, dtype=np.float32)
        answers = ray.get([shard.push.remote(0, rank, g, 1.0, True, stats) for rank, g in enumerate(grads)])
        refs = [answer[3] for answer in answers]
        assert all(isinstance(ref, ray.ObjectRef) for ref in refs) and refs[0] == refs[1]
        lr = sd["param_groups"][0]["lr"]
        np.testing.assert_allclose(ray.get(refs[0]), weights - lr * 2.0, rtol=1e-6)  # SGD on the summed gradient
    finally:
        ray.kill(shard)
