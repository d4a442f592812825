"""Ctrl-C without losing work: the first SIGINT (or SIGTERM) asks training to stop at the next round
boundary, where the controller writes a checkpoint and stops with the exact resume command; a second one
stops at once (checkpoints are written atomically, so the last one stays intact).

A terminal sends Ctrl-C's SIGINT to the whole foreground process group, and the embedded Ray's own
processes (GCS, raylet, the workers it starts) are in it: `cluster.connect` starts them with SIGINT
ignored, which they inherit, so the driver alone decides what Ctrl-C does.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on Ctrl-C (or SIGTERM) at a round boundary; `checkpoint` is where to resume from."""

    def __init__(self, message: str, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class GracefulStop:
    """Installed for the length of `Trainer.fit` (main thread only). Before `arm()` (start-up, nothing to save
    yet) a signal stops at once; after it, the first one sets `requested` and says what will happen."""

    def __init__(self, say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> None:
        self.requested = False
        self.armed = False
        self._say = say
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if _main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def arm(self) -> None:
        self.armed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested or not self.armed:
            self.__exit__()
            raise KeyboardInterrupt
        self.requested = True
        name = signal.Signals(signum).name
        self._say(f"{name}: finishing this round and writing a checkpoint (press Ctrl-C again to stop at once)")
