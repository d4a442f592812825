"""Link-limited comparison: all-reduce vs local SGD between two real hosts over a slow link.

Two Linux network namespaces on a bridge are the hosts (needs root); tc shapes each host's
outgoing traffic to 100 Mbit/s and, where the kernel has netem, adds 5 ms of delay each way
(a 10 ms round trip, a busy Wi-Fi). Without netem (`Specified qdisc kind is unknown`: the
sch_netem module is missing) a token bucket (tbf) limits the rate alone and says so.
`mixtrain cluster up` runs on one, `cluster join` on the other, and the digits job trains with
one worker per host (STRICT_SPREAD) for each strategy in turn. Reported: wall seconds from the
first step to the first held-out evaluation at the target accuracy (evaluations run at epoch
ends), samples/s, bytes sent per worker, final accuracy.

`--workload chars` is the communication-bound case instead: a 6.4M-parameter character transformer
(8 blocks of width 256, 32 characters of context, global batch 16) on Python's documentation, where
one fp32 exchange (25 MB) takes several times a step's compute even at 100 Mbit/s; its figures are
held-out loss (seconds to `--target`, and the last evaluation after the same samples).

Command lines:
    sudo .venv/bin/python benchmarks/slow_link.py                       # all-reduce vs local-sgd H=8
    sudo .venv/bin/python benchmarks/slow_link.py --strategies allreduce,local-sgd:8,local-sgd:8+bf16 \\
        --rate 100mbit --delay 5ms --target 0.95
    sudo .venv/bin/python benchmarks/slow_link.py --workload chars --rate 20mbit --target 2.6 \\
        --strategies alone,allreduce,allreduce+bf16,local-sgd:16,local-sgd:16+int8+overlap,local-sgd:16+int4+overlap
    sudo .venv/bin/python benchmarks/slow_link.py --workload chars --emulate 1:3 ...   # a 3x slower 2nd host
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.multihost import netns  # noqa: E402  (the namespaces the multi-host tests use)

BIN = os.path.dirname(sys.executable)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(MIXTRAIN_HOME=str(home), PYTHONPATH=str(REPO), PATH=f"{BIN}:{env.get('PATH', '')}")
    env.update(RAY_USAGE_STATS_ENABLED="0", MIXTRAIN_RENDEZVOUS_TIMEOUT_S="60")
    return env


def _run(host: netns.Host, argv: list[str], home: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(host.cmd(*argv), capture_output=True, text=True, timeout=timeout, env=_env(home), cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed:\n{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}")
    return proc


def _strategy(spec: str) -> dict:
    """allreduce, allreduce+bf16, local-sgd:8, local-sgd:8+bf16 (or +int8, +int4), local-sgd:8+int8+overlap,
    local-sgd:8+outer=1/0 (the outer lr and momentum), local-sgd:8+int4+overlap+paced (per-device pace), ps,
    ps-async:2, local-sgd:8+int4+overlap+round=64 (RunConfig.steps_per_round); "alone" is one worker on one host
    (the fast machine alone); "alone:8" the same at a global batch of 8. Returns StrategyConfig's keywords, the
    `ps` and `local_sgd` sections as dicts of PSConfig's and LocalSGDConfig's, and steps_per_round."""
    body, *flags = spec.split("+")
    name, _, number = body.partition(":")
    ps: dict = {}
    local_sgd: dict = {}
    out: dict = {"name": name, "compress": "none", "ps": ps, "local_sgd": local_sgd}
    for flag in flags:
        if flag == "overlap":
            local_sgd["overlap"] = True
        elif flag == "paced":
            local_sgd["pace"] = "per-device"
        elif flag.startswith("round="):
            out["steps_per_round"] = int(flag.removeprefix("round="))
        elif flag.startswith("outer="):
            lr, momentum = flag.removeprefix("outer=").split("/")
            local_sgd.update(outer_lr=float(lr), outer_momentum=float(momentum))
        else:
            out["compress"] = flag
    if number and name == "local-sgd":
        local_sgd["local_steps"] = int(number)
    elif number:
        ps["staleness"] = int(number)
    return out


CHARS_CONTEXT, CHARS_LAYERS, CHARS_MAX_CHARS = 32, 8, 60_000
CHARS_WIDTH = {"chars": 256, "chars-large": 512}
"""Model width per workload: 6.4M parameters at 256, 25.3M at 512 (8 blocks each)."""


def _chars_task(vocab: int, width: int = CHARS_WIDTH["chars"]):
    import torch

    from mixtrain import Task
    from mixtrain.examples.chars import CharTransformer, next_char_loss

    model = CharTransformer(vocab, context=CHARS_CONTEXT, width=width, layers=CHARS_LAYERS, heads=4)
    return Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=next_char_loss)


def _chars_windows(part: str):
    import numpy as np

    from mixtrain.data import TokenWindows
    from mixtrain.examples.chars import token_file

    return TokenWindows(token_file(part, CHARS_MAX_CHARS), CHARS_CONTEXT, np.uint16)


def chars_job(workload: str = "chars"):
    """The communication-bound workload: 6.4M parameters (chars-large: 25.3M), a step of 16 windows of 32
    characters."""
    import functools

    from mixtrain.examples.chars import encode, python_docs_text
    from mixtrain.job import Job

    _, alphabet = encode(python_docs_text()[:CHARS_MAX_CHARS])
    train, held = (functools.partial(_chars_windows, part) for part in ("train", "held"))
    task = functools.partial(_chars_task, len(alphabet), CHARS_WIDTH[workload])
    return Job(task, train, held, global_batch=16)


def workload_job(workload: str):
    """The job a --workload names: digits (the example), chars or chars-large."""
    if workload.startswith("chars"):
        return chars_job(workload)
    from mixtrain.examples.digits import example

    return example()


def num_params(workload: str) -> int:
    """Parameters of the workload's model (what one fp32 exchange carries, 4 bytes each)."""
    task = workload_job(workload).task_factory()
    return sum(p.numel() for p in task.model.parameters())


