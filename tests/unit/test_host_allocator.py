"""A worker's host allocator hands blocks of 16 MB and more back to the system when they are freed (glibc)."""

import json
import os
import platform
import subprocess
import sys

import pytest

from mixtrain._constants import HOST_MMAP_THRESHOLD_MB

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
)

# A transient 24 MB buffer, as a worker allocates now and then (a bucket, a broadcast's piece), allocated and
# freed twice: the resident anonymous memory left afterwards, in a fresh process.
PROBE = """
import json, torch
from mixtrain.devices import host_allocator

def anon_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))

was_set = host_allocator.release_large_blocks()
before = anon_mb()
for _ in range(2):
    block = torch.empty(6 * 2**20).fill_(1.0)  # 24 MB, every page touched
    del block
print(json.dumps({"set": was_set, "kept_mb": anon_mb() - before}))
"""


def kept_after_free(threshold: str) -> dict:
    env = {**os.environ, HOST_MMAP_THRESHOLD_MB[0]: threshold}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_freed_large_block_goes_back_to_the_system_in_a_worker():
    mine = kept_after_free("16")
    assert mine["set"] and mine["kept_mb"] < 4, mine
    # glibc's own rising threshold keeps the second block in its heap: what workers held before
    glibc = kept_after_free("0")
    assert not glibc["set"] and glibc["kept_mb"] > 20, glibc


def test_zero_turns_it_off_and_a_bad_threshold_is_refused_naming_the_variable(monkeypatch):
    from mixtrain.devices import host_allocator

    monkeypatch.setenv(HOST_MMAP_THRESHOLD_MB[0], "0.0")
    assert host_allocator.release_large_blocks() is False
    for raw, says in [("lots", "is not a number"), ("64", "is above glibc's limit of 32 MB")]:
        monkeypatch.setenv(HOST_MMAP_THRESHOLD_MB[0], raw)
        with pytest.raises(ValueError, match=f"MIXTRAIN_HOST_MMAP_THRESHOLD_MB='{raw}' {says}"):
            host_allocator.release_large_blocks()


# A step's activations: a 24 MB block allocated and freed under activations() stays in the heap for the next
# step (no page faults again); after it, two such blocks at once: one reuses the forward's, the other is mapped
# and goes back when freed (with the threshold left at 32 MB it would stay in the heap too).
ACTIVATIONS_PROBE = """
import json, torch
from mixtrain.devices import host_allocator

def anon_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))

assert host_allocator.release_large_blocks()
before = anon_mb()
with host_allocator.activations():
    block = torch.empty(6 * 2**20).fill_(1.0)
del block
kept_after_forward = anon_mb() - before
a, b = torch.empty(6 * 2**20).fill_(1.0), torch.empty(6 * 2**20).fill_(1.0)
del a, b
print(json.dumps({"kept_after_forward": kept_after_forward, "kept_after_two": anon_mb() - before}))
"""


def test_activations_stay_in_the_heap_for_the_next_step_and_the_threshold_comes_back():
    env = {**os.environ, HOST_MMAP_THRESHOLD_MB[0]: "16"}
    out = subprocess.run([sys.executable, "-c", ACTIVATIONS_PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kept_after_forward"] > 20, got  # the forward's block: in the heap, ready for the next step
    assert got["kept_after_two"] < 40, got  # the second block went back: 16 MB again outside the forward


# Sliced state: a 4 MB block (a block's gathered weight, its gradient) freed inside a forward pass goes back to the
# system too, where activations() would keep it in the heap; a worker whose next fit is not sliced keeps them again.
SLICED_PROBE = """
import json, torch
from mixtrain.devices import host_allocator

def anon_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))

def kept_after_forward():
    before = anon_mb()
    with host_allocator.activations():
        block = torch.empty(2**20).fill_(1.0)  # 4 MB
        del block
    return anon_mb() - before

assert host_allocator.release_large_blocks()
host_allocator.sliced_state(True)
sliced = kept_after_forward()
host_allocator.trim()
host_allocator.sliced_state(False)
print(json.dumps({"sliced": sliced, "replicated": kept_after_forward()}))
"""


def test_sliced_state_returns_blocks_of_1_mb_and_more_even_inside_a_forward_pass():
    out = subprocess.run([sys.executable, "-c", SLICED_PROBE], capture_output=True, text=True, check=True)
    kept = json.loads(out.stdout.strip().splitlines()[-1])
    assert kept["sliced"] < 2 and kept["replicated"] > 3, kept


# A model whose trainable weights are all under the threshold: the blocks of 16-32 MB its steps allocate are the
# steps' own (activations, their gradients in backward), so a 24 MB block freed outside a forward pass stays in the
# heap too; a model with one weight of 16 MB or more keeps the 16 MB threshold outside forward passes (its
# gradients' and the optimizer's weight-sized temporaries go back), and a frozen weight as large does not count.
WEIGHTS_PROBE = """
import json, sys, torch
from mixtrain.devices import host_allocator

def anon_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))

assert host_allocator.release_large_blocks()
small = lambda: torch.nn.Linear(1024, 1024)  # 4 MB
large = lambda: torch.nn.Linear(2048, 2100)  # 17.2 MB
models = {
    "small": lambda: [small()],
    "large": lambda: [large()],
    "large-frozen": lambda: [large().requires_grad_(False)],
    "small-and-large": lambda: [small(), large()],  # a loop's two prepared models (a GAN's): the largest counts
}[sys.argv[1]]()
host_allocator.weights_are(*models)
before = anon_mb()
for _ in range(2):
    block = torch.empty(6 * 2**20).fill_(1.0)  # 24 MB: a backward's gradient of an activation
    del block
kept = anon_mb() - before
host_allocator.sliced_state(True)  # sliced state's 1 MB wins over the steps' threshold, and gives it back after
block = torch.empty(2**20).fill_(1.0)
del block
sliced = anon_mb() - before - kept
host_allocator.sliced_state(False)
block = torch.empty(6 * 2**20).fill_(1.0)
del block
print(json.dumps({"kept": kept, "sliced": sliced, "after": anon_mb() - before}))
"""


@pytest.mark.parametrize(
    "model, stays", [("small", True), ("large", False), ("large-frozen", True), ("small-and-large", False)]
)
def test_a_model_of_small_weights_keeps_its_steps_blocks_in_the_heap_throughout(model, stays):
    env = {**os.environ, HOST_MMAP_THRESHOLD_MB[0]: "16"}
    out = subprocess.run([sys.executable, "-c", WEIGHTS_PROBE, model], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert (got["kept"] > 20) is stays and (got["after"] > 20) is stays, got
    assert got["sliced"] < 2, got
