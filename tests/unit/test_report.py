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