def drive(
    address: str, spec: str, out: Path, epochs: int, workload: str, emulate: str | None, max_seconds: float | None
) -> None:
    """In the head's namespace: train the workload with one worker per host and write the figures."""
    from mixtrain import LocalSGDConfig, PSConfig, RunConfig, ScalingConfig, StrategyConfig, Trainer
    from mixtrain.cluster.headnode import use_cluster_token

    use_cluster_token(address)
    ex = workload_job(workload)
    name, _, batch = spec.partition(":")  # alone:8 - one worker alone at a global batch of 8 (a ceiling half)
    alone = name == "alone"
    slowdown = {int(r): float(f) for r, f in (emulate.split(":"),)} if emulate and not alone else None
    run_dir = out / re.sub(r"[^\w.-]", "_", spec)
    strategy = _strategy("allreduce" if alone else spec)
    steps_per_round = strategy.pop("steps_per_round", None)
    sections = {"ps": PSConfig(**strategy.pop("ps")), "local_sgd": LocalSGDConfig(**strategy.pop("local_sgd"))}
    trainer = Trainer(
        ex.task_factory,
        ex.train_data,
        eval_data=ex.eval_data,
        global_batch=int(batch) if alone and batch else ex.global_batch,
        scaling=ScalingConfig(
            num_workers=1 if alone else 2,
            shares="auto" if slowdown else "equal",  # a slower host gets a smaller share
            emulate_slowdown=slowdown,
            placement_strategy="STRICT_SPREAD",
            address=address,
            leave_out_slow=False,
        ),
        run=RunConfig(run_dir=str(run_dir), progress=False, checkpoint_every_s=3600, steps_per_round=steps_per_round),
        strategy=StrategyConfig(**strategy, **sections),
    )
    import signal
    import threading

    from mixtrain.driver.interrupt import TrainingInterrupted

    # a row that would take too long is stopped as Ctrl-C stops it: at a round boundary, with a checkpoint
    # counted from the first step (the run's plan record), not from start-up: `auto` on a slow link spends
    # minutes measuring exchanges before it, and an interrupt there is not a round boundary
    done = threading.Event()

    def stop_later() -> None:
        log = run_dir / "metrics.jsonl"
        while not done.wait(0.5):
            if log.exists() and '"kind": "plan"' in log.read_text():
                if not done.wait(max_seconds or 1e9):
                    os.kill(os.getpid(), signal.SIGINT)
                return

    threading.Thread(target=stop_later, daemon=True).start()
    try:
        trainer.fit(epochs=epochs)
        stopped = False
    except TrainingInterrupted:
        stopped = True
    done.set()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(r["time"] for r in records if r["kind"] == "plan")
    rounds = [r for r in records if r["kind"] == "round"]
    evals = [
        {"t": r["time"] - start, "accuracy": r.get("accuracy"), "loss": r["loss"], "epoch": r["epoch"]}
        for r in records
        if r["kind"] == "eval"
    ]
    (out / "result.json").write_text(
        json.dumps(
            {
                "strategy": spec,
                "evals": evals,
                "samples_per_s": sum(r["samples"] for r in rounds) / sum(r["wall_s"] for r in rounds),
                "samples": sum(r["samples"] for r in rounds),
                "rounds": [{"end": r["time"], "wall_s": r["wall_s"], "samples": r["samples"]} for r in rounds],
                "sent_mb_per_worker": sum(w["sent_bytes"] for r in rounds for w in r["workers"])
                / (1 if alone else 2)
                / 2**20,
                "stopped_after_s": max_seconds if stopped else None,
                "hosts": sorted(w["host"] for r in records if r["kind"] == "workers" for w in r["workers"]),
                "advice": json.loads((run_dir / "config.json").read_text())["strategy_advice"],
            }
        )
    )


