"""The porting guides of docs/your-own-loop.md run as written: Ray's Fashion-MNIST example moved to mixtrain by its
imports (on the digits), and a torchrun script through `mixtrain run` (issue 35)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

MIXTRAIN = str(Path(sys.executable).parent / "mixtrain")


def test_rays_fashion_mnist_example_with_its_imports_changed_trains_to_the_task_paths_accuracy(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "docs/examples/ray_train_digits.py"), "--epochs", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = float(re.search(r"'accuracy': (\d\.\d+)", proc.stdout).group(1))
    assert accuracy >= 0.95, proc.stdout  # the digits Task example: 0.98
    assert proc.stderr.count("report ") == 8, proc.stderr


def test_an_accelerate_loop_with_accumulation_moved_to_mixtrain_trains_as_written(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "docs/examples/accelerate_digits.py"), "--epochs", "5"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(re.search(r"held-out accuracy (\d\.\d+)", proc.stdout).group(1)) >= 0.93, proc.stdout


def test_a_torchrun_script_runs_through_mixtrain_run_with_its_own_arguments(tmp_path, ray_address):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [MIXTRAIN, "run", str(REPO / "docs/examples/torchrun_digits.py"), "--workers", "2", "--address", ray_address,
         "--run-dir", str(tmp_path / "run"), "--", "--epochs", "5", "--out", str(out), "--save",
         str(tmp_path / "w.pt")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["accuracy"] >= 0.93, result
    assert result["count"] == 359, result  # the whole held-out set, summed over the workers
    import torch

    saved = torch.load(tmp_path / "w.pt")  # model.module.state_dict(): the plain model's keys, as with DDP
    torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).load_state_dict(saved)
    assert f"run folder: {tmp_path / 'run'}" in proc.stdout


def test_a_loop_function_runs_from_the_command_line_with_its_config(tmp_path, ray_address):
    (tmp_path / "myloops.py").write_text(
        "import tempfile\n"
        "import mixtrain.train\n"
        "def train_func(config):\n"
        "    ctx = mixtrain.train.get_context()\n"
        "    with tempfile.TemporaryDirectory() as d:\n"
        "        open(d + '/state.txt', 'w').write('epoch 0')\n"
        "        mixtrain.train.report({'rank_seen': ctx.get_world_rank(), 'size': ctx.get_world_size(), **config},\n"
        "                              checkpoint=mixtrain.train.Checkpoint.from_directory(d))\n"
    )
    proc = subprocess.run(
        [MIXTRAIN, "run", "myloops:train_func", "--workers", "3", "--cpus-per-worker", "0.5", "--address",
         ray_address, "--loop-config", '{"lr": 0.5}'],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "last report: rank_seen 0, size 3, lr 0.5000" in proc.stdout, proc.stdout
    # the Ray cluster was started from another folder: the logs and the checkpoint land in this run folder all
    # the same (a relative run folder once reached the workers, and the report sink, relative to their own)
    [run] = (tmp_path / "mixtrain_runs").iterdir()
    [saved] = (run / "checkpoints").glob("checkpoint-*/state.txt")
    assert saved.read_text() == "epoch 0" and len(list((run / "logs").glob("worker-*.log"))) == 3
    bad = subprocess.run([MIXTRAIN, "run", "myloops:train_func", "--loop-config", "[1]"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, check=False)  # fmt: skip
    assert bad.returncode == 2 and "--loop-config: a JSON object, not list" in bad.stderr


STOPPABLE = """
import tempfile, time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import mixtrain.train
from mixtrain.train.torch import prepare_data_loader, prepare_model


def train_func(config):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    torch.manual_seed(1)
    model = prepare_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    start = 0
    checkpoint = mixtrain.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt")
        model.module.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["epoch"] + 1
    for epoch in range(start, config["epochs"]):
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad(); loss.backward(); opt.step()
            time.sleep(config.get("pause", 0.0))
        with tempfile.TemporaryDirectory() as tmp:
            saved = None
            if mixtrain.train.get_context().get_world_rank() == 0:
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
                torch.save(state, Path(tmp) / "state.pt")
                saved = mixtrain.train.Checkpoint.from_directory(tmp)
            mixtrain.train.report({"epoch": epoch}, checkpoint=saved)
    if mixtrain.train.get_context().get_world_rank() == 0:
        torch.save(model.module.state_dict(), Path(config["out"]) / "final.pt")
