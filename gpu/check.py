"""`make gpu-check`: mixtrain's CUDA paths on a real NVIDIA GPU, offline, in one command.

Installs `.gpu-bundle/` (built by `make gpu-bundle`) into a throwaway folder on top of this machine's own
torch, then runs every step below as its own process, each with a time limit, timed, its result recorded
whatever happened to the steps before it. After each step it rewrites one compact report,
`gpu-check.txt` and `gpu-check.json`, in $OUT when that is set, else in mixtrain_runs/gpu-check-TIMESTAMP/.

Without a CUDA device every GPU step is recorded as skipped ("no CUDA device: skipped"), never faked;
the CPU-only steps still run. Only mixtrain's CLI, its public API and the test files are used.

    python3 gpu/check.py                      # what `make gpu-check` runs
    python3 gpu/check.py --only install,env,digits-cpu --out /tmp/r
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BUDGET_S = 540.0
"""The whole check's time: one command on the GPU machine may run 10 minutes."""
MIN_STEP_S = 20.0
"""A step is not started with less time than this left; it is recorded as not run."""
NO_CUDA = "no CUDA device: skipped"


@dataclass
class Outcome:
    result: str
    """pass, fail, below goal, refused, skipped, timeout, not run."""
    figure: str = ""
    detail: list[str] = field(default_factory=list)
    tail: str = ""
    command: str = ""


@dataclass
class Step:
    name: str
    title: str
    run: Callable[[Check], Outcome]
    needs_cuda: bool = False
    timeout_s: float = 180.0


@dataclass
class Proc:
    rc: int | None
    """None: killed at its time limit."""
    stdout: str
    stderr: str
    seconds: float


def tail(text: str, chars: int = 1500) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


