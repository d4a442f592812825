"""Readers for what the loggers write, with the trackers' own libraries and no server: an MLflow store, a W&B
offline run's transaction log, TensorBoard event files."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest


def needs(module: str, extra: str) -> pytest.MarkDecorator:
    """Skip where the tracker's library is not installed (a user's machine), never in CI (CI=true), whose dev
    install has them all: a missing one fails there."""
    missing = importlib.util.find_spec(module) is None and not os.environ.get("CI")
    return pytest.mark.skipif(missing, reason=f'{module} is not installed: pip install "mixtrain[{extra}]"')


needs_mlflow = needs("mlflow", "mlflow")
needs_wandb = needs("wandb", "wandb")


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars in TensorBoard event files: TFRecords of Event protos, read without TensorFlow."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


WANDB_BLOCK = 32768
"""A .wandb file is a LevelDB-style log: 32 KiB blocks of chunks (crc32, length, type), after a 7-byte header."""


def wandb_records(path: Path) -> list[Any]:
    """Every Record (wandb's own protobuf) in an offline run's .wandb file."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, at, pending = [], 7, b""
    while at + 7 <= len(data):
        if WANDB_BLOCK - at % WANDB_BLOCK < 7:  # too little room left for a chunk header: padding
            at += WANDB_BLOCK - at % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + 7])
        if kind == 0 and length == 0:
            break
        pending += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_run(folder: Path) -> dict[str, Any]:
    """The one offline run under folder/wandb: its config, history rows, summary and exit code. Stops wandb's
    service first: run.finish() can return before the service has written the run's records to the file."""
    import wandb

    wandb.teardown()
    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    run: dict[str, Any] = {"config": {}, "history": [], "summary": {}, "exit_code": None, "id": None}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"], run["project"] = record.run.run_id, record.run.project
            run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            run["history"].append(_items(record.history.item))
        elif kind == "summary":
            run["summary"].update(_items(record.summary.update))
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def _items(items: Any) -> dict[str, Any]:
    return {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}


def mlflow_run(uri: str, experiment: str = "mixtrain") -> tuple[Any, Any]:
    """(client, the one run) of an MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


def mlflow_steps(client: Any, run: Any, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


def mlflow_artifacts(client: Any, run: Any, path: str | None = None) -> list[str]:
    """Every artifact file's path under `path`, recursively."""
    out = []
    for item in client.list_artifacts(run.info.run_id, path):
        out += mlflow_artifacts(client, run, item.path) if item.is_dir else [item.path]
    return sorted(out)
