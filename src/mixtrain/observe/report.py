"""`mixtrain report RUN_DIR`: PNG plots and a short text summary of a run, from its metrics.jsonl.

loss.png        training loss and held-out loss vs. samples seen; held-out accuracy vs. samples seen
throughput.png  samples/s per device over time (and the job's total), with failures and leave-outs marked
shares.png      each device's share of the global batch over time
summary.txt     the run in a few lines
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from mixtrain._files import PrivateFolder, RunFolder
from mixtrain.callbacks import EVAL_KEYS
from mixtrain.errors import InputValueError, require
from mixtrain.observe.progress import format_bytes
from mixtrain.observe.record_check import well_formed
from mixtrain.observe.runlog import samples_seen
from mixtrain.records.rounds import device_samples_per_s, time_split, worker_name


@dataclass
class Report:
    files: list[Path]
    summary: str
    panels: dict[str, list[str]] = field(default_factory=dict)
    """Per PNG file name, the titles of its panels."""


def _read_config(folder: RunFolder) -> dict[str, Any]:
    """The run's config.json, or {} (its figures then show as '?') when it is missing or malformed."""
    try:
        config = folder.read_json("config.json")
    except (FileNotFoundError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    for key in ("num_samples", "global_batch"):
        if key in config and not (isinstance(config[key], int) and config[key] >= 0):
            del config[key]
    if not isinstance(config.get("strategy", {}), dict):
        del config["strategy"]
    return config


def read_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config, records, _ = read_run_counted(run_dir)
    return config, records


def read_run_counted(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """config.json ({} when absent or not a JSON object), the well-formed records of metrics.jsonl, and how many
    lines were skipped as malformed (not JSON, or not a record the report can read: record_check.py). A partial
    last line (a run killed mid-write) is not counted."""
    run = Path(run_dir)
    try:  # the run folder's one way: no link followed, no pipe read, a bounded size
        with RunFolder(run) as folder:
            text = folder.read("metrics.jsonl").decode("utf-8", errors="replace")
            config = _read_config(folder)
    except (FileNotFoundError, NotADirectoryError):
        raise InputValueError(f"report {str(run_dir)!r}: no metrics.jsonl there; give the folder a run wrote") from None
    records = []
    skipped = 0
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += n != len(lines)
            continue
        if well_formed(record):
            records.append(record)
        else:
            skipped += 1
    rounds = [r for r in records if r["kind"] == "round"]
    if not rounds:
        bad = f" ({skipped} malformed lines skipped)" if skipped else ""
        raise InputValueError(f"report {str(run_dir)!r}: the run has no finished round yet{bad}; nothing to plot")
    return config, records, skipped


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Report:
    require("matplotlib", "matplotlib", "report", "mixtrain report's plots")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    config, records, skipped = read_run_counted(run_dir)
    size = (int(config.get("num_samples", 0)), int(config.get("global_batch", 1)))
    rounds = [r for r in records if r["kind"] == "round"]
    evals = [r for r in records if r["kind"] == "eval"]
    events = [r for r in records if r["kind"] in ("failure", "left_out", "rejoined", "readmitted")]
    t0 = rounds[0]["time"] - rounds[0]["wall_s"]
    report = Report(files=[], summary="")
    # The run folder may be someone else's: nothing in it is followed (a symlinked report/ is refused, a
    # symlink planted at a file's name is replaced), and every file is written whole or not at all.
    with PrivateFolder(Path(out) if out is not None else Path(run_dir) / "report") as folder:
        _plot_loss(folder, rounds, evals, size, report)
        _plot_throughput(folder, rounds, events, t0, report)
        _plot_shares(folder, rounds, t0, report)
        report.summary = summarize(Path(run_dir), config, records)
        if skipped:
            report.summary += f"\n  skipped {skipped} malformed line{'s' * (skipped > 1)} of metrics.jsonl"
        text = (report.summary + "\n").encode()
        report.files.append(folder.write("summary.txt", lambda f: f.write(text)))
    return report


def _save(fig: Any, folder: PrivateFolder, name: str, report: Report) -> None:
    fig.tight_layout()
    report.files.append(folder.write(name, lambda f: fig.savefig(f, dpi=110, format="png")))
    report.panels[name] = [ax.get_title() for ax in fig.axes if ax.get_title()]
    import matplotlib.pyplot as plt

    plt.close(fig)


def _plot_loss(
    folder: PrivateFolder, rounds: list[dict], evals: list[dict], size: tuple[int, int], report: Report
) -> None:
    import matplotlib.pyplot as plt

    has_acc = any("accuracy" in e for e in evals)
    fig, axes = plt.subplots(1, 2 if has_acc else 1, figsize=(12 if has_acc else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    ax.plot([samples_seen(r, *size) for r in rounds], [r["loss"] for r in rounds], label="training (per round)")
    if evals:
        ax.plot([samples_seen(e, *size) for e in evals], [e["loss"] for e in evals], "o-", label="held-out")
    ax.set(title="Loss vs. samples seen", xlabel="samples seen", ylabel="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if has_acc:
        ax = axes[0][1]
        acc = [(samples_seen(e, *size), e["accuracy"]) for e in evals if "accuracy" in e]
        ax.plot(*zip(*acc), "o-", color="tab:green")
        best = max(acc, key=lambda p: p[1])
        ax.annotate(f"best {best[1]:.4f}", best, textcoords="offset points", xytext=(-8, -16), ha="right")
        ax.set(title="Held-out accuracy vs. samples seen", xlabel="samples seen", ylabel="accuracy")
        ax.grid(alpha=0.3)
    _save(fig, folder, "loss.png", report)


def _per_worker(rounds: list[dict], value: Any) -> dict[str, list[tuple[dict, float]]]:
    """Per worker label (stable when ranks change), (round, value) for the rounds it took part in."""
    series: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for r in rounds:
        for rank, (w, share) in enumerate(zip(r["workers"], r["shares"])):
            series[worker_name(w, rank)].append((r, value(r, w, share)))
    return series


def _segments(points: list[tuple[dict, float]], t0: float) -> tuple[list[float], list[float]]:
    """One flat segment per round, from its start to its end; gaps (evaluation, checkpoints) stay empty."""
    xs: list[float] = []
    ys: list[float] = []
    for r, v in points:
        xs += [r["time"] - r["wall_s"] - t0, r["time"] - t0, float("nan")]
        ys += [v, v, float("nan")]
    return xs, ys


def _legend_right(fig: Any, ax: Any) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _plot_throughput(folder: PrivateFolder, rounds: list[dict], events: list[dict], t0: float, report: Report) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    series = _per_worker(rounds, lambda r, w, _: device_samples_per_s(r, w))
    for i, (name, points) in enumerate(series.items()):  # styles differ: equal speeds would hide each other
        ax.plot(*_segments(points, t0), lw=3, ls=("-", "--", ":", "-.")[i % 4], label=name)
    ax.plot(*_segments([(r, r["samples_per_s"]) for r in rounds], t0), "k", lw=1.2, label="job total")
    ax.set_ylim(0, max(r["samples_per_s"] for r in rounds) * 1.15)
    for e in events:
        what = {"failure": "worker lost", "left_out": "left out", "rejoined": "rejoined", "readmitted": "taken back"}[
            e["kind"]
        ]
        ax.axvline(e["time"] - t0, color="tab:red", ls=":", lw=1)
        ax.annotate(what, (e["time"] - t0, ax.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=8)
    ax.set(
        title="Samples/s per device over time (one segment per round)",
        xlabel="seconds since the first step (gaps: evaluation and checkpoints)",
        ylabel="samples/s",
    )
    ax.grid(alpha=0.3)
    _legend_right(fig, ax)
    _save(fig, folder, "throughput.png", report)


def _plot_shares(folder: PrivateFolder, rounds: list[dict], t0: float, report: Report) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    times = [r["time"] - r["wall_s"] - t0 for r in rounds] + [rounds[-1]["time"] - t0]  # each round's start, the end
    per_round = [{worker_name(w, i): s for i, (w, s) in enumerate(zip(r["workers"], r["shares"]))} for r in rounds]
    names = list(dict.fromkeys(name for shares in per_round for name in shares))
    stacks = []
    for name in names:
        shares = [by_name.get(name, 0) for by_name in per_round]
        stacks.append([*shares, shares[-1]])
    ax.stackplot(times, stacks, labels=names, step="post", alpha=0.85)
    ax.set(
        title="Share of the global batch per device over time",
        xlabel="seconds since the first step",
        ylabel="samples per step",
    )
    ax.set_ylim(0, max(sum(r["shares"]) for r in rounds) * 1.05)
    ax.grid(alpha=0.3)
    _legend_right(fig, ax)
    _save(fig, folder, "shares.png", report)


def summarize(run_dir: Path, config: dict[str, Any], records: list[dict[str, Any]]) -> str:
    rounds = [r for r in records if r["kind"] == "round"]
    evals = [r for r in records if r["kind"] == "eval"]
    size = (int(config.get("num_samples", 0)), int(config.get("global_batch", 1)))
    wall = sum(r["wall_s"] for r in rounds)
    samples = sum(r["samples"] for r in rounds)
    strategy = config.get("strategy", {})
    lines = [
        f"run {run_dir}",
        f"  {len(rounds)} rounds, {samples:,} samples in {wall:.1f} s of training "
        f"({samples / (wall or 1):,.0f} samples/s); "
        f"reached epoch {rounds[-1]['epoch'] + 1} of {config.get('epochs', '?')}, "
        f"{samples_seen(rounds[-1], *size):,} samples seen",
        f"  global batch {config.get('global_batch', '?')}, strategy {strategy.get('name', '?')}, "
        f"backend {config.get('backend', '?')}",
        f"  training loss {rounds[0]['loss']:.4f} (first round) -> {rounds[-1]['loss']:.4f} (last round)",
    ]
    if rounds[0].get("lr") and rounds[-1].get("lr"):  # runs from before the rate was recorded have none
        lines.append(f"  learning rate {_rates(rounds[0]['lr'])} (after the first round) -> {_rates(rounds[-1]['lr'])}")
    if evals:
        lines.append(_eval_line(evals))
    lines.append("  per device (mean over rounds): share, samples/s, busy / waiting / communicating, peak memory")
    lines += _device_lines(rounds)
    lines += [line for r in records if (line := _event_line(r))]
    checkpoints = sum(r["kind"] == "checkpoint" for r in records)
    lines.append(f"  {checkpoints} checkpoints written")
    return "\n".join(lines)


def _rates(lr: list[float]) -> str:
    """One rate per param group: "0.001", or "[0.001, 0.0001]" for several."""
    text = [f"{x:.4g}" for x in lr]
    return text[0] if len(text) == 1 else f"[{', '.join(text)}]"


def _eval_line(evals: list[dict[str, Any]]) -> str:
    last = evals[-1]
    line = f"  held-out loss {last['loss']:.4f}"
    if "accuracy" in last:
        best = max(evals, key=lambda e: e.get("accuracy", 0.0))
        when = f"epoch {best['epoch'] + 1}"
        when = f"step {best['global_step']}, {when}" if "global_step" in best else when
        line += f", accuracy {last['accuracy']:.4f} (best {best['accuracy']:.4f} after {when})"
    own = [k for k, v in last.items() if k not in _EVAL_FIELDS and isinstance(v, (int, float))]
    return line + "".join(f", {k} {last[k]:.4f}" for k in own)


_EVAL_FIELDS = (*EVAL_KEYS, "loss", "accuracy")
"""Fields of an eval record that are not a task's own metric."""


def _device_lines(rounds: list[dict[str, Any]]) -> list[str]:
    """Per device, means over the rounds it was in: share, samples/s, busy/waiting/communicating, peak memory."""
    stats: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rounds:
        total = sum(r["shares"]) or 1
        for rank, (w, share) in enumerate(zip(r["workers"], r["shares"])):
            s = stats[worker_name(w, rank)]
            s["share"].append(share / total)
            s["rate"].append(device_samples_per_s(r, w))
            for key, part in zip(("compute_s", "wait_s", "comm_s"), time_split(w)):
                s[key].append(part)
            if w.get("memory_bytes") is not None:
                s["memory"].append(w["memory_bytes"])
    lines = []
    for name, s in stats.items():
        memory = format_bytes(int(max(s["memory"]))) if s["memory"] else "?"
        n = len(s["share"])
        lines.append(
            f"    {name}: {fmean(s['share']):.0%}, {fmean(s['rate']):,.0f} samples/s, "
            f"{fmean(s['compute_s']):.0%} / {fmean(s['wait_s']):.0%} / {fmean(s['comm_s']):.0%}, {memory}"
            + ("" if n == len(rounds) else f" (in {n} of {len(rounds)} rounds)")
        )
    return lines


def _event_line(r: dict[str, Any]) -> str:
    """A line for a worker left out, lost or rejoined; empty for other records."""
    if r["kind"] == "left_out":
        return f"  left out {r['worker']['device_name']} on {r['worker']['host']}: {r['reason']}"
    if r["kind"] == "failure":
        lost = ", ".join(f"{x['worker']['device_name']} on {x['worker']['host']}" for x in r["lost"])
        return f"  failure {r['failures']} at epoch {r['epoch'] + 1}, step {r['step']}: lost {lost}"
    if r["kind"] == "rejoined":
        return f"  {r['worker']['device_name']} on {r['worker']['host']} rejoined at step {r['step']}"
    if r["kind"] == "readmitted":
        return f"  took back {r['worker']['device_name']} on {r['worker']['host']}: {r['reason']}"
    if r["kind"] == "leave_out_confirmed":
        return f"  leaving out {r['worker']['device_name']} on {r['worker']['host']} confirmed: {r['reason']}"
    return ""
