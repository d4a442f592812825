"""Kept workers, the parts that need no Ray: the setting, and what a kept worker forgets between fits."""

from __future__ import annotations

import sys

import pytest

from mixtrain import ScalingConfig
from mixtrain.worker import warm_workers


def test_the_setting_comes_from_the_config_or_the_environment_and_a_bad_value_names_the_fix(monkeypatch):
    monkeypatch.delenv("MIXTRAIN_KEEP_WORKERS", raising=False)
    assert warm_workers.wanted(None) is False  # off by default
    monkeypatch.setenv("MIXTRAIN_KEEP_WORKERS", "1")
    assert warm_workers.wanted(None) is True and warm_workers.wanted(False) is False
    monkeypatch.setenv("MIXTRAIN_KEEP_WORKERS", "yes")
    with pytest.raises(ValueError, match=r"MIXTRAIN_KEEP_WORKERS='yes': set it to 1 .* or 0"):
        warm_workers.wanted(None)
    with pytest.raises(ValueError, match=r"ScalingConfig.keep_workers='yes': use True, False or None"):
        ScalingConfig(keep_workers="yes")  # type: ignore[arg-type]


def test_a_kept_worker_forgets_the_users_edited_modules_but_not_installed_packages_or_mixtrain(tmp_path, monkeypatch):
    (tmp_path / "users_model_v1.py").write_text("HIDDEN = 8\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = set(sys.modules)
    import json.tool  # noqa: F401 - the standard library: stays

    import users_model_v1  # type: ignore[import-not-found]

    import mixtrain.examples.chars  # noqa: F401 - mixtrain itself: stays

    assert users_model_v1.HIDDEN == 8
    stats = warm_workers.user_module_stats(seen)  # as the worker takes them once the task is built
    assert list(stats) == ["users_model_v1"]
    # unchanged since: stays loaded (importing some modules twice fails, e.g. registrations)
    assert warm_workers.forget_edited_modules(seen, stats) == []
    (tmp_path / "users_model_v1.py").write_text("HIDDEN = 12\n")  # the user edits it
    dropped = warm_workers.forget_edited_modules(seen, stats)
    assert dropped == ["users_model_v1"] and "users_model_v1" not in sys.modules
    assert "json.tool" in sys.modules and "mixtrain.examples.chars" in sys.modules
    import users_model_v1 as again  # type: ignore[import-not-found]

    assert again.HIDDEN == 12


def test_process_wide_torch_settings_a_task_changed_are_put_back():
    import torch

    saved = warm_workers.torch_settings()
    try:
        torch.set_default_dtype(torch.float64)
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = True
        torch.set_anomaly_enabled(True)
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert warm_workers.torch_settings() != saved
    finally:
        warm_workers.restore_torch_settings(saved)
    assert warm_workers.torch_settings() == saved and torch.get_default_dtype() == torch.float32
