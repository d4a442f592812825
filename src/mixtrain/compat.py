"""What must agree across the driver, the workers and the nodes of a cluster: versions, platform facts and
the model's shape. Imported by the worker, the preflight and the cluster commands alike."""

from __future__ import annotations

import hashlib
import platform
import sys

import torch


def versions() -> dict[str, str]:
    import numpy
    import ray

    from mixtrain import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "mixtrain": __version__,
        "numpy": numpy.__version__,
    }


def platform_info() -> dict[str, str]:
    return {
        "os": platform.platform(),
        "machine": platform.machine(),
        "executable": sys.executable,
    }


def model_signature(model: torch.nn.Module) -> str:
    """A short hash of parameter and buffer names, shapes and dtypes: equal models, equal hashes."""
    parts = [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in (*model.named_parameters(), *model.named_buffers())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _base(version: str) -> str:
    return version.split("+", 1)[0]  # 2.13.0+cu128 and 2.13.0 are the same release


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


# (field, how two values are compared, why it matters)
_RULES = (
    ("python", _minor, "Ray and pickled task factories need the same Python major.minor on every node"),
    ("torch", lambda v: _minor(_base(v)), "the collectives and the model code need the same torch release line"),
    ("ray", str, "Ray refuses nodes of another Ray version"),
    ("mixtrain", str, "workers must run the same mixtrain as the driver"),
)


def version_mismatches(reference: dict[str, str], mine: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """(field, reference's version, mine, why it matters) for each field whose release differs."""
    out = []
    for field, key, why in _RULES:
        theirs, ours = reference.get(field, "?"), mine.get(field, "?")
        if key(ours) != key(theirs):
            out.append((field, theirs, ours, why))
    return out
