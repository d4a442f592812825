"""The learning rate in the round records: what the optimizer holds after a round, per param group, from rank 0's
report into the record (metrics.jsonl, Result.history) and the report's summary. No Ray: the worker's reading and
the driver's summary, each on its own (tests/ray/test_faults.py checks a real run's rates against its schedule)."""

import json

import torch

from mixtrain.comm.strategy import RoundSync
from mixtrain.observe.report import write_report
from mixtrain.records.messages import RoundPlan, WorkerReport
from mixtrain.records.rounds import summarize_round
from mixtrain.worker.ledger import RoundLedger, learning_rates

PLAN = RoundPlan(epoch=0, first_step=0, num_steps=2, shares=(10, 10), global_batch=20, drift_tolerance=1e-6)


def test_the_rates_are_the_param_groups_after_the_schedulers_step():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": a.parameters()}, {"params": b.parameters(), "lr": torch.tensor(0.01)}], lr=0.1)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for _ in range(3):
        opt.step()
        schedule.step()
    assert learning_rates(opt) == [float(opt.param_groups[0]["lr"]), float(opt.param_groups[1]["lr"])]
    assert learning_rates(opt) == schedule.get_last_lr()  # CosineAnnealingLR's closed form, step 3 of 10
    assert all(isinstance(x, float) for x in learning_rates(opt))


def test_a_round_record_carries_rank_0s_rates_into_its_dict():
    ledger = RoundLedger(rank=0)
    report = ledger.close(PLAN, RoundSync(0.0, False, 0.0), None, {}, [0.05, 0.005])
    assert report.lr == [0.05, 0.005]
    report.losses, report.compute_s, report.comm_s, report.samples = [1.0, 0.5], [0.1, 0.1], [0.0, 0.0], 10
    other = WorkerReport(rank=1, samples=10, compute_s=[0.1, 0.1], comm_s=[0.0, 0.0], losses=[1.0, 0.5], lr=[9.0])
    record = summarize_round(PLAN, [other, report], wall_s=1.0)
    assert record.lr == [0.05, 0.005]
    assert json.loads(json.dumps(record.as_dict()))["lr"] == [0.05, 0.005]  # its line in metrics.jsonl
    survivors = summarize_round(PLAN, [WorkerReport(rank=1, compute_s=[0.1], comm_s=[0.0], losses=[1.0])], 1.0, (1, 10))
    assert survivors.lr == []  # a round cut short reports no rate


def test_the_report_shows_the_first_and_last_rounds_rates(tmp_path):
    workers = [{"samples": 64, "compute_s": 0.3, "wait_s": 0.0, "comm_s": 0.1}]
    rounds = [
        {"kind": "round", "time": 100.0 + t, "epoch": 0, "first_step": t, "num_steps": 1, "samples": 64,
         "loss": 1.0, "samples_per_s": 160.0, "wall_s": 0.4, "shares": [64], "workers": workers,
         "lr": [0.1 * 0.5**t, 0.01]}
        for t in range(3)
    ]  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"num_samples": 192, "global_batch": 64, "epochs": 1}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    summary = write_report(tmp_path).summary
    assert "  learning rate [0.1, 0.01] (after the first round) -> [0.025, 0.01]" in summary
