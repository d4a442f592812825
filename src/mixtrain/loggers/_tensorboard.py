"""TensorBoard event files in RUN_DIR/tensorboard, as a Callback. RunConfig.tensorboard (None: when installed)
adds one; `TensorBoardLogger()` in `callbacks=` or `--logger tensorboard` asks for it outright."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixtrain._files import RunFolder
from mixtrain.callbacks import Callback, Evaluated, RoundEnded, RunEnded, RunStarted
from mixtrain.errors import MissingExtraError
from mixtrain.loggers._scalars import eval_scalars, round_scalars

TENSORBOARD_DIR = "tensorboard"
FLUSH_S = 10
"""How often the writer flushes its events to disk (TensorBoard reads the files as they grow)."""


def summary_writer_class() -> Any:
    """tensorboardX's SummaryWriter, or torch's (which needs the `tensorboard` package); None without either."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
    return SummaryWriter


def check_tensorboard(wanted: bool | None) -> None:
    """Fail before anything starts when TensorBoard files are required but cannot be written."""
    if wanted and summary_writer_class() is None:
        raise MissingExtraError(
            "TensorBoard event files (RunConfig.tensorboard=True, --tensorboard, --logger tensorboard or "
            "TensorBoardLogger) need tensorboardX (or tensorboard), which is not installed: pip install "
            "'mixtrain[tensorboard]', or leave RunConfig.tensorboard at None (write when installed)"
        )


class TensorBoardLogger(Callback):
    """Scalars for TensorBoard: train/loss, train/samples_per_s, train/grad_norm, train/lr/group<i>,
    samples_per_s/<device>, share/<device> each round and held_out/<metric> each evaluation, all at the
    training samples seen (comparable across batch sizes). `log_dir`: RUN_DIR/tensorboard unless given.

        tensorboard --logdir mixtrain_runs
    """

    def __init__(self, log_dir: str | Path | None = None) -> None:
        check_tensorboard(True)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.writer: Any = None

    def on_run_start(self, event: RunStarted) -> None:
        if self.log_dir is not None:
            folder = self.log_dir
        else:  # made 0700; a link planted at RUN_DIR/tensorboard is refused, not written through
            with RunFolder(event.run_dir) as run:
                folder = run.folder(TENSORBOARD_DIR)
        self.writer = summary_writer_class()(str(folder), flush_secs=FLUSH_S)

    def on_round_end(self, event: RoundEnded) -> None:
        self._add(round_scalars(event), event.samples_seen)

    def on_eval_end(self, event: Evaluated) -> None:
        self._add(eval_scalars(event), event.samples_seen)

    def _add(self, scalars: dict[str, float], step: int) -> None:
        if self.writer is None:  # its start failed (reported once): nothing to write to
            return
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def on_run_end(self, event: RunEnded) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
