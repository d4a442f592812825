"""The README's main job, through the real `mixtrain` command: its own embedded Ray, real data."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixtrain import load_weights
from tests.conftest import run_records

MIXTRAIN = str(Path(sys.executable).parent / "mixtrain")


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [MIXTRAIN, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def test_digits_main_job_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("train", "--example", "digits", "--workers", "2", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"accuracy (\d\.\d+)", proc.stdout).group(1))
    assert accuracy >= 0.95, proc.stdout
    assert f"run folder: {run_dir}" in proc.stdout
    # live progress and per-epoch lines go to the terminal (stderr), Ray's own logs do not
    assert "epoch 10/10: loss" in proc.stderr and "samples/s" in proc.stderr
    assert "INFO" not in proc.stderr and "raylet" not in proc.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert sum(config["shares"]) == 64 and config["scaling"]["num_workers"] == 2
    assert "plan:" in proc.stderr and "predicted:" in proc.stderr  # the start-of-run table
    assert re.search(r"start-up [\d.]+ s: Ray [\d.]+ s, worker processes and replicas", proc.stderr)
    # captured output is not a terminal: the last per-device table keeps every column, uncut
    assert re.search(r"samples/s\s+busy\s+waiting\s+comm\s+memory\n", proc.stderr) and "…" not in proc.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 10 and abs(evals[-1]["accuracy"] - accuracy) < 1e-4
    rounds = [r for r in records if r["kind"] == "round"]
    assert sum(r["samples"] for r in rounds) == 10 * config["num_samples"]
    # One worker alone may be measured faster on this 2-core machine, at the start or mid-run, and a worker
    # left out mid-run may be taken back; either worker may be the one (both are CPUs); the notes say why.
    assert all(len(r["workers"]) == len(r["shares"]) for r in rounds)
    if any(len(r["workers"]) == 1 for r in rounds):
        assert re.search(r"left out worker [01] \(", proc.stderr), proc.stderr
    state = load_weights(run_dir / "model.safetensors")
    assert "head.3.weight" in state
    assert len(list((run_dir / "logs").glob("worker-*.log"))) == 2  # worker output: in the run folder only

    report = run_cli("report", str(run_dir))
    assert report.returncode == 0, report.stderr
    assert f"accuracy {evals[-1]['accuracy']:.4f}" in report.stdout and "per device" in report.stdout
    for name in ("loss.png", "throughput.png", "shares.png", "summary.txt"):
        assert f"wrote {run_dir / 'report' / name}" in report.stdout
        assert (run_dir / "report" / name).stat().st_size > 1000 or name == "summary.txt"
    proc = run_cli("report", str(tmp_path))
    assert proc.returncode == 2 and "no metrics.jsonl there" in proc.stderr


def test_env_prints_what_a_bug_report_needs():
    proc = run_cli("env")
    assert proc.returncode == 0, proc.stderr
    for pattern in (
        r"^mixtrain \d",
        r"^python   3\.\d+",
        r"^torch    2\.\d+",
        r"^ray      2\.\d+",
        r"^os       ",
        r"^  cpu:0  ",
        r"^network: hostname ",
        r"^cluster: ",
        r"^settings: ",
        r"^optional: matplotlib \d",
    ):
        assert re.search(pattern, proc.stdout, re.M), (pattern, proc.stdout)
    import os
    import subprocess

    # the settings this command was started with, whatever the test session set in its own environment before
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MIXTRAIN_", "RAY_AUTH"))}
    clean["MIXTRAIN_COLLECTIVE_TIMEOUT_S"] = "30"
    proc = subprocess.run([MIXTRAIN, "env", "--json"], capture_output=True, text=True, timeout=300, env=clean)
    report = json.loads(proc.stdout)
    assert report["versions"]["torch"] == torch.__version__ and report["devices"][0]["kind"] == "cpu"
    assert report["settings"] == {"MIXTRAIN_COLLECTIVE_TIMEOUT_S": "30"}


def test_a_toml_config_trains_the_character_transformer_with_job_arguments(tmp_path, ray_address):
    config = tmp_path / "chars.toml"
    config.write_text('task = "chars"\nworkers = 2\nepochs = 2\nquiet = true\n[args]\nmax_chars = 120000\n')
    run_dir = tmp_path / "run"
    proc = run_cli("train", str(config), "--run-dir", str(run_dir), "--address", ray_address)
    assert proc.returncode == 0, proc.stderr
    loss, accuracy = map(float, re.search(r"held-out loss (\d\.\d+), accuracy (\d\.\d+)", proc.stdout).groups())
    # 103 characters: uniform guessing is ln(103) = 4.6 nats, the best single character ("space") ~17%
    assert loss < 2.8 and accuracy > 0.22, proc.stdout
    config_json = json.loads((run_dir / "config.json").read_text())
    assert config_json["epochs"] == 2 and config_json["num_samples"] == 120000 * 9 // 10 // 64
    # the config's keys are kept in the run folder as they were read, not its path (read again at a resume, a
    # file that changed or was planted later would run other code); where the run connects is given again
    saved = json.loads((run_dir / "command.json").read_text())
    assert saved["argv"] == ["--address", ray_address] and saved["args"] == {"max_chars": 120000}
    assert saved["config"] == {"task": "chars", "workers": 2, "epochs": 2, "quiet": True}


USER_JOB = """
import functools