"""


def test_ctrl_c_stops_a_loop_at_its_next_report_and_resume_continues_to_the_same_weights(tmp_path, ray_address):
    import os
    import signal
    import time

    (tmp_path / "stoppable.py").write_text(STOPPABLE)
    run_dir = tmp_path / "run"
    config = json.dumps({"epochs": 6, "pause": 0.15, "out": str(tmp_path / "a")})
    (tmp_path / "a").mkdir()
    proc = subprocess.Popen(
        [MIXTRAIN, "run", "stoppable:train_func", "--workers", "2", "--cpus-per-worker", "0.5", "--run-dir",
         str(run_dir), "--loop-config", config, "--address", ray_address],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list((run_dir / "checkpoints").glob("checkpoint-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "stopped at a report" in err and f"--resume {run_dir}" in err, err[-2000:]
    assert not (tmp_path / "a" / "final.pt").exists()

    config = json.dumps({"epochs": 6, "out": str(tmp_path / "a")})
    resumed = subprocess.run(
        [MIXTRAIN, "run", "stoppable:train_func", "--workers", "2", "--cpus-per-worker", "0.5", "--resume",
         str(run_dir), "--loop-config", config, "--address", ray_address],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    (tmp_path / "b").mkdir()
    config = json.dumps({"epochs": 6, "out": str(tmp_path / "b")})
    straight = subprocess.run(
        [MIXTRAIN, "run", "stoppable:train_func", "--workers", "2", "--shares", "10,6", "--cpus-per-worker", "0.5",
         "--run-dir", str(tmp_path / "straight"), "--loop-config", config, "--address", ray_address],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    import torch

    got, want = torch.load(tmp_path / "a" / "final.pt"), torch.load(tmp_path / "b" / "final.pt")
    for name in want:  # another split (fixed 10:6 against measured shares), in one go: the same math
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), name


CHATTY = """
import os, sys, time
from pathlib import Path

import pytest
import mixtrain.train

rank = int(os.environ["RANK"])
print(f"rank {rank} says hello")
print(f"rank {rank} warns on stderr", file=sys.stderr)
go = Path(sys.argv[1])
deadline = time.monotonic() + 120
while not go.exists() and time.monotonic() < deadline:  # the test lets it go once it saw rank 0's line
    time.sleep(0.05)
mixtrain.train.report({"went": int(go.exists())})
print(f"rank {rank} done")
"""


def test_mixtrain_run_shows_rank_0s_output_on_the_terminal_as_it_prints_and_every_ranks_in_the_logs(
    tmp_path, ray_address
):
    import queue
    import threading
    import time

    (tmp_path / "chatty.py").write_text(CHATTY)
    go, run_dir = tmp_path / "go", tmp_path / "run"
    proc = subprocess.Popen(
        [MIXTRAIN, "run", "chatty.py", "--workers", "2", "--cpus-per-worker", "0.5", "--address", ray_address,
         "--run-dir", str(run_dir), "--quiet", "--", str(go)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=lambda: [*map(lines.put, proc.stderr), lines.put(None)], daemon=True)
    reader.start()
    seen, deadline = [], time.monotonic() + 180
    while "rank 0 says hello\n" not in seen:  # shown while the loop still waits for `go`: not at the end
        assert time.monotonic() < deadline and proc.poll() is None, (seen, proc.poll())
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            pass
    go.touch()
    seen.extend(iter(lambda: lines.get(timeout=120), None))  # to the end of the CLI's stderr
    out = proc.stdout.read()
    proc.wait(timeout=60)
    assert proc.returncode == 0, "".join(seen)[-3000:]
    assert "last report: went 1" in out, out
    shown = "".join(seen)
    assert "rank 0 warns on stderr" in shown and "rank 0 done" in shown, shown
    assert "rank 1" not in shown, shown  # the other ranks' output is in their logs, where the one note says
    assert shown.count(f"every worker's is in {run_dir / 'logs'}/worker-*.log") == 1, shown
    rank1 = "".join(p.read_text() for p in (run_dir / "logs").glob("worker-1-*.log"))
    assert "rank 1 says hello" in rank1 and "rank 1 done" in rank1, rank1


# ---- what each port says it changed ----------------------------------------------------------------------------
PORTS = ["ray_train_digits.py", "torchrun_digits.py", "accelerate_digits.py"]
"""docs/examples/NAME, ported from docs/examples/originals/NAME."""
MARKED = re.compile(r"\S\s+# (?:was: (?P<was>.+)|added\b.*)$|^\s*# removed: (?P<removed>.+)$")


def _code(path: Path) -> list[str]:
    """The file's lines after its module docstring (which says what the port is, not what it runs)."""
    import ast

    text = path.read_text()
    end = ast.parse(text).body[0].end_lineno
    return text.splitlines()[end:]


