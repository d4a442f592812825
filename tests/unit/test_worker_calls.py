"""Every typed call to a worker (group/worker_calls.py) is TrainWorker's method of the same name and signature, so a
reader, mypy and an IDE can follow a call from the driver into the worker (issue 34)."""

from __future__ import annotations

import inspect

from mixtrain.group.worker_calls import Pending, WorkerCalls
from mixtrain.worker.replica import TrainWorker


def _parameters(fn) -> list[tuple[str, object]]:
    # (Ray adds _ray_trace_ctx to an actor class's methods once it has made an actor of it)
    skip = ("self", "_ray_trace_ctx")
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in skip]


def test_each_call_has_the_workers_name_and_parameters():
    calls = {n: f for n, f in vars(WorkerCalls).items() if callable(f) and not n.startswith("_")}
    assert len(calls) >= 20
    for name, call in calls.items():
        assert hasattr(TrainWorker, name), name
        if name.startswith("stream_"):  # the proxy adds how far ahead the worker may stream
            assert _parameters(call) == [("ahead", inspect.Parameter.empty)], name
            assert _parameters(getattr(TrainWorker, name)) == [], name
            continue
        assert _parameters(call) == _parameters(getattr(TrainWorker, name)), name


def test_a_call_starts_the_method_on_the_actor_and_names_it():
    class Actor:
        def __getattr__(self, name):
            class Method:
                @staticmethod
                def remote(*args):
                    return (name, args)

            return Method()

    pending = WorkerCalls(Actor()).probe(4, 64, None)
    assert isinstance(pending, Pending) and pending.ref == ("probe", (4, 64, None, False)) and pending.method == "probe"


def test_the_driver_calls_no_worker_method_by_name():
    import pathlib

    core = pathlib.Path(inspect.getfile(TrainWorker)).parent.parent
    for path in core.rglob("*.py"):
        text = path.read_text()
        assert "getattr(actor" not in text and 'call("' not in text and "call_each(" not in text, path


def test_the_loop_worker_is_a_worker_process_without_the_task_replicas_methods():
    """Issue 47: the loop worker inherited TrainWorker's 36 methods of the `Task` path. Both now build on one
    WorkerProcess (logs, rank, rendezvous, kept for the next fit), and each typed loop call is the loop worker's."""
    from mixtrain.train._loop_calls import LoopCalls
    from mixtrain.train._loop_worker import LoopWorker
    from mixtrain.worker.worker_process import WorkerProcess

    assert issubclass(LoopWorker, WorkerProcess) and issubclass(TrainWorker, WorkerProcess)
    assert not issubclass(LoopWorker, TrainWorker)
    for task_only in ("build", "probe", "run_round", "evaluate", "training_state", "load_training_state"):
        assert hasattr(TrainWorker, task_only) and not hasattr(LoopWorker, task_only), task_only
    for name in ("prepare_device", "join_loop", "run_loop"):
        assert _parameters(getattr(LoopCalls, name)) == _parameters(getattr(LoopWorker, name)), name
    for name in ("info", "set_rank", "open_rendezvous", "leave", "log_text", "shutdown", "reuse"):
        assert getattr(LoopWorker, name) is getattr(WorkerProcess, name), name
