"""Every timeout and tunable as an env-var/default pair, read when used so tests can shrink it."""

from __future__ import annotations

import math
import os

from mixtrain.errors import InputValueError

# (environment variable, default) pairs. Seconds unless the name says otherwise.
RENDEZVOUS_TIMEOUT_S = ("MIXTRAIN_RENDEZVOUS_TIMEOUT_S", 60.0)
"""How long workers wait for every peer to join the gloo group."""
COLLECTIVE_TIMEOUT_S = ("MIXTRAIN_COLLECTIVE_TIMEOUT_S", 60.0)
"""How long one collective may wait on a peer (gloo's own default is 30 minutes)."""
CONNECT_TIMEOUT_S = ("MIXTRAIN_CONNECT_TIMEOUT_S", 10.0)
"""How long to try reaching the Ray head given as `address` (Ray itself would wait minutes)."""
PLACEMENT_TIMEOUT_S = ("MIXTRAIN_PLACEMENT_TIMEOUT_S", 30.0)
"""How long to wait for Ray to reserve the workers' resources."""
ROUND_TIMEOUT_S = ("MIXTRAIN_ROUND_TIMEOUT_S", 1800.0)
"""Backstop for one round on the driver, on top of the collective timeout."""
ROUND_TARGET_S = ("MIXTRAIN_ROUND_TARGET_S", 1.5)
"""Wanted length of one round of steps when steps_per_round is not set."""
REBALANCE_THRESHOLD = ("MIXTRAIN_REBALANCE_THRESHOLD", 0.10)
"""Re-plan shares when the slowest worker's compute exceeds the mean by more than this fraction."""
EXCLUDE_GAIN = ("MIXTRAIN_EXCLUDE_GAIN", 0.30)
"""Leave a worker out only when the job is predicted at least this fraction faster without it."""
LEAVE_OUT_PAYBACK_S = ("MIXTRAIN_LEAVE_OUT_PAYBACK_S", 2.0)
"""Leave a worker out mid-run only when the predicted speed-up saves at least this long over the training left,
or the measured time the group took to form when that is longer (the price of re-forming it); 0: whenever it is
faster. Before the first step a leave-out costs nothing and this does not apply."""
BUCKET_MB = ("MIXTRAIN_BUCKET_MB", 25.0)
"""Size of one gradient bucket (one all-reduce call)."""
STORE_PAGES_MB = ("MIXTRAIN_STORE_PAGES_MB", 0.0)
"""A parameter-server worker hands back the object store's pages it touched once they pass this many MB
(comm/store_pages.py); 0: two steps' worth (twice its weights, at least 32 MB)."""
LOST_GRACE_S = ("MIXTRAIN_LOST_GRACE_S", 15.0)
"""After a worker died, the others get the collective timeout plus this long to report before they count as lost;
once a peer's collective timeout has fired (it waited that long already), a silent worker gets only this long."""
MIN_LINK_MBPS = ("MIXTRAIN_MIN_LINK_MBPS", 1.0)
"""The slowest link (MB/s, a poor Wi-Fi) the deadline of a large transfer allows for: a state of N MB may take
the collective timeout plus N / this many seconds before its receiver counts as lost."""
FAILURE_WINDOW_S = ("MIXTRAIN_FAILURE_WINDOW_S", 3600.0)
"""RunConfig.max_failures counts the lost-worker recoveries within this window (an hour), not over the whole run."""
SETUP_EXTRA_S = ("MIXTRAIN_SETUP_EXTRA_S", 600.0)
"""On top of the rendezvous timeout: how long building, loading and probing a worker may take (kernels compile)."""
RAY_READY_TIMEOUT_S = ("MIXTRAIN_RAY_READY_TIMEOUT_S", 90.0)
"""How long `cluster up/join` waits for the Ray processes it started to answer."""
SHUTDOWN_WAIT_S = ("MIXTRAIN_SHUTDOWN_WAIT_S", 5.0)
"""At shutdown: how long workers get to leave the group and send their logs before they are killed."""
RENUMBER_TIMEOUT_S = ("MIXTRAIN_RENUMBER_TIMEOUT_S", 30.0)
"""How long telling every worker its new rank may take."""
UNREACHABLE_PROBE_S = ("MIXTRAIN_UNREACHABLE_PROBE_S", 2.0)
"""After a peer could not be reached: how long each connection attempt of the "No route to host" diagnosis
(the peer, then the gateway) may take."""
KEEP_WORKERS_MAX_FITS = ("MIXTRAIN_KEEP_WORKERS_MAX_FITS", 20.0)
"""Kept workers (ScalingConfig.keep_workers) serve at most this many fits, then new ones start: a process that
has built and dropped many tasks is not assumed to stay as fast and as lean as a new one."""
PS_START_TIMEOUT_S = ("MIXTRAIN_PS_START_TIMEOUT_S", 120.0)
"""How long the parameter-server actors may take to build their part of the model and answer."""
WANDB_INIT_TIMEOUT_S = ("MIXTRAIN_WANDB_INIT_TIMEOUT_S", 30.0)
"""How long WandbLogger's wandb.init may take (W&B's own default is 90 s): an unreachable server costs the run
this long once, then the logger is reported as failed and training goes on without it."""


