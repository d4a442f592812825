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
