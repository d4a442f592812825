"""The versions and platform facts that must agree across nodes, and that a bug report needs."""

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
