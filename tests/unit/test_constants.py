"""Env-var/default pairs: a bad value is refused with the variable's name, never used."""

from __future__ import annotations

import pytest

from mixtrain._constants import COLLECTIVE_TIMEOUT_S, env_float


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"])
def test_nan_and_infinite_values_are_refused(monkeypatch, raw):
    # float() takes all of these; a NaN deadline never passes and an infinite one waits forever
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_S[0], raw)
    with pytest.raises(ValueError, match=r"MIXTRAIN_COLLECTIVE_TIMEOUT_S=.*positive, finite number \(default 60"):
        env_float(COLLECTIVE_TIMEOUT_S)


def test_good_bad_and_missing_values(monkeypatch):
    monkeypatch.delenv(COLLECTIVE_TIMEOUT_S[0], raising=False)
    assert env_float(COLLECTIVE_TIMEOUT_S) == 60.0
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_S[0], "2.5")
    assert env_float(COLLECTIVE_TIMEOUT_S) == 2.5
    for raw in ("0", "-1", "ten"):
        monkeypatch.setenv(COLLECTIVE_TIMEOUT_S[0], raw)
        with pytest.raises(ValueError, match="MIXTRAIN_COLLECTIVE_TIMEOUT_S"):
            env_float(COLLECTIVE_TIMEOUT_S)


@pytest.mark.parametrize("raw", ["0.0009", "1e-7", "5e-324"])
def test_a_timeout_under_a_millisecond_is_refused_naming_the_variable_and_the_fix(monkeypatch, raw):
    # timedelta(seconds=0.0004) is 0 ms to torch's store and process group, which c10d may read as no timeout
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_S[0], raw)
    with pytest.raises(ValueError, match=rf"MIXTRAIN_COLLECTIVE_TIMEOUT_S='{raw}' is under 1 ms.*0\.001 s or more"):
        env_float(COLLECTIVE_TIMEOUT_S)
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_S[0], "0.001")
    assert env_float(COLLECTIVE_TIMEOUT_S) == 0.001
    monkeypatch.setenv("MIXTRAIN_BUCKET_MB", "0.0005")  # not a time: small is allowed
    assert env_float(("MIXTRAIN_BUCKET_MB", 25.0)) == 0.0005


def test_every_mixtrain_variable_is_named_in_the_constants_module():
    """Issue 47: four MIXTRAIN_* variables lived outside _constants.py. Each one is named there now (what reads it
    imports the name), so one file lists every setting a user can give through the environment."""
    import pathlib
    import re

    import mixtrain

    package = pathlib.Path(mixtrain.__file__).parent
    named = re.compile(r"""["']MIXTRAIN_[A-Z0-9_]+["']""")
    outside = [
        f"{path.relative_to(package)}: {match}"
        for path in package.rglob("*.py")
        if path.name != "_constants.py"
        for match in named.findall(path.read_text())
    ]
    assert outside == []