def _ported(name: str) -> dict[str, list]:
    """The port's changes against its original, by difflib: each changed or added line of the port with its
    marker, each original line it replaced."""
    import difflib

    original, port = _code(REPO / "docs/examples/originals" / name), _code(REPO / "docs/examples" / name)
    found: dict[str, list] = {"changed": [], "added": [], "removed": [], "unmarked": [], "marked": []}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, original, port, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        old = iter(original[i1:i2])
        for line in port[j1:j2]:
            mark = MARKED.search(line)
            if mark is None:
                found["unmarked"].append(line)
                continue
            found["marked"].append(line.strip())
            kind = "changed" if mark["was"] else "removed" if mark["removed"] else "added"
            found[kind].append((line, None if kind == "added" else next(old, None), mark["was"] or mark["removed"]))
        found["unmarked"] += [f"(an original line not marked as replaced) {line}" for line in old]
    return found


@pytest.mark.parametrize("name", PORTS)
def test_each_port_differs_from_its_original_by_exactly_the_lines_it_marks_and_counts(name):
    found = _ported(name)
    assert not found["unmarked"], found["unmarked"]  # every line that differs is marked, and nothing else
    for line, replaced, was in found["changed"] + found["removed"]:
        assert replaced is not None and was.strip() in replaced, (line, replaced)  # `was:` names what it was
    doc = (REPO / "docs/examples" / name).read_text().split('"""')[1]
    said = re.search(
        r"(\d+) lines? changes?(?:, (\d+) (?:is|are) added)?(?:,? and (\d+) (?:is|are) (added|removed))?", doc
    )
    assert said, doc
    counts = {"changed": int(said[1]), "added": int(said[2] or 0), "removed": 0}
    if said[3]:
        counts[said[4]] = int(said[3])
    assert counts == {k: len(found[k]) for k in counts}, (counts, {k: found[k] for k in counts})


@pytest.mark.parametrize("name", PORTS)
def test_the_guide_lists_every_line_its_port_changed(name):
    """docs/your-own-loop.md shows each port's marked lines in the block after `<!-- port: NAME -->`."""
    page = (REPO / "docs/your-own-loop.md").read_text()
    block = re.search(rf"^<!-- port: {re.escape(name)} -->\s*```\w*\n(.*?)```", page, re.S | re.M)
    assert block, f"docs/your-own-loop.md has no block after <!-- port: {name} -->"
    shown = [line.strip() for line in block[1].splitlines() if line.strip()]
    assert shown == _ported(name)["marked"]


def test_the_checkpoint_example_stopped_by_ctrl_c_goes_on_from_its_last_checkpoint(tmp_path, ray_address):
    import os
    import signal
    import time

    command = [sys.executable, str(REPO / "docs/examples/checkpoint_digits.py"), "--run-dir", str(tmp_path / "run"),
               "--address", ray_address]  # fmt: skip
    proc = subprocess.Popen([*command, "--epochs", "400"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not list((tmp_path / "run" / "checkpoints").glob("checkpoint-*")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "stopped; the same command goes on from" in err, err[-3000:]
    stopped_at = max(int(e) for e in re.findall(r"epoch (\d+) .*checkpoint", err))
    assert stopped_at < 399, err[-2000:]

    resumed = subprocess.run([*command, "--epochs", str(stopped_at + 3)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300, check=False)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the loop went on after the epoch it had reported, and its last checkpoint loads into the plain model
    said = re.search(r"epochs (\d+)-(\d+) in this run; held-out accuracy (\d\.\d+)", resumed.stdout)
    assert said and (int(said[1]), int(said[2])) == (stopped_at + 1, stopped_at + 2), resumed.stdout
    assert float(said[3]) >= 0.9, resumed.stdout