class Check:
    def __init__(self, bundle: Path, out: Path, work: Path, site: Path, budget_s: float, python: str) -> None:
        self.bundle, self.out, self.work, self.site = bundle, out, work, site
        self.python = python
        self.deadline = time.monotonic() + budget_s
        self.rows: list[dict[str, Any]] = []
        self.env: dict[str, Any] = {}
        self.manifest: dict[str, Any] = {}
        self.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        self.step_timeout = 60.0

    # --- running things -------------------------------------------------------------------------------
    @property
    def cuda(self) -> bool:
        return bool(self.env.get("cuda_available"))

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.site), str(REPO), env.get("PYTHONPATH")]))
        env["PATH"] = os.pathsep.join([str(self.site / "bin"), env.get("PATH", "")])
        env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
        return env

    def sh(self, cmd: list[str], name: str) -> Proc:
        """Run `cmd` in its own process group within this step's time limit; at the limit the whole group
        (Ray's processes with it) is killed. Output goes to files, so nothing blocks on a pipe."""
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out_path, err_path = logs / f"{name}.out", logs / f"{name}.err"
        t0 = time.monotonic()
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.child_env(), stdout=out, stderr=err, start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=self.step_timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                try:  # whatever the step left behind in its group (Ray's raylet, GCS, workers)
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        seconds = time.monotonic() - t0
        return Proc(rc, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"), seconds)

    def mixtrain(self, args: list[str], name: str) -> tuple[Proc, Path]:
        run_dir = self.work / "runs" / name
        proc = self.sh([str(self.site / "bin" / "mixtrain"), "train", *args, "--run-dir", str(run_dir)], name)
        return proc, run_dir

    def api_step(self, step: str, name: str, *extra: str) -> Outcome:
        result_file = self.work / f"{name}.json"
        cmd = [self.python, "-m", "gpu.steps", step, *extra, "--work", str(self.work / "runs")]
        cmd += ["--out", str(result_file)]
        proc = self.sh(cmd, name)
        command = f"python -m gpu.steps {step} {' '.join(extra)}".strip()
        if proc.rc is None:
            return Outcome("timeout", f"no result after {proc.seconds:.0f} s", tail=tail(proc.stderr), command=command)
        if not result_file.exists():
            return Outcome("fail", f"exit status {proc.rc}, no result", tail=tail(proc.stderr), command=command)
        r = json.loads(result_file.read_text())
        failed = r["result"] not in ("pass", "skipped")
        return Outcome(r["result"], r["figure"], r.get("detail", []), tail(proc.stderr) if failed else "", command)

    # --- the report -----------------------------------------------------------------------------------
    def device(self) -> str:
        if self.cuda:
            return str(self.env.get("gpu"))
        return "no CUDA device" + (f" ({self.env['cpus']} CPU cores)" if self.env.get("cpus") else "")

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[row["result"]] = counts.get(row["result"], 0) + 1
        bundle = {k: self.manifest.get(k) for k in ("python_version", "built_at", "total_bytes", "source_sha256")}
        report = {
            "schema": "mixtrain-gpu-check/1",
            "date": self.started,
            "device": self.device(),
            "environment": self.env,
            "bundle": bundle,
            "summary": counts,
            "steps": self.rows,
        }
        (self.out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (self.out / "gpu-check.txt").write_text(self.text(counts))

    def text(self, counts: dict[str, int]) -> str:
        e = self.env
        lines = [
            f"mixtrain GPU check, {self.started}, on {self.device()}",
            f"  torch {e.get('torch')} (CUDA {e.get('torch_cuda')}), Python {e.get('python')}, Ray {e.get('ray')}, "
            f"mixtrain {e.get('mixtrain')}; bundle built {self.manifest.get('built_at')}",
            "  " + ", ".join(f"{n} {k}" for k, n in counts.items()),
            "",
            f"{'step':<20} {'result':<10} {'seconds':>7}  figure",
        ]
        lines += [f"{r['step']:<20} {r['result']:<10} {r['seconds']:>7.1f}  {r['figure']}" for r in self.rows]
        lines += ["", "Rows for docs/gpu-check.md:", "| device | step | result | figure | date |"]
        lines += ["|---|---|---|---|---|"]
        day = self.started[:10]
        lines += [
            f"| {self.device()} | {r['step']} | {r['result']} | {r['figure'].replace('|', '/')} | {day} |"
            for r in self.rows
        ]
        for r in self.rows:
            if not (r["command"] or r["detail"] or r["tail"]):
                continue
            lines += ["", f"== {r['step']}: {r['title']}"]
            if r["command"]:
                lines.append(f"   $ {r['command']}")
            lines += [f"   {d}" for d in r["detail"]]
            if r["tail"]:
                lines += ["   --- output (end) ---"] + [f"   {t}" for t in r["tail"].splitlines()]
        return "\n".join(lines) + "\n"

    # --- driving --------------------------------------------------------------------------------------
    def run(self, steps: list[Step]) -> int:
        for step in steps:
            t0 = time.monotonic()
            left = self.deadline - time.monotonic()
            if step.needs_cuda and not self.cuda:
                outcome = Outcome("skipped", NO_CUDA)
            elif left < MIN_STEP_S:
                outcome = Outcome("not run", f"out of time: {left:.0f} s of the check's {BUDGET_S:.0f} s left")
            else:
                self.step_timeout = min(step.timeout_s, left)
                try:
                    outcome = step.run(self)
                except Exception as e:  # the check itself broke on this step: say so, go on
                    outcome = Outcome("fail", " ".join(f"check error: {type(e).__name__}: {e}".split())[:300])
            row = {
                "step": step.name,
                "title": step.title,
                "command": outcome.command,
                "result": outcome.result,
                "figure": outcome.figure,
                "seconds": round(time.monotonic() - t0, 1),
                "detail": outcome.detail[:14],
                "tail": outcome.tail,
            }
            self.rows.append(row)
            self.write()
            print(f"gpu-check: {step.name:<20} {outcome.result:<10} {row['seconds']:7.1f} s  {outcome.figure}")
            sys.stdout.flush()
        bad = [r for r in self.rows if r["result"] in ("fail", "timeout")]
        return 1 if bad else 0


# --- the steps ----------------------------------------------------------------------------------------------
def install(c: Check) -> Outcome:
    """pip --no-index --no-deps of the bundle's wheels into the throwaway folder, then Ray's files."""
    manifest_file = c.bundle / "manifest.json"
    if not manifest_file.exists():
        return Outcome("fail", f"no bundle at {c.bundle}: run `make gpu-bundle` where pip works and carry .gpu-bundle")
    c.manifest = json.loads(manifest_file.read_text())
    want, have = c.manifest["python_version"], "{}.{}".format(*sys.version_info[:2])
    if want != have:
        return Outcome("fail", f"the bundle is for Python {want}, this is {have}: make gpu-bundle PYVER={have}")
    detail = []
    from gpu.digest import source_digest

    if c.manifest.get("source_sha256") != source_digest(REPO):
        detail.append("WARNING: src/ changed since the bundle was built: its mixtrain wheel is older than this tree")
    wheels = [str(c.bundle / w["file"]) for w in c.manifest["wheels"]]
    cmd = [c.python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--target", str(c.site), *wheels]
    proc = c.sh(cmd, "install")
    if proc.rc != 0:
        return Outcome("fail", f"pip install exited {proc.rc}", detail, tail(proc.stderr), "pip install --no-index ...")
    t0 = time.monotonic()
    with tarfile.open(c.bundle / c.manifest["ray"]["file"]) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(c.site, filter="data")
        else:  # Python before 3.11.4 / 3.12
            tar.extractall(c.site)  # our own archive, built by gpu/bundle.py
    mib = c.manifest["total_bytes"] / 2**20
    detail.append(f"{len(wheels)} wheels and Ray {c.manifest['ray']['version']} into {c.site}")
    pruned = ", ".join(c.manifest["ray"]["pruned"])
    detail.append(f"Ray unpacked in {time.monotonic() - t0:.1f} s; left out of it: {pruned}")
    stale = "; STALE: src/ changed since it was built" if detail[0].startswith("WARNING") else ""
    figure = f"bundle of {mib:.1f} MiB installed offline{stale}"
    return Outcome("pass", figure, detail, command="pip install --no-index")


def environment(c: Check) -> Outcome:
    out = c.api_step("env", "env")
    result_file = c.work / "env.json"
    if result_file.exists():
        c.env = json.loads(result_file.read_text()).get("data", {})
    if not c.env:  # mixtrain or Ray would not import: still find out whether there is a GPU
        probe = c.sh([c.python, "-c", "import torch; print(torch.cuda.is_available())"], "env-torch")
        c.env = {"cuda_available": probe.stdout.strip() == "True"}
    return out


def pytest_gpu(c: Check) -> Outcome:
    cmd = [c.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/gpu"]
    proc = c.sh(cmd, "pytest-gpu")
    command = "python -m pytest -q tests/gpu"
    if proc.rc is None:
        return Outcome("timeout", f"after {proc.seconds:.0f} s", tail=tail(proc.stdout), command=command)
    summary = next((ln.strip("= ") for ln in reversed(proc.stdout.splitlines()) if re.search(r"\d+ \w+ in ", ln)), "")
    summary = re.sub(r" in [\d.]+s.*", "", summary)
    detail = [ln for ln in proc.stdout.splitlines() if re.match(r"(PASSED|FAILED|ERROR|SKIPPED)", ln)][:10]
    if proc.rc == 0 and "passed" not in summary and "skipped" in summary and not c.cuda:
        return Outcome("skipped", f"{NO_CUDA} (pytest: {summary})", detail, command=command)
    result = "pass" if proc.rc == 0 and "passed" in summary else "fail"
    return Outcome(
        result,
        f"pytest: {summary or f'exit status {proc.rc}'}",
        detail,
        "" if result == "pass" else tail(proc.stdout),
        command,
    )


def records(run_dir: Path, kind: str) -> list[dict]:
    """The records of one kind from a run folder's metrics.jsonl (documented in docs/run-folder.md)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == kind]


def cli_outcome(proc: Proc, run_dir: Path, command: str, min_accuracy: float) -> Outcome:
    """A `mixtrain train` run: its plan table, the leave-out decision and reason, held-out accuracy."""
    err = proc.stderr.splitlines()
    detail: list[str] = []
    detail += [ln for ln in err if ln.startswith("mixtrain: ") and " workers, global batch " in ln][:1]
    if "plan:" in err:  # the first plan table, as printed
        i = err.index("plan:")
        end = next((j for j in range(i, len(err)) if err[j].strip().startswith("predicted:")), i + 8)
        detail += err[i : end + 1]
    decisions = [ln.strip() for ln in err if re.search(r"left out|slows this job", ln)]
    pre = records(run_dir, "preflight")
    left = pre[0].get("left_out", []) if pre else []
    detail += decisions[:4] or (["leave-out: none (no worker left out or named as slowing the job)"] if pre else [])
    detail += [ln for ln in err if ln.startswith("strategy:")][:1]
    detail += [ln for ln in err if ln.startswith("epoch ")][-1:]
    rounds = records(run_dir, "round")
    if rounds:
        later = rounds[1:] or rounds
        span = later[-1]["time"] - (rounds[0]["time"] if len(rounds) > 1 else later[0]["time"] - later[0]["wall_s"])
        detail.append(f"{sum(r['samples'] for r in later) / max(span, 1e-9):,.0f} samples/s after the first round")
    m = re.search(r"held-out loss ([\d.]+), accuracy ([\d.]+)", proc.stdout)
    if proc.rc is None:
        return Outcome("timeout", f"after {proc.seconds:.0f} s", detail, tail(proc.stderr), command)
    if proc.rc != 0 or not m:
        last = next((ln for ln in reversed(err) if ln.strip()), f"exit status {proc.rc}")
        return Outcome("fail", last.strip()[:200], detail, tail(proc.stderr), command)
    acc = float(m.group(2))
    kept = ""
    if left:
        kept = f"; left out: {', '.join(str(w.get('worker', {}).get('device_name', '?')) for w in left)}"
    elif decisions:
        kept = "; " + decisions[0][:80]
    ok = acc >= min_accuracy
    return Outcome(
        "pass" if ok else "fail",
        f"held-out accuracy {acc:.4f} (>= {min_accuracy}){kept}",
        detail,
        "" if ok else tail(proc.stderr),
        command,
    )


def train_step(name: str, args: list[str], min_accuracy: float) -> Callable[[Check], Outcome]:
    def run(c: Check) -> Outcome:
        proc, run_dir = c.mixtrain(args, name)
        out = cli_outcome(proc, run_dir, "mixtrain train " + " ".join(args), min_accuracy)
        if "--precision" in args:  # the start-up numerics check's figures, per worker
            pre = records(run_dir, "preflight")
            if pre:
                reports = {r["rank"]: r for r in pre[0].get("reports", [])}
                for n in pre[0].get("numerics", []):
                    rep = reports.get(n["rank"], {})
                    device = rep.get("device", {}).get("name", "?")
                    out.detail.append(
                        f"numerics: worker {n['rank']} {device} at {rep.get('precision')}: gradient differs from the "
                        f"CPU's fp32 by {n['error']:.2e} (tolerance {n['tolerance']:g})"
                    )
                worst = max((n["error"] / n["tolerance"] for n in pre[0].get("numerics", [])), default=0.0)
                out.figure += f"; numerics worst {worst:.2f} of tolerance"
        return out

    return run


STEPS = [
    Step("install", "install the bundle offline into a throwaway folder", install, timeout_s=180),
    Step("env", "versions and the device", environment, timeout_s=90),
    Step(
        "pytest-gpu",
        "pytest tests/gpu (CUDA + CPU ranks in one gloo group, device class, OOM search)",
        pytest_gpu,
        timeout_s=240,
    ),
    Step(
        "digits-cuda-cpu",
        "digits on a CUDA worker and 2 CPU workers",
        train_step("digits-cuda-cpu", ["digits", "--workers", "cuda:1,cpu:2"], 0.90),
        True,
        180,
    ),
    Step(
        "chars-cuda-cpu",
        "chars on a CUDA worker and 2 CPU workers",
        train_step("chars-cuda-cpu", ["chars", "--workers", "cuda:1,cpu:2"], 0.40),
        True,
        300,
    ),
    Step(
        "exact-cuda-cpu",
        "unequal shares over CUDA + 2 CPU workers equal single-process weights (fp32)",
        lambda c: c.api_step("exactness", "exact-cuda-cpu", "--devices", "cuda"),
        True,
        180,
    ),
    Step(
        "sliced-cuda-cpu",
        'shard="full" and "gradients" (state sliced 3:1:2 by memory) over CUDA + 2 CPU workers equal one process',
        lambda c: c.api_step("sliced", "sliced-cuda-cpu", "--devices", "cuda"),
        True,
        180,
    ),
    Step(
        "caps-cuda-cpu",
        "DeviceGroup(memory=96MB) on the CUDA worker: its tensors stay under the cap while it trains a share whose "
        "activations pass it, in smaller micro-batches, with one process's weights",
        lambda c: c.api_step("caps", "caps-cuda-cpu", "--devices", "cuda"),
        True,
        180,
    ),
    Step(
        "loop-cuda-cpu",
        "your own loop (mixtrain.train: AdamW, a schedule, clipping) over CUDA + 2 CPU workers equals one process",
        lambda c: c.api_step("loop", "loop-cuda-cpu", "--devices", "cuda"),
        True,
        180,
    ),
    Step(
        "precision-auto",
        "--precision auto (bf16 autocast on the GPU) with the numerics check",
        train_step(
            "precision-auto", ["digits", "--workers", "cuda:1,cpu:2", "--precision", "auto", "--keep-all-devices"], 0.90
        ),
        True,
        180,
    ),
    Step(
        "overhead",
        "1 CUDA worker under mixtrain vs a plain PyTorch loop (chars model and batch)",
        lambda c: c.api_step("overhead", "overhead", "--devices", "cuda"),
        True,
        240,
    ),
    Step(
        "nccl",
        "NCCL: 1 CUDA worker; 2 CUDA workers under auto (gloo when they share a card) and under --backend nccl "
        "(refused with the fix on one card)",
        lambda c: c.api_step("nccl", "nccl"),
        True,
        240,
    ),
    Step(
        "lost-worker",
        "a worker stopped mid-round under gloo (CUDA + CPU) and, given 2 GPUs, NCCL: the survivors get an "
        "exception, not the NCCL watchdog's kill, re-form and end with single-process weights",
        lambda c: c.api_step("lost-worker", "lost-worker", "--devices", "cuda"),
        True,
        200,
    ),
    Step(
        "ps-cuda-cpu",
        "--strategy ps over CUDA + 2 CPU workers",
        train_step(
            "ps-cuda-cpu", ["digits", "--workers", "cuda:1,cpu:2", "--strategy", "ps", "--keep-all-devices"], 0.90
        ),
        True,
        180,
    ),
    Step(
        "local-sgd-cuda-cpu",
        "--strategy local-sgd over CUDA + 2 CPU workers",
        train_step(
            "local-sgd-cuda-cpu",
            ["digits", "--workers", "cuda:1,cpu:2", "--strategy", "local-sgd", "--keep-all-devices"],
            0.85,
        ),
        True,
        180,
    ),
    Step(
        "digits-cpu",
        "digits on 2 CPU workers (the CPU path, 3 epochs)",
        train_step("digits-cpu", ["digits", "--workers", "cpu:2", "--epochs", "3"], 0.85),
        False,
        150,
    ),
    Step(
        "exact-cpu",
        "unequal shares over 2 CPU workers equal single-process weights (fp32)",
        lambda c: c.api_step("exactness", "exact-cpu", "--devices", "cpu"),
        False,
        150,
    ),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, default=REPO / ".gpu-bundle", help="the bundle folder (default .gpu-bundle)")
    ap.add_argument("--out", type=Path, default=None, help="report folder (default $OUT, else a run folder)")
    ap.add_argument("--only", default=None, help="comma-separated step names (default: all, in order)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"the whole check's time (default {BUDGET_S:.0f})")
    ap.add_argument("--keep", action="store_true", help="keep the throwaway install and run folders")
    args = ap.parse_args(argv)
    names = [s.name for s in STEPS]
    chosen = STEPS
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            ap.error(f"--only: unknown step(s) {', '.join(unknown)}; choose from {', '.join(names)}")
        chosen = [s for s in STEPS if s.name in wanted or s.name in ("install", "env")]
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out is None:
        out = REPO / "mixtrain_runs" / time.strftime("gpu-check-%Y%m%d-%H%M%S")
    work = Path(tempfile.mkdtemp(prefix="mx-gpu-check-"))
    check = Check(args.bundle.resolve(), out.resolve(), work, work / "site", args.budget_s, sys.executable)
    print(f"gpu-check: installing into {check.site}; report: {check.out}/gpu-check.txt", flush=True)
    try:
        status = check.run(chosen)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"gpu-check: report in {check.out}/gpu-check.txt and gpu-check.json", flush=True)
    return status


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a file (python3 gpu/check.py): make `gpu` importable
        sys.path.insert(0, str(REPO))
    sys.exit(main())
