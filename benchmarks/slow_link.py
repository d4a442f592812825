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
    ps-async:2; "alone" is one worker on one host (the
    fast machine alone)."""
    body, *flags = spec.split("+")
    name, _, number = body.partition(":")
    out: dict = {"name": name, "compress": "none"}
    for flag in flags:
        if flag == "overlap":
            out["overlap"] = True
        elif flag == "paced":
            out["pace"] = "per-device"
        elif flag.startswith("outer="):
            lr, momentum = flag.removeprefix("outer=").split("/")
            out.update(outer_lr=float(lr), outer_momentum=float(momentum))
        else:
            out["compress"] = flag
    if number:
        out["local_steps" if name == "local-sgd" else "staleness"] = int(number)
    return out


CHARS_CONTEXT, CHARS_WIDTH, CHARS_LAYERS, CHARS_MAX_CHARS = 32, 256, 8, 60_000


def _chars_task(vocab: int):
    import torch

    from mixtrain import Task
    from mixtrain.examples.chars import CharTransformer, next_char_loss

    model = CharTransformer(vocab, context=CHARS_CONTEXT, width=CHARS_WIDTH, layers=CHARS_LAYERS, heads=4)
    return Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=next_char_loss)


def _chars_windows(part: str):
    import numpy as np

    from mixtrain.data import TokenWindows
    from mixtrain.examples.chars import token_file

    return TokenWindows(token_file(part, CHARS_MAX_CHARS), CHARS_CONTEXT, np.uint16)


def chars_job():
    """The communication-bound workload: 6.4M parameters, a step of 16 windows of 32 characters."""
    import functools

    from mixtrain.examples.chars import encode, python_docs_text
    from mixtrain.job import Job

    _, alphabet = encode(python_docs_text()[:CHARS_MAX_CHARS])
    train, held = (functools.partial(_chars_windows, part) for part in ("train", "held"))
    return Job(functools.partial(_chars_task, len(alphabet)), train, held, global_batch=16)


def drive(
    address: str, spec: str, out: Path, epochs: int, workload: str, emulate: str | None, max_seconds: float | None
) -> None:
    """In the head's namespace: train the workload with one worker per host and write the figures."""
    from mixtrain import RunConfig, ScalingConfig, StrategyConfig, Trainer
    from mixtrain.cluster.headnode import use_cluster_token
    from mixtrain.examples.digits import example

    use_cluster_token(address)
    ex = chars_job() if workload == "chars" else example()
    slowdown = {int(r): float(f) for r, f in (emulate.split(":"),)} if emulate and spec != "alone" else None
    run_dir = out / re.sub(r"[^\w.-]", "_", spec)
    trainer = Trainer(
        ex.task_factory,
        ex.train_data,
        eval_data=ex.eval_data,
        global_batch=ex.global_batch,
        scaling=ScalingConfig(
            num_workers=1 if spec == "alone" else 2,
            shares="auto" if slowdown else "equal",  # a slower host gets a smaller share
            emulate_slowdown=slowdown,
            placement_strategy="STRICT_SPREAD",
            address=address,
            leave_out_slow=False,
        ),
        run=RunConfig(run_dir=str(run_dir), progress=False, checkpoint_every_s=3600),
        strategy=StrategyConfig(**_strategy("allreduce" if spec == "alone" else spec)),
    )
    import signal
    import threading

    from mixtrain.core.interrupt import TrainingInterrupted

    # a row that would take too long is stopped as Ctrl-C stops it: at a round boundary, with a checkpoint
    timer = threading.Timer(max_seconds or 1e9, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.daemon = True
    timer.start()
    try:
        trainer.fit(epochs=epochs)
        stopped = False
    except TrainingInterrupted:
        stopped = True
    timer.cancel()
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
                "sent_mb_per_worker": sum(w["sent_bytes"] for r in rounds for w in r["workers"])
                / (1 if spec == "alone" else 2)
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


def _shape(net: netns.Network, rate: str, delay: str) -> str:
    """Shape each host's outgoing traffic (so both directions are): netem with rate and delay, or a
    token bucket with the rate alone where this kernel has no netem. Returns what was set."""
    link = f"{rate} with {delay} of delay each way (netem)"
    for i, host in enumerate(net.hosts):
        dev = ["tc", "qdisc", "add", "dev", net.interface(i), "root"]
        netem = subprocess.run(host.cmd(*dev, "netem", "rate", rate, "delay", delay), capture_output=True, text=True)
        if netem.returncode != 0:
            subprocess.run(host.cmd(*dev, "tbf", "rate", rate, "burst", "64kb", "latency", "100ms"), check=True)
            link = f"{rate} (tbf; no added delay: this kernel has no netem: {netem.stderr.strip()})"
    return link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="allreduce,local-sgd:8")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay", default="5ms")
    parser.add_argument("--workload", choices=("digits", "chars"), default="digits")
    parser.add_argument(
        "--target", type=float, help="held-out accuracy to reach (digits, default 0.95) or loss (chars, default 2.6)"
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--emulate", help="RANK:FACTOR, e.g. 1:3: the second host computes 3x slower (emulated)")
    parser.add_argument(
        "--max-seconds", type=float, help="stop a row after this long (at a round boundary, as Ctrl-C does)"
    )
    parser.add_argument("--json", default="bench_results/slow_link.json")
    parser.add_argument("--drive", nargs=3, metavar=("ADDRESS", "STRATEGY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        drive(*args.drive[:2], Path(args.drive[2]), args.epochs, args.workload, args.emulate, args.max_seconds)
        return
    metric = "loss" if args.workload == "chars" else "accuracy"
    target = args.target if args.target is not None else (2.6 if metric == "loss" else 0.95)
    if netns.available() is not None:
        sys.exit(f"slow_link: {netns.available()}")
    tag = str(os.getpid() % 10000)
    tmp = Path(tempfile.mkdtemp(prefix="mt-slowlink-"))
    homes = {"head": tmp / "head", "other": tmp / "other"}
    mixtrain = os.path.join(BIN, "mixtrain")
    results = []
    with netns.Network(tag, 2, subnet=78) as net:
        head, other = net.hosts
        link = _shape(net, args.rate, args.delay)
        print(f"link: {link}", flush=True)
        try:
            up = _run(head, [mixtrain, "cluster", "up", "--interface", net.interface(0), "--num-cpus", "1",
                             "--temp-dir", f"/tmp/mt{tag}a"], homes["head"])  # fmt: skip
            address = f"{head.ip}:6379"
            assert "a call without the token was refused" in up.stdout, up.stdout
            token_file = str(homes["head"] / "auth_token")  # as scp would bring it to the other machine
            _run(other, [mixtrain, "cluster", "join", address, "--token-file", token_file, "--num-cpus", "1",
                         "--temp-dir", f"/tmp/mt{tag}b"], homes["other"])  # fmt: skip
            for spec in args.strategies.split(","):
                out = tmp / f"out-{len(results)}"
                out.mkdir()
                emulate = ["--emulate", args.emulate] if args.emulate else []
                emulate += ["--max-seconds", str(args.max_seconds)] if args.max_seconds else []
                cmd = [sys.executable, __file__, "--epochs", str(args.epochs), "--workload", args.workload,
                       *emulate, "--drive", address, spec, str(out)]  # fmt: skip
                _run(head, cmd, homes["head"], timeout=3600)
                res = json.loads((out / "result.json").read_text())
                better = (lambda v: v <= target) if metric == "loss" else (lambda v: v >= target)
                reached = next((e["t"] for e in res["evals"] if better(e[metric])), None)
                res["seconds_to_target"] = reached
                results.append(res)
                print(
                    f"  {spec:20s} to {metric} {target:.2f}: {reached if reached is None else round(reached, 1)} s, "
                    f"{res['samples_per_s']:,.0f} samples/s, final {metric} {_final(res, metric)}, "
                    f"{res['sent_mb_per_worker']:,.1f} MB sent per worker, hosts {res['hosts']}\n"
                    f"    measured: {res['advice']}",
                    flush=True,
                )
        finally:
            for host, name in ((other, "other"), (head, "head")):
                subprocess.run(host.cmd(mixtrain, "cluster", "down"), env=_env(homes[name]), capture_output=True)
            for side in "ab":
                shutil.rmtree(f"/tmp/mt{tag}{side}", ignore_errors=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    base = results[0].get("seconds_to_target")
    print(f"link: {link}" + (f"; emulated slowdown {args.emulate}" if args.emulate else ""))
    first = results[0]["strategy"]
    print(f"| strategy | seconds to held-out {metric} {target:.2f} | speed-up vs {first} | samples/s "
          f"| MB sent per worker | final held-out {metric} |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        t = r["seconds_to_target"]
        ratio = f"{base / t:.2f}x" if base and t else "-"
        shown = f"{t:.1f}" if t is not None else "not reached"
        print(f"| {r['strategy']} | {shown} | {ratio} | {r['samples_per_s']:,.0f} | {r['sent_mb_per_worker']:,.1f} "
              f"| {_final(r, metric)} |")  # fmt: skip


if __name__ == "__main__":
    main()