def _final(result: dict, metric: str) -> str:
    """The last held-out figure, and how a row that was stopped early ended."""
    last = f"{result['evals'][-1][metric]:.4f}" if result["evals"] else "no evaluation"
    if result.get("stopped_after_s"):
        last += f" (stopped after {result['stopped_after_s']:.0f} s)"
    return last


def rate_mbit(rate: str) -> float:
    """tc's rate text (5mbit, 1gbit, 500kbit) in Mbit/s."""
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"--rates item {rate!r}: use tc's form, e.g. 5mbit, 100mbit, 1gbit")
    return float(m.group(1)) * {"k": 1e-3, "m": 1.0, "g": 1e3, "": 1e-6}[m.group(2)]


def _shape(net: netns.Network, rate: str, delay: str) -> str:
    """Shape each host's outgoing traffic (so both directions are): netem with rate and delay, or a
    token bucket with the rate alone where this kernel has no netem. Replaces what was set before, so one
    cluster serves every rate of a sweep. Returns what was set."""
    link = f"{rate} with {delay} of delay each way (netem)"
    for i, host in enumerate(net.hosts):
        dev = ["tc", "qdisc", "replace", "dev", net.interface(i), "root"]
        netem = subprocess.run(host.cmd(*dev, "netem", "rate", rate, "delay", delay), capture_output=True, text=True)
        if netem.returncode != 0:
            # a burst of at least one timer tick's bytes at high rates, else tbf cannot reach the rate
            burst = max(64, int(rate_mbit(rate) * 1e6 / 8 / 250 / 1024))
            subprocess.run(host.cmd(*dev, "tbf", "rate", rate, "burst", f"{burst}kb", "latency", "100ms"), check=True)
            link = f"{rate} (tbf; no added delay: this kernel has no netem: {netem.stderr.strip()})"
    return link


def advisor_local_steps(spec: str, rate: str, params: int, compute_s: float) -> str:
    """`local-sgd:adv+int4+overlap` -> the H the advisor (policies/advice.py) gives for that wire at this rate:
    one exchange of `params` values over the link against `compute_s` of compute per step."""
    body, *flags = spec.split("+")
    if body != "local-sgd:adv":
        return spec
    from mixtrain.policies.advice import WIRE_BYTES, overlap_local_steps

    wire = next((f for f in flags if f in WIRE_BYTES), "none")
    exchange_s = params * WIRE_BYTES[wire] * 8 / (rate_mbit(rate) * 1e6)
    return "+".join([f"local-sgd:{overlap_local_steps(compute_s, exchange_s)}", *flags])