OUTPUT_POLL_S = ("MIXTRAIN_OUTPUT_POLL_S", 0.2)
"""How often a loop's rank 0 looks for new lines in its log file, to show them on the driver's terminal."""


MIN_TIMEOUT_S = 0.001
"""The shortest time (seconds) a MIXTRAIN_*_S variable may set: 1 ms."""


def env_float(pair: tuple[str, float], zero_allowed: bool = False) -> float:
    """The value of an env-var/default pair, with a clear error for a bad value. `zero_allowed`: 0 is a value
    too (a setting that 0 turns off)."""
    name, default = pair
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InputValueError(
            f"{name}={raw!r} is not a number; set it to a positive number (default {default})"
        ) from None
    # float() takes "nan" and "inf": a NaN timeout compares false with everything (a deadline that never
    # passes, a threshold never crossed) and an infinite one waits forever, so both are refused here.
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
        least = "0 or a positive" if zero_allowed else "a positive"
        raise InputValueError(f"{name}={raw!r} must be {least}, finite number (default {default})")
    # A timeout under a millisecond becomes a zero timedelta (torch's stores and process groups count in ms),
    # which c10d may read as "no timeout": the opposite of what a tiny value asks for.
    if name.endswith("_S") and 0 < value < MIN_TIMEOUT_S:
        raise InputValueError(
            f"{name}={raw!r} is under 1 ms, which torch would round to no timeout at all; set it to "
            f"{MIN_TIMEOUT_S:g} s or more (default {default})"
        )
    return value


# Variables that are not numbers, read where they are used; named here so every MIXTRAIN_* has one home.
HOME_ENV = "MIXTRAIN_HOME"
"""This user's own folder (default ~/.mixtrain): the cluster token, the cluster record, the signing key."""
SLOWDOWN_ENV = "MIXTRAIN_EMULATE_SLOWDOWN"
"""EMULATION only: RANK:FACTOR[@ROUND][,...] makes those workers compute FACTOR times slower (benchmarks, tests)."""
PROFILE_DIR_ENV = "MIXTRAIN_PROFILE_DIR"
"""A folder where each worker writes torch.profiler tables of a few rounds (observe/round_profile.py)."""
KEEP_WORKERS_ENV = "MIXTRAIN_KEEP_WORKERS"
"""1: a finished fit keeps its worker processes for the next fit in this process (worker/warm_workers.py)."""


HOST_MMAP_THRESHOLD_MB = ("MIXTRAIN_HOST_MMAP_THRESHOLD_MB", 16.0)
"""Host blocks at least this large get their own mapping in a worker process, returned to the system when freed
(glibc's mmap threshold; 32 MB during a forward pass, for its activations; 0 keeps glibc's own rising threshold).
See devices/host_allocator.py."""
SLICED_MMAP_THRESHOLD_MB = ("MIXTRAIN_SLICED_MMAP_THRESHOLD_MB", 1.0)
"""The same threshold while a worker's state is sliced (shard="gradients" or "full", on a Task or through the loop's
prepare_model(shard=)), forward passes included: the gathered weights, gradients and exchange buffers of 1 MB and
more come and go at every pass, and in the heap they left 300-450 MB free but resident (devices/host_allocator.py).
0: the threshold above."""

RUN_FILE_MAX_MB = ("MIXTRAIN_RUN_FILE_MAX_MB", 256.0)
"""The most a run folder's file read whole may hold (metrics.jsonl, config.json, the report's
inputs): a planted huge file, or a device that never ends, is refused at this size instead of filling memory."""