import torch
from torch import nn

import mixtrain


def make_task(hidden, lr):
    model = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 2))
    return mixtrain.Task(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=lr),
                         loss_fn=nn.functional.cross_entropy)


def make_job(hidden: int = 32, lr: float = 0.01, seed: int = 0) -> mixtrain.Job:
    x = torch.randn(2000, 2, generator=torch.Generator().manual_seed(seed))
    y = (x[:, 0] * x[:, 1] > 0).long()  # XOR of the signs: a hidden layer is needed
    return mixtrain.Job(functools.partial(make_task, hidden, lr), (x[:1600], y[:1600]), (x[1600:], y[1600:]),
                        global_batch=64, epochs=6)
"""


def test_a_users_module_function_job_trains_from_its_folder(tmp_path, ray_address):
    (tmp_path / "xorjob.py").write_text(USER_JOB)
    proc = subprocess.run(
        [MIXTRAIN, "train", "xorjob:make_job", "--workers", "2", "--lr", "0.02", "--run-dir", "run", "--quiet",
         "--address", ray_address],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"accuracy (\d\.\d+)", proc.stdout).group(1))
    assert accuracy > 0.9, proc.stdout  # a linear model cannot pass 0.5 on XOR
    assert json.loads((tmp_path / "run" / "config.json").read_text())["epochs"] == 6  # the job's default
    proc = subprocess.run(
        [MIXTRAIN, "train", "xorjob:make_job", "--data-dir", "."], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2 and "--data-dir '.': xorjob:make_job takes no 'data_dir' argument" in proc.stderr


def test_mnist_trains_from_idx_files(tmp_path, ray_address):
    """Real handwritten digits (scikit-learn's, scaled to 28x28) written as the four MNIST IDX files."""
    import numpy as np
    from sklearn.datasets import load_digits

    from mixtrain.examples.idx import write_idx

    digits = load_digits()
    images = (np.kron(digits.images, np.ones((3, 3))) * (255 / 16)).astype(np.uint8)  # 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    labels = digits.target.astype(np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", images[:1400])
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labels[:1400])
    write_idx(tmp_path / "t10k-images-idx3-ubyte", images[1400:])
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[1400:])
    proc = run_cli("train", "mnist", "--data-dir", str(tmp_path), "--workers", "2", "--epochs", "4",
                   "--global-batch", "64", "--quiet", "--run-dir", str(tmp_path / "run"),
                   "--address", ray_address)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"accuracy (\d\.\d+)", proc.stdout).group(1))
    assert accuracy > 0.85, proc.stdout
    assert json.loads((tmp_path / "run" / "config.json").read_text())["num_samples"] == 1400


