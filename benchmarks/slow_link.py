"""Link-limited comparison: all-reduce vs local SGD between two real hosts over a slow link.

Two Linux network namespaces on a bridge are the hosts (needs root); tc shapes each host's
outgoing traffic to 100 Mbit/s and, where the kernel has netem, adds 5 ms of delay each way
(a 10 ms round trip, a busy Wi-Fi). Without netem (`Specified qdisc kind is unknown`: the
sch_netem module is missing) a token bucket (tbf) limits the rate alone and says so.
`mixtrain cluster up` runs on one, `cluster join` on the other, and the digits job trains with
one worker per host (STRICT_SPREAD) for each strategy in turn. Reported: wall seconds from the
first step to the first held-out evaluation at the target accuracy (evaluations run at epoch
ends), samples/s, bytes sent per worker, final accuracy.

Command lines:
    sudo .venv/bin/python benchmarks/slow_link.py                       # all-reduce vs local-sgd H=8
    sudo .venv/bin/python benchmarks/slow_link.py --strategies allreduce,local-sgd:8,local-sgd:8+bf16 \\
        --rate 100mbit --delay 5ms --target 0.95
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
    """allreduce, allreduce+bf16, local-sgd:8, local-sgd:8+bf16 (or +int8, +int4), ps, ps-async:2; "alone" is
    one worker on one host (the fast machine alone)."""
    body, _, compress = spec.partition("+")
    name, _, number = body.partition(":")
    out: dict = {"name": name, "compress": compress or "none"}
    if number:
        out["local_steps" if name == "local-sgd" else "staleness"] = int(number)
    return out


def drive(address: str, spec: str, out: Path, epochs: int) -> None:
    """In the head's namespace: train digits with one worker per host and write the figures."""
    from mixtrain import RunConfig, ScalingConfig, StrategyConfig, Trainer
    from mixtrain.cluster.headnode import use_cluster_token
    from mixtrain.examples.digits import example

    use_cluster_token(address)
    ex = example()
    run_dir = out / re.sub(r"[^\w.-]", "_", spec)
    result = Trainer(
        ex.task_factory,
        ex.train_data,
        eval_data=ex.eval_data,
        global_batch=ex.global_batch,
        scaling=ScalingConfig(
            num_workers=1 if spec == "alone" else 2,
            shares="equal",
            placement_strategy="STRICT_SPREAD",
            address=address,
            leave_out_slow=False,
        ),
        run=RunConfig(run_dir=str(run_dir), progress=False, checkpoint_every_s=3600),
        strategy=StrategyConfig(**_strategy("allreduce" if spec == "alone" else spec)),
    ).fit(epochs=epochs)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(r["time"] for r in records if r["kind"] == "plan")
    rounds = [r for r in records if r["kind"] == "round"]
    evals = [{"t": r["time"] - start, "accuracy": r["accuracy"]} for r in records if r["kind"] == "eval"]
    (out / "result.json").write_text(
        json.dumps(
            {
                "strategy": spec,
                "evals": evals,
                "samples_per_s": sum(r["samples"] for r in rounds) / sum(r["wall_s"] for r in rounds),
                "sent_mb_per_worker": sum(w["sent_bytes"] for r in rounds for w in r["workers"])
                / len(result.workers)
                / 2**20,
                "hosts": sorted(w["host"] for w in result.workers),
                "advice": json.loads((run_dir / "config.json").read_text())["strategy_advice"],
            }
        )
    )


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
    parser.add_argument("--target", type=float, default=0.95, help="held-out accuracy to reach")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--json", default="bench_results/slow_link.json")
    parser.add_argument("--drive", nargs=3, metavar=("ADDRESS", "STRATEGY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        drive(args.drive[0], args.drive[1], Path(args.drive[2]), args.epochs)
        return
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
                cmd = [sys.executable, __file__, "--epochs", str(args.epochs), "--drive", address, spec, str(out)]
                _run(head, cmd, homes["head"], timeout=1800)
                res = json.loads((out / "result.json").read_text())
                reached = next((e["t"] for e in res["evals"] if e["accuracy"] >= args.target), None)
                res["seconds_to_target"] = reached
                results.append(res)
                print(
                    f"  {spec:20s} to {args.target:.2f}: {reached if reached is None else round(reached, 1)} s, "
                    f"{res['samples_per_s']:,.0f} samples/s, final {res['evals'][-1]['accuracy']:.4f}, "
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
    print(f"link: {link}")
    first = results[0]["strategy"]
    print(f"| strategy | seconds to {args.target:.2f} held-out accuracy | speed-up vs {first} | samples/s "
          "| MB sent per worker | final accuracy |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        t = r["seconds_to_target"]
        ratio = f"{base / t:.2f}x" if base and t else "-"
        shown = f"{t:.1f}" if t is not None else "not reached"
        print(f"| {r['strategy']} | {shown} | {ratio} | {r['samples_per_s']:,.0f} | {r['sent_mb_per_worker']:,.1f} "
              f"| {r['evals'][-1]['accuracy']:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