def _in_window(result: dict, start: float, end: float) -> float:
    """samples/s over the rounds that ran wholly inside [start, end]."""
    inside = [r for r in result["rounds"] if r["end"] - r["wall_s"] >= start and r["end"] <= end]
    wall = sum(r["wall_s"] for r in inside)
    return sum(r["samples"] for r in inside) / wall if wall else 0.0


def ceiling(head: netns.Host, home: Path, drive_argv: list[str], out: Path, batch: int | None = None) -> dict:
    """The machine's own ceiling: two `alone` runs started together, each one worker on a host of its own (the
    cluster has one CPU per host, so the second lands where the first is not), training their own replicas with
    no exchange at all. samples/s is the sum of both over the window where both trained.
    `batch`: each half's global batch. The ceiling proper (H = infinity: the pair's two workers, each stepping on
    its share of the equal split, never exchanging) is half the job's batch; None (`ceiling-full`) gives each half
    the whole batch, fewer optimizer steps per sample than any split of it can take: an upper bound."""
    spec = f"alone:{batch}" if batch else "alone"
    runs = []
    for side in "ab":
        (out / side).mkdir()
        argv = [*drive_argv, spec, str(out / side)]
        runs.append(subprocess.Popen(head.cmd(*argv), env=_env(home), cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True))  # fmt: skip
    for run in runs:
        _, err = run.communicate(timeout=3600)
        if run.returncode != 0:
            raise RuntimeError(f"ceiling half failed:\n{err[-3000:]}")
    a, b = (json.loads((out / side / "result.json").read_text()) for side in "ab")
    if a["hosts"] == b["hosts"]:
        raise RuntimeError(f"ceiling: both halves ran on {a['hosts']}; they must run on a host each")
    start = max(r["rounds"][0]["end"] - r["rounds"][0]["wall_s"] for r in (a, b))
    end = min(r["rounds"][-1]["end"] for r in (a, b))
    halves = [_in_window(r, start, end) for r in (a, b)]
    return {
        **a,
        "strategy": "ceiling" if batch else "ceiling-full",
        "samples_per_s": sum(halves),
        "halves_samples_per_s": halves,
        "together_s": end - start,
        "samples": a["samples"] + b["samples"],
        "sent_mb_per_worker": 0.0,
        "hosts": a["hosts"] + b["hosts"],
        "evals_b": b["evals"],
    }


def _measured_compute_s(results: list[dict]) -> float:
    """A step's compute as the latest pair row's start-up measured it (what the advisor itself sees); before
    any, the global batch over the ceiling's samples/s."""
    for r in reversed(results):
        m = re.search(r"against ([\d,.]+) ms of compute per step", r.get("advice", ""))
        if m:
            return float(m.group(1).replace(",", "")) / 1e3
    ceil = _mean(results, "ceiling")
    return 16 / ceil if ceil else 0.1


def _mean(results: list[dict], spec: str, key: str = "samples_per_s") -> float | None:
    values = [r[key] for r in results if r["strategy"] == spec and not r.get("skipped")]
    return sum(values) / len(values) if values else None


