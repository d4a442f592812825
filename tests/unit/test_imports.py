"""`import mixtrain` and `mixtrain --help` load neither torch nor Ray (issue 34): the public names are imported
when first used. Each check runs in a fresh interpreter, whose modules are its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "ray", "numpy")


def _loaded_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint('\\n' + ' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.splitlines()[-1].split()) if out.strip() else set()  # the last line: after any help text


@pytest.mark.parametrize(
    "code",
    [
        "import mixtrain",
        "from mixtrain import ScalingConfig, RunConfig, StrategyConfig, DeviceGroup, InputError",
        "from mixtrain.cli.main import build_parser; build_parser().format_help()",
        "import mixtrain.cli.main as m\ntry:\n    m.main(['--help'])\nexcept SystemExit:\n    pass",
        "import mixtrain.cli.main as m\ntry:\n    m.main(['train', '--help'])\nexcept SystemExit:\n    pass",
    ],
)
def test_the_front_door_loads_neither_torch_nor_ray(code):
    assert _loaded_after(code) == set()


def test_public_names_resolve_when_used_and_are_listed():
    import mixtrain

    assert {"Trainer", "Task", "ScalingConfig", "load_weights", "InputError"} <= set(mixtrain.__all__)
    assert set(mixtrain.__all__) <= set(dir(mixtrain))
    assert mixtrain.Trainer.__name__ == "Trainer" and mixtrain.ScalingConfig.__module__ == "mixtrain.config"
    with pytest.raises(AttributeError, match="has no attribute 'Trainr'"):
        mixtrain.Trainr  # noqa: B018
    assert _loaded_after("import mixtrain; mixtrain.Task") >= {"torch"}  # and then they do load
