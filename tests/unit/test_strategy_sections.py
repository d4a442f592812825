"""StrategyConfig's sections (PSConfig, LocalSGDConfig), and the flat keywords of before: kept for one version
with a warning that names the new place, from Python, from the flags, from TOML files and from saved runs."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, replace

import pytest

from mixtrain import LocalSGDConfig, PSConfig, StrategyConfig
from mixtrain.cli.main import _parse, _trainer
from mixtrain.observe.report import read_run, summarize


@pytest.mark.parametrize(
    "make,fragment",
    [
        (lambda: PSConfig(shards=0), "PSConfig.shards=0 (--ps-shards): use 'auto' or an integer >= 1"),
        (lambda: PSConfig(shards="many"), "PSConfig.shards='many'"),
        (lambda: PSConfig(shards=True), "PSConfig.shards=True"),
        (lambda: PSConfig(node=""), "PSConfig.node=''"),
        (lambda: PSConfig(staleness=-1), "PSConfig.staleness=-1: must be an integer >= 0 (0: synchronous)"),
        (lambda: LocalSGDConfig(local_steps=0), "LocalSGDConfig.local_steps=0"),
        (lambda: LocalSGDConfig(outer_lr=0.0), "LocalSGDConfig.outer_lr=0.0: must be a number > 0"),
        (lambda: LocalSGDConfig(outer_momentum=1.0), "LocalSGDConfig.outer_momentum=1.0"),
        (lambda: LocalSGDConfig(overlap=1), "LocalSGDConfig.overlap=1: must be True or False"),
        (lambda: LocalSGDConfig(pace="fast"), "LocalSGDConfig.pace='fast' (--pace): use one of balanced, per-device"),
        (lambda: StrategyConfig(ps=2), "StrategyConfig.ps=2: give a mixtrain.PSConfig"),
        (lambda: StrategyConfig(local_sgd=PSConfig()), "StrategyConfig.local_sgd=PSConfig("),
    ],
)
def test_bad_section_values_name_the_section_and_the_field(make, fragment):
    with pytest.raises(ValueError) as err:
        make()
    assert fragment in str(err.value)


def test_sections_hold_each_strategys_own_settings():
    ps = StrategyConfig(name="ps-async", ps=PSConfig(shards=2, node="n1", staleness=0))
    assert (ps.ps.shards, ps.ps.node, ps.ps.staleness, ps.describe()) == (2, "n1", 0, "ps-async (staleness 0)")
    local = StrategyConfig(name="local-sgd", local_sgd=LocalSGDConfig(local_steps=16, overlap=True))
    assert (local.steps_per_exchange, local.min_round_steps) == (16, 64)
    assert local.describe() == "local-sgd (H=16, overlapped)"
    assert local.as_allreduce().local_sgd == LocalSGDConfig(local_steps=16)  # overlap and pace back to defaults
    assert StrategyConfig() == StrategyConfig(ps=PSConfig(), local_sgd=LocalSGDConfig())
    # config.json and the loggers see the sections, and only them
    assert asdict(ps) == {
        "name": "ps-async",
        "compress": "none",
        "ps": {"shards": 2, "node": "n1", "staleness": 0},
        "local_sgd": {"local_steps": 8, "outer_lr": 1.0, "outer_momentum": 0.0, "overlap": False, "pace": "balanced"},
    }


@pytest.mark.parametrize(
    "old,value,section,field",
    [
        ("staleness", 0, "ps", "staleness"),
        ("ps_shards", 3, "ps", "shards"),
        ("ps_node", "n1", "ps", "node"),
        ("local_steps", 16, "local_sgd", "local_steps"),
        ("outer_lr", 0.7, "local_sgd", "outer_lr"),
        ("outer_momentum", 0.9, "local_sgd", "outer_momentum"),
        ("overlap", True, "local_sgd", "overlap"),
        ("pace", "per-device", "local_sgd", "pace"),
    ],
)
def test_a_flat_keyword_warns_with_its_new_place_and_lands_in_its_section(old, value, section, field):
    name = "ps-async" if section == "ps" else "local-sgd"
    cls = {"ps": "PSConfig", "local_sgd": "LocalSGDConfig"}[section]
    with pytest.warns(DeprecationWarning) as caught:
        config = StrategyConfig(name=name, **{old: value})
    assert [str(w.message) for w in caught] == [
        f"StrategyConfig.{old} is deprecated: use StrategyConfig({section}={cls}({field}=...))"
    ]
    assert caught[0].filename == __file__  # points at the caller's line
    assert getattr(getattr(config, section), field) == value
    assert config == StrategyConfig(name=name, **{section: getattr(__import__("mixtrain"), cls)(**{field: value})})


def test_flat_keywords_and_a_section_merge_unless_they_disagree():
    with pytest.warns(DeprecationWarning):
        merged = StrategyConfig(name="ps", ps_shards=2, staleness=1, ps=PSConfig(node="n1"))
    assert merged.ps == PSConfig(shards=2, node="n1", staleness=1)
    with pytest.warns(DeprecationWarning):
        same = StrategyConfig(name="local-sgd", local_steps=4, local_sgd=LocalSGDConfig(local_steps=4))
    assert same.local_sgd.local_steps == 4
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError) as err:
        StrategyConfig(name="ps", ps_shards=2, ps=PSConfig(shards=3))
    assert str(err.value) == "StrategyConfig.ps_shards=2 with ps=PSConfig(shards=3): give ps=PSConfig(shards=...) alone"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"overlap=False with local_sgd=.*\(overlap"):
        StrategyConfig(name="local-sgd", overlap=False, local_sgd=LocalSGDConfig(overlap=True))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"PSConfig\.shards=0"):
        StrategyConfig(name="ps", ps_shards=0)  # a bad flat value is checked where it lands
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"local_sgd\.overlap=True .* not 'ps'"):
        StrategyConfig(name="ps", overlap=True)


def test_the_sections_and_replace_raise_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = StrategyConfig(name="local-sgd", local_sgd=LocalSGDConfig(local_steps=4), ps=PSConfig(shards=2))
        again = replace(config, name="auto", compress="bf16")
        assert (again.local_sgd.local_steps, again.ps.shards) == (4, 2)
        assert again.as_local_sgd(32, "int8").describe() == "local-sgd (H=32, overlapped), int8 on the wire"


def test_the_strategy_flags_fill_the_sections_without_a_warning():
    argv = ["train", "digits", "--strategy", "ps-async", "--ps-shards", "2", "--staleness", "0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        strategy = _trainer(_parse(argv)[0])[1].strategy
        assert strategy.ps == PSConfig(shards=2, staleness=0) and strategy.local_sgd == LocalSGDConfig()
        plain = _trainer(_parse(["train", "digits"])[0])[1].strategy
    assert plain == StrategyConfig()


def test_a_toml_file_keeps_its_flat_keys(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'task = "digits"\nstrategy = "local-sgd"\nlocal_steps = 4\nouter_lr = 0.7\nouter_momentum = 0.9\n'
        'pace = "per-device"\noverlap = true\nps-shards = 2\nstaleness = 1\n'
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        strategy = _trainer(_parse(["train", str(path)])[0])[1].strategy
    want = LocalSGDConfig(local_steps=4, outer_lr=0.7, outer_momentum=0.9, overlap=True, pace="per-device")
    assert strategy.local_sgd == want and strategy.ps == PSConfig(shards=2, staleness=1)


def test_a_saved_run_with_flat_keys_resumes_into_the_sections(tmp_path, monkeypatch):
    # command.json records the flags and a TOML file's keys (flat names): a run saved before the sections
    # resumes with the same settings
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    record = {"argv": ["digits", "--strategy", "local-sgd", "--local-steps", "4"], "config": {"outer_lr": 0.7}}
    (tmp_path / "run" / "command.json").write_text(json.dumps(record))
    args, _ = _parse(["train", "--resume", "run", "--overlap"])
    strategy = _trainer(args)[1].strategy
    assert strategy.local_sgd == LocalSGDConfig(local_steps=4, outer_lr=0.7, overlap=True)


@pytest.mark.parametrize(
    "strategy",
    [
        {"name": "ps-async", "compress": "none", "staleness": 2, "local_steps": 8, "ps_shards": "auto"},  # before
        asdict(StrategyConfig(name="ps-async", ps=PSConfig(shards=2))),
    ],
    ids=["flat", "sections"],
)
def test_report_reads_a_config_json_with_flat_or_sectioned_strategy(tmp_path, strategy):
    workers = [{"samples": 64, "compute_s": 0.3, "wait_s": 0.0, "comm_s": 0.1}]
    record = {"kind": "round", "time": 1.0, "epoch": 0, "first_step": 0, "num_steps": 1, "samples": 64, "loss": 1.0,
              "samples_per_s": 160.0, "wall_s": 0.4, "shares": [64], "workers": workers}  # fmt: skip
    config = {"num_samples": 64, "global_batch": 64, "epochs": 1, "strategy": strategy}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    config, records = read_run(tmp_path)
    assert "strategy ps-async, backend" in summarize(tmp_path, config, records)
