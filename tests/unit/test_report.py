"""`report` on a run folder written before rounds named their workers: ranks stand in for names."""

import json

from mixtrain.observe.report import write_report


def test_a_run_without_worker_names_reports_per_rank(tmp_path):
    workers = [{"samples": 48, "compute_s": 0.3, "wait_s": 0.0, "comm_s": 0.1},
               {"samples": 16, "compute_s": 0.2, "wait_s": 0.1, "comm_s": 0.1}]  # fmt: skip
    rounds = [
        {"kind": "round", "time": 100.0 + t, "epoch": 0, "first_step": t, "num_steps": 1, "samples": 64,
         "loss": 2.0 - t / 10, "samples_per_s": 160.0, "wall_s": 0.4, "shares": [48, 16], "workers": workers}
        for t in range(3)
    ]  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"num_samples": 192, "global_batch": 64, "epochs": 1}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds) + '{"kind": "ro')
    report = write_report(tmp_path)
    assert "    worker 0: 75%, 120 samples/s, 75% / 0% / 25%, ?" in report.summary
    assert "    worker 1: 25%, 40 samples/s, 50% / 25% / 25%, ?" in report.summary
    assert "3 rounds, 192 samples" in report.summary  # the partial last line of a killed run is skipped


def test_a_worker_left_out_confirmed_and_taken_back_is_in_the_summary(tmp_path):
    workers = [{"samples": 64, "compute_s": 0.3, "wait_s": 0.0, "comm_s": 0.1}]
    worker = {"device_name": "CPU", "host": "10.0.0.3"}
    records = [
        {"kind": "round", "time": 100.0 + t, "epoch": 0, "first_step": t, "num_steps": 1, "samples": 64,
         "loss": 1.0, "samples_per_s": 160.0, "wall_s": 0.4, "shares": [64], "workers": workers}
        for t in range(3)
    ] + [
        {"kind": "left_out", "time": 101.0, "worker": worker, "reason": "measured: faster without it"},
        {"kind": "leave_out_confirmed", "time": 102.0, "worker": worker, "reason": "without it 160, with it 90"},
        {"kind": "readmitted", "time": 102.5, "worker": worker, "reason": "taking it back"},
    ]  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"num_samples": 192, "global_batch": 64, "epochs": 1}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_report(tmp_path).summary
    assert "  left out CPU on 10.0.0.3: measured: faster without it" in summary
    assert "  leaving out CPU on 10.0.0.3 confirmed: without it 160, with it 90" in summary
    assert "  took back CPU on 10.0.0.3: taking it back" in summary


def _a_run(run_dir):
    workers = [{"samples": 64, "compute_s": 0.3, "wait_s": 0.0, "comm_s": 0.1}]
    rounds = [
        {"kind": "round", "time": 100.0 + t, "epoch": 0, "first_step": t, "num_steps": 1, "samples": 64,
         "loss": 1.0, "samples_per_s": 160.0, "wall_s": 0.4, "shares": [64], "workers": workers}
        for t in range(3)
    ]  # fmt: skip
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"num_samples": 192, "global_batch": 64, "epochs": 1}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))


def test_report_never_writes_through_symlinks_planted_in_the_run_folder(tmp_path, capsys):
    # someone else's run folder: its owner planted links to files of whoever runs `mixtrain report` on it
    import os

    from mixtrain.cli.main import main

    run = tmp_path / "theirs"
    _a_run(run)
    victims = {name: tmp_path / f"victim-{name}" for name in ("summary.txt", "loss.png")}
    for victim in victims.values():
        victim.write_text("keep me")
    (run / "report").mkdir()
    for name, victim in victims.items():
        (run / "report" / name).symlink_to(victim)
    (run / "report" / "shares.png").symlink_to(tmp_path / "not-there")  # dangling: would be created
    report = write_report(run)
    assert all(victim.read_text() == "keep me" for victim in victims.values())
    assert not (tmp_path / "not-there").exists()
    for name in ("summary.txt", "loss.png", "shares.png", "throughput.png"):
        path = run / "report" / name
        assert path in report.files and not path.is_symlink() and os.stat(path).st_mode & 0o077 == 0

    # report/ itself a link to a folder elsewhere: refused with one line, nothing written there
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for folder in (run / "report", tmp_path / "out"):
        if folder.exists():
            for path in folder.iterdir():
                path.unlink()
            folder.rmdir()
        folder.symlink_to(elsewhere)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / 'report'} is a symlink (to {elsewhere}); refusing" in err, err
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 2
    assert "out is a symlink" in capsys.readouterr().err and list(elsewhere.iterdir()) == []