def summary(results: list[dict], metric: str) -> None:
    """One table: each row's samples/s as a fraction of the ceiling and against one worker alone (both the mean
    of their runs in this sweep), and its last held-out figure after how many samples."""
    ceil, full, alone = (_mean(results, spec) for spec in ("ceiling", "ceiling-full", "alone"))
    print(f"ceiling (two workers on their halves of the batch, no exchange) {ceil or 0:,.1f} samples/s; "
          f"each on the whole batch {full or 0:,.1f}; one worker alone {alone or 0:,.1f}")  # fmt: skip
    head = "| Mbit/s | RTT ms | row | samples/s | of ceiling | of full-batch ceiling | vs alone | MB sent per worker "
    print(head + f"| held-out {metric} |\n|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        where = f"| {r['rate_mbit']:g} | {r.get('rtt_ms', 0):g} | {r['strategy']} |"
        if r.get("skipped"):
            print(f"{where} - | - | - | - | - | not run: {r['skipped']} |")
            continue
        of_ceiling, of_full = (f"{r['samples_per_s'] / c:.2f}" if c else "-" for c in (ceil, full))
        vs_alone = f"{r['samples_per_s'] / alone:.2f}x" if alone else "-"
        print(f"{where} {r['samples_per_s']:,.1f} | {of_ceiling} | {of_full} | {vs_alone} "
              f"| {r['sent_mb_per_worker']:,.1f} | {_final(r, metric)} ({r['samples']:,} samples) |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="allreduce,local-sgd:8")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--rates", help="a sweep, e.g. 1gbit,100mbit,20mbit: every row at each rate (one cluster)")
    parser.add_argument(
        "--yardsticks",
        default="",
        help="rows run at the sweep's first and last rate only, e.g. ceiling,alone (they send nothing); "
        "ceiling-full: the ceiling's two halves each on the whole batch",
    )
    parser.add_argument("--delay", default="5ms", help="netem's delay each way, where the kernel has netem")
    parser.add_argument(
        "--rtts-ms",
        default="0",
        help="round trips to add at every rate, e.g. 0,10,50: a delay line of half that each way between the hosts "
        "(tests/multihost/delay_line.py; this kernel has no netem)",
    )
    parser.add_argument("--workload", choices=("digits", "chars", "chars-large"), default="digits")
    parser.add_argument(
        "--target", type=float, help="held-out accuracy to reach (digits, default 0.95) or loss (chars, default 2.6)"
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--emulate", help="RANK:FACTOR, e.g. 1:3: the second host computes 3x slower (emulated)")
    parser.add_argument(
        "--max-seconds", type=float, help="stop a row after this long (at a round boundary, as Ctrl-C does)"
    )
    parser.add_argument(
        "--max-step-exchange-s",
        type=float,
        help="skip all-reduce rows whose one fp32/bf16 exchange per step would take longer than this at the rate",
    )
    parser.add_argument(
        "--compute-s",
        type=float,
        help="a step's compute for local-sgd:adv rows; default: the global batch over the ceiling's samples/s",
    )
    parser.add_argument("--json", default="bench_results/slow_link.json")
    parser.add_argument("--drive", nargs=3, metavar=("ADDRESS", "STRATEGY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        drive(*args.drive[:2], Path(args.drive[2]), args.epochs, args.workload, args.emulate, args.max_seconds)
        return
    metric = "loss" if args.workload.startswith("chars") else "accuracy"
    target = args.target if args.target is not None else (2.6 if metric == "loss" else 0.95)
    if netns.available() is not None:
        sys.exit(f"slow_link: {netns.available()}")
    rates = (args.rates or args.rate).split(",")
    params = num_params(args.workload)
    tag = str(os.getpid() % 10000)
    tmp = Path(tempfile.mkdtemp(prefix="mt-slowlink-"))
    homes = {"head": tmp / "head", "other": tmp / "other"}
    mixtrain = os.path.join(BIN, "mixtrain")
    results: list[dict] = []
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with netns.Network(tag, 2, subnet=78) as net:
        head, other = net.hosts
        try:
            up = _run(head, [mixtrain, "cluster", "up", "--interface", net.interface(0), "--num-cpus", "1",
                             "--temp-dir", f"/tmp/mt{tag}a"], homes["head"])  # fmt: skip
            address = f"{head.ip}:6379"
            assert "a call without the token was refused" in up.stdout, up.stdout
            token_file = str(homes["head"] / "auth_token")  # as scp would bring it to the other machine
            _run(other, [mixtrain, "cluster", "join", address, "--token-file", token_file, "--num-cpus", "1",
                         "--temp-dir", f"/tmp/mt{tag}b"], homes["other"])  # fmt: skip
            yardsticks = [s for s in args.yardsticks.split(",") if s]
            links = [(rate, float(rtt)) for rate in rates for rtt in args.rtts_ms.split(",")]
            for k, (rate, rtt_ms) in enumerate(links):
                link = _shape(net, rate, args.delay) + (
                    f", {rtt_ms:g} ms round trip added (delay line)" if rtt_ms else ""
                )
                print(f"link: {link}", flush=True)
                rows = args.strategies.split(",")
                rows = (yardsticks if k == 0 else []) + rows + (yardsticks if k == len(links) - 1 and k else [])
                with net.delayed(rtt_ms / 2):  # connections made from here on see the round trip from the start
                    for asked in rows:
                        compute_s = args.compute_s or _measured_compute_s(results)
                        spec = advisor_local_steps(asked, rate, params, compute_s)
                        out = tmp / f"out-{len(results)}"
                        res = _row(spec, rate, params, args, head, homes["head"], address, out)
                        res.update(asked=asked, rate=rate, rate_mbit=rate_mbit(rate), rtt_ms=rtt_ms, link=link)
                        res.update(load=os.getloadavg())
                        results.append(res)
                        Path(args.json).write_text(json.dumps(results, indent=1))
                        _print_row(res, metric, target)
        finally:
            for host, name in ((other, "other"), (head, "head")):
                subprocess.run(host.cmd(mixtrain, "cluster", "down"), env=_env(homes[name]), capture_output=True)
            for side in "ab":
                shutil.rmtree(f"/tmp/mt{tag}{side}", ignore_errors=True)
    print(f"{args.workload}, {params / 1e6:.1f}M parameters" + (f"; emulated {args.emulate}" if args.emulate else ""))
    summary(results, metric)


def _row(spec: str, rate: str, params: int, args: argparse.Namespace, head: netns.Host, home: Path, address: str,
         out: Path) -> dict:  # fmt: skip
    """One row at the link's current rate: run it (or say why not), with seconds to the target filled in."""
    if spec.startswith("allreduce") and args.max_step_exchange_s:
        wire = 2 if "bf16" in spec else 4
        exchange_s = params * wire * 8 / (rate_mbit(rate) * 1e6)
        if exchange_s > args.max_step_exchange_s:
            why = f"one exchange per step would take {exchange_s:.1f} s (at most {16 / exchange_s:.2f} samples/s)"
            return {"strategy": spec, "skipped": why, "bound_samples_per_s": 16 / exchange_s}
    out.mkdir()
    flags = ["--emulate", args.emulate] if args.emulate else []
    flags += ["--max-seconds", str(args.max_seconds)] if args.max_seconds else []
    drive_argv = [sys.executable, __file__, "--epochs", str(args.epochs), "--workload", args.workload, *flags,
                  "--drive", address]  # fmt: skip
    if spec == "ceiling":
        res = ceiling(head, home, drive_argv, out, workload_job(args.workload).global_batch // 2)
    elif spec == "ceiling-full":
        res = ceiling(head, home, drive_argv, out)
    else:
        _run(head, [*drive_argv, spec, str(out)], home, timeout=3600)
        res = json.loads((out / "result.json").read_text())
    return res


def _print_row(res: dict, metric: str, target: float) -> None:
    if res.get("skipped"):
        print(f"  {res['strategy']:28s} at {res['rate']}: not run: {res['skipped']}", flush=True)
        return
    better = (lambda v: v <= target) if metric == "loss" else (lambda v: v >= target)
    res["seconds_to_target"] = next((e["t"] for e in res["evals"] if better(e[metric])), None)
    print(
        f"  {res['strategy']:28s} at {res['rate']}, +{res.get('rtt_ms', 0):g} ms: "
        f"{res['samples_per_s']:,.1f} samples/s, {res['samples']:,} samples, "
        f"final {metric} {_final(res, metric)}, {res['sent_mb_per_worker']:,.1f} MB sent per worker, "
        f"hosts {res['hosts']}, load {res['load'][0]:.2f}\n    measured: {res['advice']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
