"""The live per-device rows and the overall bar, rendered into a recording console."""

import io

from rich.console import Console

from mixtrain.observe.progress import ProgressView, device_table

RECORD = {
    "epoch": 1,
    "samples": 640,
    "last_loss": 0.4321,
    "samples_per_s": 1600.0,
    "wall_s": 0.4,
    "shares": [48, 16],
    "workers": [
        {"device": "cuda:0", "device_name": "NVIDIA GeForce RTX 4090", "host": "desktop", "samples": 480,
         "compute_s": 0.3, "wait_s": 0.0, "comm_s": 0.1, "memory_bytes": 3 * 2**30},
        {"device": "mps:0", "device_name": "Apple M2 Pro GPU (MPS)", "host": "macbook", "samples": 160,
         "compute_s": 0.2, "wait_s": 0.1, "comm_s": 0.1, "memory_bytes": 512 * 2**20},
    ],
}  # fmt: skip


def _console() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=150, color_system=None)


def test_one_row_per_device_with_share_speed_busy_waiting_and_memory():
    console = _console()
    console.print(device_table(RECORD))
    lines = console.file.getvalue().splitlines()
    assert lines[0].split() == ["worker", "device", "node", "share", "samples/s", "busy", "waiting", "comm", "memory"]
    assert lines[1].split() == ["0", "cuda:0", "NVIDIA", "GeForce", "RTX", "4090", "desktop", "48", "(75%)",
                                "1,200", "75%", "0%", "25%", "3.0", "GiB"]  # fmt: skip
    assert lines[2].split()[-9:] == ["macbook", "16", "(25%)", "400", "50%", "25%", "25%", "512", "MiB"]


def test_the_live_view_shows_rows_and_the_overall_bar_and_keeps_the_last_rows():
    console = _console()
    view = ProgressView(True, total_samples=6400, epochs=10, console=console)
    view.log("epoch 1/10: loss 0.5")
    view.round_done(RECORD)
    view._live.refresh()
    live = console.file.getvalue()
    assert "epoch 2/10" in live and "640/6400" in live and "loss 0.4321" in live and "1,600 samples/s" in live
    assert "ETA" in live and "RTX 4090" in live and "Apple M2 Pro" in live
    view.close()
    after = console.file.getvalue()[len(live) :]
    assert "last round, per device:" in after and "macbook" in after


def test_off_means_silent():
    console = _console()
    view = ProgressView(False, total_samples=10, console=console)
    view.log("hello")
    view.round_done(RECORD)
    view.close()
    assert console.file.getvalue() == ""
