"""MLflow tracking as a Callback: the run's settings as params, its metrics per round and evaluation, and its
records, report and final weights as artifacts.

Where: `tracking_uri`, else $MLFLOW_TRACKING_URI, else an SQLite store in the run folder (RUN_DIR/mlflow.db,
artifacts in RUN_DIR/mlartifacts), so a run's folder holds all of it (an sqlite:/// store given keeps its
artifacts beside its file, in mlartifacts/):

    mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db

To compare runs in one place give them one store: MLFLOW_TRACKING_URI=sqlite:///$PWD/mixtrain_runs/mlflow.db
(or a tracking server's http:// address)."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from mixtrain import _checks as check
from mixtrain._files import RunFolder
from mixtrain.callbacks import Callback, CheckpointSaved, Evaluated, RoundEnded, RunEnded, RunStarted, is_run_id
from mixtrain.errors import InputValueError, require
from mixtrain.loggers._scalars import eval_scalars, flat_params, round_scalars

STORE_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
RUN_ID_TAG = "mixtrain.run_id"
"""The mixtrain run id (kept across a resume): a resumed run finds its MLflow run by it and continues it."""
QUIET = ("alembic", "mlflow.store.db.utils", "mlflow.tracking.fluent", "mlflow.store.sqlalchemy_store")
"""Loggers that print INFO lines while a new SQLite store is set up: kept to warnings, under the progress view."""


class MLflowLogger(Callback):
    """One MLflow run per mixtrain run (a resumed run continues its MLflow run).

    params      RunStarted.config flattened: scaling.*, run.*, strategy.*, global_batch, epochs, shares, ...
    metrics     train/loss, train/samples_per_s, train/grad_norm, train/lr/group<i>, samples_per_s/<device>,
                share/<device> each round; held_out/<metric> each evaluation; all at step = global step
    artifacts   run/config.json and run/metrics.jsonl, report/ (summary.txt, and the plots with matplotlib),
                model/ (the final weights; log_model=False leaves them out)
    status      FINISHED; FAILED when the run ended with an error (tag mixtrain.error), KILLED when it was
                interrupted (Ctrl-C; it can be resumed); tag mixtrain.stopped_early when a callback stopped it
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "mixtrain",
        run_name: str | None = None,
        *,
        log_model: bool = True,
        tags: dict[str, str] | None = None,
    ) -> None:
        require("mlflow", "mlflow-skinny", "mlflow", "MLflowLogger (--logger mlflow)")
        check.text("MLflowLogger.tracking_uri", tracking_uri, none=True)
        check.text("MLflowLogger.experiment", experiment)
        check.text("MLflowLogger.run_name", run_name, none=True)
        check.boolean("MLflowLogger.log_model", log_model)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.log_model = log_model
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.client: Any = None
        self.run_id: str | None = None
        """The MLflow run's id, once started (None before, or when the start failed: nothing is logged then)."""
        self.pending: Any = None
        """The metrics batch being written in MLflow's background thread (a SQLite write takes ~20 ms a round)."""

    # ---- start --------------------------------------------------------------------------------------
    def store_uri(self, run_dir: Path) -> tuple[str, str | None]:
        """(tracking URI, artifact location for a new experiment: None lets the store decide)."""
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            _check_store(run_dir)
            return f"sqlite:///{run_dir / STORE_FILE}", (run_dir / ARTIFACTS_DIR).as_uri()
        if uri.startswith("sqlite:///"):  # MLflow would put the artifacts in ./mlruns, wherever the run started
            return uri, (Path(uri.removeprefix("sqlite:///")).absolute().parent / ARTIFACTS_DIR).as_uri()
        return uri, None

    def on_run_start(self, event: RunStarted) -> None:
        from mlflow.tracking import MlflowClient

        for name in QUIET:
            logging.getLogger(name).setLevel(logging.WARNING)
        uri, artifacts = self.store_uri(event.run_dir)
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(self.experiment)
        exp_id = found.experiment_id if found else client.create_experiment(self.experiment, artifacts)
        run_id = self._earlier_run(client, exp_id, event) if event.resumed_from is not None else None
        params = flat_params(event.config)
        if run_id is None:
            tags = {RUN_ID_TAG: event.run_id, "mixtrain.run_dir": str(event.run_dir), **self.tags}
            run_id = client.create_run(exp_id, tags=tags, run_name=self.run_name or event.run_dir.name).info.run_id
        else:  # params cannot change in MLflow: a resumed run adds new ones, and a changed one as a tag
            client.update_run(run_id, status="RUNNING")
            client.set_tag(run_id, "mixtrain.resumed_from", str(event.resumed_from))
            kept = client.get_run(run_id).data.params
            for k, v in params.items():
                if k in kept and kept[k] != v:  # --epochs on a resume: the total to reach now
                    client.set_tag(run_id, f"mixtrain.resumed.{k}", v)
            params = {k: v for k, v in params.items() if k not in kept}
        self._batch(client, run_id, params=params)
        self.client, self.run_id = client, run_id

    @staticmethod
    def _earlier_run(client: Any, exp_id: str, event: RunStarted) -> str | None:
        """The MLflow run this resumed run logged to. The id comes from the run folder: one that does not look
        like an id is not put into the search filter (it could widen it to another run); a new run is made."""
        if not is_run_id(event.run_id):
            return None
        runs = client.search_runs([exp_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{event.run_id}'", max_results=1)
        return runs[0].info.run_id if runs else None

    # ---- during ---------------------------------------------------------------------------------------
    def on_round_end(self, event: RoundEnded) -> None:
        self._metrics(round_scalars(event), event.global_step)

    def on_eval_end(self, event: Evaluated) -> None:
        self._metrics(eval_scalars(event), event.global_step)

    def on_checkpoint(self, event: CheckpointSaved) -> None:
        if self.run_id is not None:
            self.client.set_tag(self.run_id, "mixtrain.last_checkpoint", str(event.path))

    def _metrics(self, values: dict[str, float], step: int) -> None:
        if self.run_id is None:  # the start failed (reported once): nothing to log to
            return
        from mlflow.entities import Metric

        self._wait()  # the last round's batch: written while the workers trained (its error surfaces here)
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.pending = self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)

    def _wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    @staticmethod
    def _batch(client: Any, run_id: str, params: dict[str, str] | None = None) -> None:
        from mlflow.entities import Param

        client.log_batch(run_id, params=[Param(k, v) for k, v in (params or {}).items()])

    # ---- end ----------------------------------------------------------------------------------------
    def on_run_end(self, event: RunEnded) -> None:
        if self.run_id is None:
            return
        client, run_id = self.client, self.run_id
        self.run_id = None  # whatever happens below, the run is not logged to again
        try:
            self._wait()
            self._artifacts(client, run_id, event)
        finally:
            if event.stopped_early:
                client.set_tag(run_id, "mixtrain.stopped_early", event.stopped_early)
            if event.error is not None:
                client.set_tag(run_id, "mixtrain.error", f"{type(event.error).__name__}: {event.error}"[:5000])
            client.set_terminated(run_id, _status(event.error))

    def _artifacts(self, client: Any, run_id: str, event: RunEnded) -> None:
        # MLflow copies a file by its path, following links and keeping its mode: each run file goes through a
        # private copy read the run folder's one way (a link planted there is refused, never its target copied).
        with tempfile.TemporaryDirectory(prefix="mixtrain-artifacts-") as tmp, RunFolder(event.run_dir) as run:
            refused = []
            for name in ("config.json", "metrics.jsonl"):
                try:
                    client.log_artifact(run_id, str(run.copy_out(name, Path(tmp) / "run" / name)), "run")
                except FileNotFoundError:
                    pass
                except InputValueError as exc:  # the other artifacts are still logged; this one is said below
                    refused.append(str(exc))
            report = Path(tmp) / "report"
            report.mkdir()
            if write_report(event.run_dir, report):
                client.log_artifacts(run_id, str(report), "report")
            model = getattr(event.result, "model_path", None)
            if self.log_model and model is not None and Path(model).parent == event.run_dir:
                name = Path(model).name
                client.log_artifact(run_id, str(run.copy_out(name, Path(tmp) / "model" / name)), "model")
        if refused:
            raise InputValueError("; ".join(refused))


def _check_store(run_dir: Path) -> None:
    """The store in the run folder is opened by SQLite and MLflow by path: mlflow.db must be a regular file (made
    0600 here where missing) and mlartifacts/ a folder (0700) holding no link, or writes would go where a link
    planted there points."""
    with RunFolder(run_dir) as run:
        os.close(run.open(STORE_FILE, os.O_RDWR | os.O_CREAT))
        artifacts = run.folder(ARTIFACTS_DIR)
    for folder, dirs, files in os.walk(artifacts):  # os.walk follows no link to a folder
        for name in dirs + files:
            if os.path.islink(os.path.join(folder, name)):
                raise InputValueError(
                    f"{os.path.join(folder, name)} is a symbolic link: MLflow would write an artifact through it; "
                    "remove it"
                )


def _status(error: BaseException | None) -> str:
    """FINISHED; KILLED for Ctrl-C / SIGTERM (TrainingInterrupted: the run can be resumed); FAILED otherwise."""
    if error is None:
        return "FINISHED"
    return "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"


def write_report(run_dir: Path, out: Path) -> bool:
    """`mixtrain report`'s files in `out`: the plots with matplotlib, else the summary alone. False when the run
    has nothing to report (no round finished)."""
    from mixtrain.errors import InputError

    try:
        from mixtrain.observe.report import write_report as plots

        plots(run_dir, out)
        return True
    except ImportError:  # no matplotlib: the summary alone
        pass
    except InputError:
        return False
    from mixtrain.observe.report import read_run, summarize

    try:
        config, records = read_run(run_dir)
    except InputError:
        return False
    (out / "summary.txt").write_text(summarize(run_dir, config, records) + "\n")
    return True