def test_bad_flags_name_the_flag_and_the_fix(tmp_path, capsys):
    # in this process: every one of these is refused before anything starts (no Ray, no worker)
    from mixtrain.cli.main import main

    def run_cli(*args):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
        return subprocess.CompletedProcess(args, code, "", capsys.readouterr().err)

    proc = run_cli("train", "--workers", "0")
    assert proc.returncode == 2 and "--workers '0'" in proc.stderr and "cuda:1,mps:1,cpu:2" in proc.stderr
    proc = run_cli("train", "--workers", "tpu:2")
    assert proc.returncode == 2 and "item 'tpu:2' is not KIND[:COUNT]" in proc.stderr
    proc = run_cli("train", "--precision", "fp8")
    assert proc.returncode == 2 and "--precision" in proc.stderr and "'fp32', 'auto', 'bf16', 'fp16'" in proc.stderr
    proc = run_cli("train", "--example", "imagenet")
    assert proc.returncode == 2
    assert "--example 'imagenet': choose a built-in example (digits, chars, chars-large, mnist)" in proc.stderr
    proc = run_cli("train", "imagenet")
    assert proc.returncode == 2 and "TASK 'imagenet': choose a built-in example" in proc.stderr
    (tmp_path / "bad.toml").write_text('strategy = "gossip"\n')
    proc = run_cli("train", str(tmp_path / "bad.toml"))
    assert proc.returncode == 2 and f"{tmp_path / 'bad.toml'}: strategy = 'gossip': choose one of" in proc.stderr
    proc = run_cli("train", "mnist", "--data-dir", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "no such folder" in proc.stderr
    proc = run_cli("train", "--workers", "2", "--shares", "40,20", "--run-dir", str(tmp_path))
    assert proc.returncode == 2 and "shares=[40, 20] sum to 60 but global_batch=64" in proc.stderr
    proc = run_cli("train", "--shares", "4x")
    assert proc.returncode == 2 and "--shares" in proc.stderr
    proc = run_cli("train", "--strategy", "gossip")
    assert proc.returncode == 2 and "--strategy" in proc.stderr
    assert "'allreduce', 'ps', 'ps-async', 'local-sgd'" in proc.stderr
    proc = run_cli("train", "--strategy", "ps-async", "--staleness", "-1")
    assert proc.returncode == 2 and "--staleness" in proc.stderr and "must be >= 0" in proc.stderr
    proc = run_cli("train", "--compress", "int2")
    assert proc.returncode == 2 and "--compress" in proc.stderr and "'bf16'" in proc.stderr
    proc = run_cli("train", "--compress", "int8")  # int8 deltas: local SGD only
    assert proc.returncode == 2 and "(--compress int8) works with strategy local-sgd only" in proc.stderr
    assert "(--compress bf16), or strategy='local-sgd' (--strategy local-sgd)" in proc.stderr
    proc = run_cli("plan", "--max-micro-batch", "0")
    assert proc.returncode == 2 and "--max-micro-batch" in proc.stderr and ">= 1" in proc.stderr
    proc = run_cli("train", "--keep-best", "accuracy:up")
    assert proc.returncode == 2 and "--keep-best 'accuracy:up': give METRIC or METRIC:min" in proc.stderr
    proc = run_cli("train", "--early-stopping", "loss:min:0")
    assert proc.returncode == 2 and "PATIENCE an integer >= 1, e.g. loss:min:3" in proc.stderr
    proc = run_cli("train", "--max-steps", "0")
    assert proc.returncode == 2 and "--max-steps" in proc.stderr


def test_max_steps_eval_every_keep_best_and_early_stopping_from_the_cli_with_a_resume(tmp_path, ray_address):
    """digits has 23 steps an epoch: 40 steps end inside the second, with evaluations at 15, 30 and 40; the
    resume goes on to 60 (45, 60), the best checkpoint kept beside the newest and named at the end."""
    run = str(tmp_path / "run")
    flags = ["--eval-every", "15", "--keep-best", "accuracy", "--early-stopping", "loss:min:50", "--quiet"]
    proc = run_cli("train", "digits", "--workers", "2", "--max-steps", "40", "--run-dir", run, *flags,
                   "--address", ray_address)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    best = re.search(r"best checkpoint: (\S+)", proc.stdout).group(1)
    assert [e["global_step"] for e in run_records(run, "eval")] == [15, 30, 40]
    assert sum(r["num_steps"] for r in run_records(run, "round")) == 40
    proc = run_cli("train", "--resume", run, "--max-steps", "60", "--address", ray_address)
    assert proc.returncode == 0, proc.stderr
    assert [e["global_step"] for e in run_records(run, "eval")] == [15, 30, 40, 45, 60]
    evals = run_records(run, "eval")
    want = max(evals, key=lambda e: (e["accuracy"], -e["global_step"]))["global_step"]  # the first of the best
    assert re.search(r"best checkpoint: (\S+)", proc.stdout).group(1).endswith(f"step-{want:09d}")
    assert Path(best).parent == Path(run, "checkpoints")  # the first run's best, named when it ended
    proc = run_cli("train", "--resume", run, "--max-steps", "60", "--address", ray_address)
    assert proc.returncode == 2 and "RunConfig.max_steps=60 has nothing left to do" in proc.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_train_on_an_existing_ray_cluster_via_address(tmp_path):
    """`--address` connects to a running cluster instead of starting one. The head runs in its own
    process group with its own (short: Ray's socket paths are length-limited) temp dir, and only that
    group is stopped, never `ray stop`. Ray binds the head to this machine's own address and maps
    127.0.0.1 to it, so nothing leaves the host."""
    import os
    import secrets
    import shutil
    import signal
    import tempfile

    port = _free_port()
    ray_tmp = tempfile.mkdtemp(prefix="mt-ray-")
    # Ray >= 2.59 authenticates with a token; head and driver share one explicitly
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_USAGE_STATS_ENABLED": "0"}
    ray_bin = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--temp-dir={ray_tmp}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # as `cluster up` starts its nodes: no 30 s drain on SIGTERM (Ray 2.60), so the head stops at once below
        env={**os.environ, **auth, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
    )
    try:
        # the CLI waits up to MIXTRAIN_CONNECT_TIMEOUT_S for the head to come up
        proc = run_cli(
            "train",
            "--address",
            f"127.0.0.1:{port}",
            "--epochs",
            "2",
            "--quiet",
            "--workers",
            "2",  # (the default, auto, would be one CPU worker holding the node's cores)
            "--keep-all-devices",  # two workers on this cluster; the advisor may leave one out on a loaded machine
            "--run-dir",
            str(tmp_path / "run"),
            env={"MIXTRAIN_CONNECT_TIMEOUT_S": "60", **auth},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(r"accuracy 0\.\d+", proc.stdout)
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert any(r["kind"] == "workers" and len(r["workers"]) == 2 for r in records)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # only this head's own process group
            head.wait(timeout=15)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_unreachable_address_fails_in_seconds_with_the_fix():
    import time

    t0 = time.monotonic()
    proc = run_cli("train", "--address", f"127.0.0.1:{_free_port()}", env={"MIXTRAIN_CONNECT_TIMEOUT_S": "2"})
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 1
    assert "no Ray head answers at 127.0.0.1:" in proc.stderr and "MIXTRAIN_CONNECT_TIMEOUT_S" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_devices_lists_this_machine():
    proc = run_cli("devices")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"python 3\.\d+\.\d+, torch 2\.\d+", proc.stdout)
    assert re.search(r"cpu:0  .+ memory \d+\.\d GiB \(free \d+\.\d\)", proc.stdout)


def test_device_groups_from_the_command_line_with_a_gpu_group_on_a_cpu_machine_fail_before_training(
    tmp_path, ray_address
):
    # Two CPU workers given as a group train; a cuda group on this GPU-less machine is refused
    # by placement within seconds, naming the missing resource and what the cluster has.
    proc = run_cli("train", "--workers", "cpu:2", "--epochs", "1", "--quiet", "--run-dir", str(tmp_path / "a"),
                   "--address", ray_address)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "accuracy" in proc.stdout
    proc = run_cli("train", "--workers", "cuda:1,cpu:1", "--epochs", "1", "--run-dir", str(tmp_path / "b"),
                   "--address", ray_address)  # fmt: skip
    assert proc.returncode == 1
    assert "cannot hold these workers: GPU: 1 needed, 0 in the cluster" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_measures_prints_the_split_and_suggests_a_strategy_without_training(ray_address):
    proc = run_cli(
        "plan", "--workers", "2", "--max-micro-batch", "8", "--keep-all-devices", "--address", ray_address,
        env={"MIXTRAIN_EMULATE_SLOWDOWN": "1:4"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # worker ... share  micro x acc  compute/s  predicted/s  memory cap
    row = re.compile(r"^\s+(\d)\s.*\s(\d+)\s+(\d+) x (\d+)\s+([\d,]+)\s+([\d,]+)\s+(\S+)$")
    rows = {int(m[1]): m for m in map(row.match, proc.stdout.splitlines()) if m}
    assert set(rows) == {0, 1}, proc.stdout
    fast, slow = int(rows[0][2]), int(rows[1][2])
    assert fast + slow == 64 and slow < fast, proc.stdout  # the emulated 4x slower worker gets less
    # Shares over the cap of 8 are split into micro-batches of 8; a share under it runs whole. (Which one the
    # slow worker gets follows the probe's timings: on a loaded machine one read it 10x slower, share 6.)
    for m in rows.values():
        share, micro, acc = int(m[2]), int(m[3]), int(m[4])
        assert micro == min(share, 8) and acc == -(-share // micro) and m[7] == "8", proc.stdout
    assert int(rows[0][3]) == 8 and int(rows[0][4]) > 1, proc.stdout  # the fast worker's share is over the cap
    assert "predicted:" in proc.stdout and "ms communication" in proc.stdout
    # the strategy advice from the measured link
    line = next(s for s in proc.stdout.splitlines() if s.startswith("strategy: allreduce; measured: "))
    assert re.search(r"MB per exchange took [\d.]+ ms \([\d,]+ MB/s\) against [\d.]+ ms of compute per step", line)
    assert re.search(r"(allreduce|local-sgd with H=\d+( and int[48] deltas)?) suggested", line), line


@pytest.mark.parametrize(
    "flags",
    [["--strategy", "ps", "--ps-shards", "2"], ["--strategy", "ps-async", "--staleness", "2"],
     ["--strategy", "local-sgd", "--local-steps", "4", "--overlap", "--compress", "int8", "--pace", "per-device"]],
    ids=["ps", "ps-async", "local-sgd-overlap-int8-per-device-pace"],
)  # fmt: skip
def test_each_strategy_trains_the_digits_job_through_the_cli(flags, tmp_path, ray_address):
    run_dir = tmp_path / "run"
    proc = run_cli("train", "--workers", "2", "--shares", "equal", "--epochs", "3", "--run-dir", str(run_dir),
                   "--address", ray_address, *flags)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"accuracy (\d\.\d+)", proc.stdout).group(1))
    # 3 epochs: the synchronous ones are at ~0.97; updates 2 steps stale learn slower early on (the
    # within-2-points comparison with all-reduce after 10 epochs is in tests/ray/test_strategies.py)
    assert accuracy >= (0.5 if flags[1] == "ps-async" else 0.85), proc.stdout  # chance is 0.1
    config = json.loads((run_dir / "config.json").read_text())
    assert config["strategy"]["name"] == flags[1]
    assert f"strategy: {flags[1]}" in proc.stderr and "MB per exchange took" in proc.stderr
    assert config["strategy"]["local_sgd"]["overlap"] == ("--overlap" in flags)
    assert config["strategy"]["local_sgd"]["pace"] == ("per-device" if "--pace" in flags else "balanced")
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rounds if r["kind"] == "round"]
    assert sum(r["samples"] for r in rounds) == 3 * config["num_samples"]
    assert all(w["sent_bytes"] > 0 for r in rounds for w in r["workers"])


def test_a_killed_cli_run_resumes_from_its_checkpoint_and_ends_like_an_uninterrupted_one(tmp_path, ray_address):
    import os
    import signal
    import time

    run_dir = tmp_path / "run"
    flags = ["--example", "digits", "--workers", "2", "--shares", "40,24", "--epochs", "4"]
    # SIGKILL the whole CLI (driver and its embedded Ray) once it has written its second checkpoint
    proc = subprocess.Popen(
        [MIXTRAIN, "train", *flags, "--run-dir", str(run_dir), "--checkpoint-every", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while len(list((run_dir / "checkpoints").glob("step-*"))) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = max(p.name for p in (run_dir / "checkpoints").glob("step-*"))

    resumed = run_cli("train", "--resume", str(run_dir))  # the run's own flags come from its folder
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and killed_at in resumed.stderr
    # the uninterrupted run to compare with (on the session's Ray: the embedded one is tested above)
    straight = run_cli("train", *flags, "--run-dir", str(tmp_path / "straight"), "--address", ray_address)
    assert straight.returncode == 0, straight.stderr
    got = load_weights(run_dir / "model.safetensors")
    want = load_weights(tmp_path / "straight" / "model.safetensors")
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-6, atol=1e-7), name
    from mixtrain.checkpoint import CheckpointStore

    store = CheckpointStore(run_dir)
    for path in store.paths():
        store.verify(path)
    assert not list(store.root.glob(".tmp-*"))


def _start_and_wait_for_a_round(run_dir, *flags):
    """`mixtrain train digits` in its own session (as a terminal runs it), once its first round is recorded."""
    import os
    import subprocess
    import time

    proc = subprocess.Popen(
        [MIXTRAIN, "train", "digits", "--run-dir", str(run_dir), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and '"kind": "round"' in metrics.read_text():
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no round within 120 s: {proc.communicate()[1][-2000:]}")


def _processes_left(session: int, within: float = 20.0) -> list[str]:
    """The processes of the CLI's session still running `within` seconds after it exited. Ray's agents notice
    their raylet has gone within a few seconds; zombies (already exited, not yet reaped by this container's
    init) do not count."""
    import subprocess
    import time

    deadline = time.monotonic() + within
    while True:
        rows = subprocess.run(["ps", "-eo", "sid=,pid=,stat=,cmd="], capture_output=True, text=True).stdout
        left = [row for row in rows.splitlines() if row.split()[0] == str(session) and "Z" not in row.split()[2]]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_ctrl_c_finishes_the_round_writes_a_checkpoint_and_prints_the_resume_line(tmp_path, ray_address):
    import os
    import signal
    import time

    from mixtrain.checkpoint import CheckpointStore

    run_dir = tmp_path / "run"
    proc = _start_and_wait_for_a_round(run_dir, "--epochs", "3")
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, err[-3000:]
    assert took < 20, took
    assert "SIGINT: finishing this round and writing a checkpoint" in err
    assert f"continue with `mixtrain train --resume {run_dir}`" in err, err[-2000:]
    store = CheckpointStore(run_dir)
    [stopped] = run_records(run_dir, "interrupted")
    assert store.paths()[0].name.endswith(f"{stopped['step']:09d}") and store.verify(store.paths()[0])
    assert _processes_left(proc.pid) == []  # Ray's processes and the workers went too

    resumed = run_cli("train", "--resume", str(run_dir), "--address", ray_address)  # (the session's Ray)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rounds = run_records(run_dir, "round")
    assert rounds[-1]["epoch"] == 2 and f"at epoch {stopped['epoch']}, step {stopped['step']}" in resumed.stderr


def test_a_second_ctrl_c_stops_at_once_and_the_last_checkpoint_stays_intact(tmp_path):
    import os
    import signal
    import time

    from mixtrain.checkpoint import CheckpointStore

    run_dir = tmp_path / "run"
    proc = _start_and_wait_for_a_round(run_dir, "--epochs", "50", "--checkpoint-every", "0")
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, err[-3000:]
    # "at once": no waiting for the round's end or a checkpoint; the bound leaves room for a loaded machine's
    # Ray shutdown (15 s failed once beside a second test run)
    assert took < 30, (took, err[-3000:])
    assert re.search(r"mixtrain: stopped (at once|at epoch \d+, step \d+\. The last checkpoint)", err), err[-3000:]
    store = CheckpointStore(run_dir)
    for path in store.paths():
        store.verify(path)
    assert _processes_left(proc.pid) == []


FAILING_JOBS = """
import torch
from torch import nn

import mixtrain


def raising_task():
    raise RuntimeError("boom from the job's task factory")


def nan_task():
    model = nn.Linear(2, 2)
    return mixtrain.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         loss_fn=lambda out, y: nn.functional.cross_entropy(out, y) * float("nan"))


def job(task) -> mixtrain.Job:
    x = torch.randn(256, 2, generator=torch.Generator().manual_seed(0))
    return mixtrain.Job(task, (x, (x[:, 0] > 0).long()), global_batch=32, epochs=3)


def raising_job() -> mixtrain.Job:
    return job(raising_task)


def nan_job() -> mixtrain.Job:
    return job(nan_task)
"""


@pytest.mark.parametrize("job,says", [("raising_job", "boom from the job's task factory"), ("nan_job", "NaN or Inf")])
def test_a_run_that_fails_leaves_nothing_running(tmp_path, job, says):
    # README ("Nothing lost"): nothing is left running afterwards, on any error, not only after a Ctrl-C: the
    # embedded Ray's processes and the workers are gone when the command returns
    (tmp_path / "failing.py").write_text(FAILING_JOBS)
    proc = subprocess.Popen(
        [MIXTRAIN, "train", f"failing:{job}", "--workers", "1", "--run-dir", "run", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and says in err, err[-3000:]
    assert _processes_left(proc.pid, within=5.0) == []


def test_plan_with_devices_prints_the_what_if_table_without_ray():
    proc = run_cli("plan", "chars", "--devices", "cuda:12GB,mps:16GB,cpu:1.25GB", "--link", "1gbit", timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "chars: measured on this CPU (0.4M parameters, 2 x TransformerEncoderLayer); no workers started" in out
    assert "link 1 Gbit/s, global batch 64; parts in MB" in out
    for label in ("none", "optimizer", "gradients", "full", "full, optimizer on host", "cpu:1.25GB alone"):
        assert re.search(rf"^{re.escape(label)} +yes ", out, re.M), out
    assert re.search(r"^  cpu:1\.25GB .* \d+/1280 +64$", out, re.M)  # the CPU's figure caps it: 1.25 GB = 1280 MB
    assert re.search(r"^pick: cuda:12GB alone: none on all devices .* over 1 Gbit/s moves 2 x ", out, re.M), out
    assert "Ray" not in proc.stderr and "raylet" not in out + proc.stderr
    bad = run_cli("plan", "chars", "--devices", "cuda:12XB")
    assert bad.returncode == 2 and "--devices 'cuda:12XB'" in bad.stderr and "e.g. 12GB" in bad.stderr
    alone = run_cli("plan", "chars", "--link", "1gbit")
    assert alone.returncode == 2 and "--link and --blocks go with --devices" in alone.stderr


def test_plan_with_devices_starts_no_ray_in_process(capsys, monkeypatch):
    import ray

    from mixtrain.cli.main import main

    # the suite's own Ray may be up in this process already: what counts is that the command starts none
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("plan --devices started Ray"))
    assert main(["plan", "chars", "--devices", "cuda:12GB", "--blocks", "4"]) == 0
    assert "predicted with 4 blocks" in capsys.readouterr().out
