"""Kept workers, the parts that need no Ray: the setting, and what a kept worker forgets between fits."""

from __future__ import annotations

import sys

import pytest

from mixtrain import ScalingConfig
from mixtrain.core import warm_workers


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


def test_a_kept_worker_forgets_the_users_own_modules_but_not_installed_packages_or_mixtrain(tmp_path, monkeypatch):
    (tmp_path / "users_model_v1.py").write_text("HIDDEN = 8\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = set(sys.modules)
    import json.tool  # noqa: F401 - the standard library: stays

    import users_model_v1  # type: ignore[import-not-found]

    import mixtrain.examples.chars  # noqa: F401 - mixtrain itself: stays

    assert users_model_v1.HIDDEN == 8
    dropped = warm_workers.forget_user_modules(seen)
    assert "users_model_v1" in dropped and "users_model_v1" not in sys.modules
    assert "json.tool" in sys.modules and "mixtrain.examples.chars" in sys.modules