def test_a_folder_swapped_for_a_symlink_after_it_was_opened_is_not_followed(tmp_path):
    from mixtrain._files import PrivateFolder

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with PrivateFolder(tmp_path / "report") as folder:
        (tmp_path / "report").rename(tmp_path / "moved")  # between the check and the writes
        (tmp_path / "report").symlink_to(elsewhere)
        folder.write("summary.txt", lambda f: f.write(b"text"))
        assert folder.create("worker-0.log", b"log") and not folder.create("worker-0.log", b"again")
    assert list(elsewhere.iterdir()) == []
    assert (tmp_path / "moved" / "summary.txt").read_bytes() == b"text"
    assert (tmp_path / "moved" / "worker-0.log").read_bytes() == b"log"


# ---- issue 46: a malformed metrics.jsonl is skipped line by line and counted, never a traceback ---------------------

BAD_LINES = [
    "5",
    '"round"',
    "[1, 2]",
    "{}",
    '{"no_kind": 1}',
    '{"kind": 3}',
    '{"kind": "round"}',
    '{"kind": "round", "time": "soon", "wall_s": 0.4, "samples": 64, "samples_per_s": 1, "loss": 1, "epoch": 0,'
    ' "shares": [64], "workers": [{"samples": 64, "compute_s": 0.3, "wait_s": 0, "comm_s": 0}]}',
    '{"kind": "round", "time": 1, "wall_s": 0.4, "samples": 64, "samples_per_s": 1, "loss": 1, "epoch": 0,'
    ' "shares": [64, 1], "workers": [{"samples": 64, "compute_s": 0.3, "wait_s": 0, "comm_s": 0}]}',
    '{"kind": "round", "time": 1, "wall_s": 0.4, "samples": 64, "samples_per_s": 1, "loss": 1, "epoch": 0,'
    ' "shares": [64], "workers": [{"samples": 64, "compute_s": 0.3, "wait_s": 0, "comm_s": 0,'
    ' "memory_bytes": Infinity}]}',
    '{"kind": "eval", "loss": null, "epoch": 0}',
    '{"kind": "eval", "loss": 1.0, "epoch": -1}',
    '{"kind": "failure", "time": 101, "epoch": 0, "failures": 1, "step": 2, "lost": [{"worker": 5}]}',
    '{"kind": "left_out", "time": 101, "worker": {"device_name": "CPU"}, "reason": "x"}',
    '{"kind": "rejoined", "time": 101, "worker": {"device_name": "CPU", "host": "h"}}',
    "not json at all",
]


def test_each_kind_of_malformed_line_is_skipped_and_counted(tmp_path):
    for i, bad in enumerate(BAD_LINES):
        run_dir = tmp_path / f"run{i}"
        _a_run(run_dir)
        good = (run_dir / "metrics.jsonl").read_text()
        (run_dir / "metrics.jsonl").write_text(bad + "\n" + good)
        summary = write_report(run_dir, tmp_path / f"out{i}").summary
        assert "3 rounds, 192 samples" in summary and summary.endswith("skipped 1 malformed line of metrics.jsonl"), (
            bad,
            summary,
        )


def test_the_report_command_on_a_malformed_file_prints_the_count_not_a_traceback(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    _a_run(tmp_path / "run")
    good = (tmp_path / "run" / "metrics.jsonl").read_text()
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(BAD_LINES) + "\n" + good)
    (tmp_path / "run" / "config.json").write_text('{"num_samples": "many", "strategy": 3}')
    mixtrain = str(Path(sys.executable).parent / "mixtrain")
    proc = subprocess.run([mixtrain, "report", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"skipped {len(BAD_LINES)} malformed lines of metrics.jsonl" in proc.stdout
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(BAD_LINES) + "\n")
    proc = subprocess.run([mixtrain, "report", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    skipped = len(BAD_LINES) - 1  # the last line, not JSON: a run killed mid-write, not counted as malformed
    assert f"no finished round yet ({skipped} malformed lines skipped)" in proc.stderr
