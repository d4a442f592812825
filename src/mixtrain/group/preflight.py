"""Checks before training: every worker has its device, the same software and the same model,
and its kernels agree with the CPU's. Pure functions over the workers' build() reports."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from mixtrain.compat import version_mismatches
from mixtrain.errors import InputValueError
from mixtrain.records.messages import BuildReport, DataReport, NumericsResult, WorkerInfo


class PreflightError(RuntimeError):
    """Workers disagree on versions, model or devices; the message has a table naming node and value."""


def problems(driver: dict[str, str], reports: Sequence[BuildReport]) -> list[str]:
    """One line per problem, each naming the worker, its node and the offending value."""
    out: list[str] = []
    for r in reports:
        where = f"worker {r.rank} on {r.host}"
        if r.problem:
            out.append(f"{where}: {r.problem}")
        for field, theirs, mine, why in version_mismatches(driver, r.versions):
            out.append(f"{where}: {field} {mine} but the driver has {theirs} ({why})")
    signatures = Counter(r.signature for r in reports if r.signature is not None)
    if len(signatures) > 1:
        common = signatures.most_common(1)[0][0]
        ref = next(r for r in reports if r.signature == common)
        for r in reports:
            if r.signature not in (None, common):
                out.append(
                    f"worker {r.rank} on {r.host}: its model differs from worker {ref.rank}'s: "
                    f"{model_difference(ref, r)} (the task factory builds another model there)"
                )
    return out


def model_difference(ref: BuildReport, other: BuildReport) -> str:
    """The first parameters or buffers that differ between two workers' models, by name, shape and dtype."""
    mine = {name: (shape, dtype) for name, shape, dtype in ref.tensors}
    theirs = {name: (shape, dtype) for name, shape, dtype in other.tensors}
    found = []
    for name in [*mine, *(n for n in theirs if n not in mine)]:
        a, b = mine.get(name), theirs.get(name)
        if a == b:
            continue
        if a is None or b is None:
            found.append(f"{name} only on worker {ref.rank if b is None else other.rank}")
        else:
            found.append(f"{name} is {a[0]} {a[1]} on worker {ref.rank}, {b[0]} {b[1]} on worker {other.rank}")
    if not found:
        return f"signature {other.signature} instead of {ref.signature}"
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return "; ".join(found[:3]) + more


def table(driver: dict[str, str], reports: Sequence[BuildReport]) -> str:
    """Every worker with its node, device and versions (the driver first) as aligned text."""
    head = ("who", "node", "device", "python", "torch", "ray", "mixtrain", "model")
    rows = [("driver", "-", "-", driver["python"], driver["torch"], driver["ray"], driver["mixtrain"], "-")]
    for r in reports:
        v = r.versions
        device = r.device.name if r.device is not None else f"MISSING {r.requested}"
        rows.append(
            (
                f"worker {r.rank}",
                r.host,
                device,
                v["python"],
                v["torch"],
                v["ray"],
                v["mixtrain"],
                r.signature or "-",
            )
        )
    widths = [max(len(str(row[i])) for row in (head, *rows)) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *rows))


def check(driver: dict[str, str], reports: Sequence[BuildReport]) -> None:
    """Raise PreflightError with the table and every problem, or return when all agree."""
    found = problems(driver, reports)
    if found:
        raise PreflightError(
            "preflight failed, nothing was trained:\n"
            + "\n".join(f"  - {p}" for p in found)
            + "\n"
            + table(driver, reports)
            + "\nFix: install the same versions on every node (pip install mixtrain==... torch==...), and "
            "make the task factory build the same model everywhere."
        )


def numerics_verdict(results: Sequence[NumericsResult], reports: Sequence[BuildReport]) -> tuple[list[str], list[int]]:
    """Lines for the devices whose gradient disagreed with the CPU's, and their ranks. A NaN error (a NaN or
    infinite gradient) fails too: it compares false with everything, so it must not be the failing comparison."""
    names = {r.rank: r.device.name for r in reports if r.device is not None}
    lines, bad = [], []
    for res in results:
        if not res.error <= res.tolerance:
            bad.append(res.rank)
            lines.append(
                f"worker {res.rank} ({names.get(res.rank, '?')}): gradient differs from the CPU's by "
                f"{res.error:.2e} (relative L2; tolerance {res.tolerance:.0e})"
            )
    return lines, bad


def check_data(reports: Sequence[DataReport], infos: Sequence[WorkerInfo]) -> DataReport:
    """Every worker must hold the same data (it may have been built on each machine from its own files):
    the same sample counts and, where built there, the same fingerprint of a few samples. Returns rank 0's
    report, or raises PreflightError with a table naming each worker and what differs; ValueError when the task
    cannot take the samples (the same job everywhere: one line)."""
    first = reports[0]
    problems = [r.problem for r in reports if r.problem]
    if problems:
        raise InputValueError(problems[0])
    fields = ("num_train", "train_fingerprint", "num_eval", "eval_fingerprint")
    differ = [f for f in fields if any(getattr(r, f) != getattr(first, f) for r in reports)]
    if not differ:
        return first
    head = ("worker", "node", *differ)
    rows = [(f"worker {r.rank}", i.host, *(str(getattr(r, f)) for f in differ)) for r, i in zip(reports, infos)]
    widths = [max(len(str(row[c])) for row in (head, *rows)) for c in range(len(head))]
    table = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *rows))
    raise PreflightError(
        f"the workers' data differ ({', '.join(differ)}), nothing was trained:\n{table}\n"
        "Fix: every machine needs the same files (the same dataset, same length and content), or give the data "
        "as tensors so the driver ships it to every worker."
    )
