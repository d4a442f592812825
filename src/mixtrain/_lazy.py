"""PEP 562 lazy names for a package's __init__: each public name is imported from its module the first time it is
used, then kept in the package's globals (later lookups are plain attribute reads). Imports nothing else."""

from __future__ import annotations

import importlib
from typing import Any


def load(package: str, public: dict[str, str], namespace: dict[str, Any], name: str) -> Any:
    """`name` from the module `public` maps it to, kept in `namespace`; AttributeError when it is not public."""
    module = public.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value
