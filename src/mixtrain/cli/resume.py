"""`mixtrain train --resume RUN_DIR`: the run's saved flags merged with the ones given now, and the checks that
come before a resume imports and runs the job code the folder names."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mixtrain.cli import from_flags
from mixtrain.cli.parser import Parser, other_flags, subparser
from mixtrain.cli.saved_command import (
    COMMAND_FILE,
    NOW_ONLY,
    REDIRECTS,
    SavedCommand,
    read_command,
    redirect_error,
)
from mixtrain.errors import InputValueError


def resumed(
    raw: list[str], given: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[argparse.Namespace, dict[str, Any]]:
    """`train --resume RUN_DIR [flags]`: the run's saved config keys, then its saved flags, then the flags given
    now (later ones win), with what only this command line may say taken from it alone (saved_command.py).
    `parser` is a fresh one: the saved config becomes its defaults."""
    from mixtrain.cli.config_file import apply_values

    resume = given.resume
    _check_holds_run(resume, given.run_dir)
    saved = read_command(resume)
    if saved is None:  # a run started from Python or by hand: the flags given now are all there is
        return given, {}
    where = Path(resume) / COMMAND_FILE
    if given.task or given.example or (given.config and given.config != saved.legacy_config):
        raise InputValueError(
            f"--resume {resume!r} continues the run's own job ({where} holds its flags); leave out TASK, --example "
            "and --config (other flags given now override the saved ones)"
        )
    config, job_args = saved.config, saved.job_args
    if saved.legacy_config is not None:  # a config file's path, saved before 0.3: read again only if given now
        if given.config is None:
            raise redirect_error(resume, "--config", saved.legacy_config)
        from mixtrain.cli.config_file import read_config, split_config

        config, job_args = split_config(read_config(given.config), given.config)
    apply_values(subparser(parser, "train"), config, where, other_flags(parser, "train"))
    Parser.reading = str(where)
    try:
        before = parser.parse_args(["train", *saved.argv])
    finally:
        Parser.reading = None
    args = parser.parse_args(["train", *saved.argv, *raw[1:]])
    for dest, flag in REDIRECTS.items():
        if getattr(before, dest) is not None and getattr(given, dest) is None:
            raise redirect_error(resume, flag, getattr(before, dest))
    for dest in (*REDIRECTS, *NOW_ONLY):
        setattr(args, dest, getattr(given, dest))
    args.config = given.config
    return args, {"config": config, "job_args": job_args}


def _check_holds_run(resume: str, run_dir: str | None) -> None:
    """One folder, one run: --resume continues in its own folder (never writes into another run's), and a folder
    that holds no checkpoint is bad input, not a job that failed."""
    from mixtrain.checkpoint import MANIFEST

    if not Path(resume).is_dir():
        raise InputValueError(f"--resume {resume!r}: no such run folder")
    if run_dir is not None and Path(run_dir).absolute() != Path(resume).absolute():
        raise InputValueError(
            f"--resume {resume!r} --run-dir {run_dir!r}: a resumed run continues in its own folder (writing into "
            f"another would mix two runs' checkpoints and metrics); leave out --run-dir, or copy {resume} there first"
        )
    if not (Path(resume) / MANIFEST).is_file() and not (Path(resume) / "checkpoints").is_dir():
        raise InputValueError(
            f"--resume {resume!r}: that folder holds no run (no checkpoints/ in it); give the folder a run wrote "
            "(the 'run folder:' line it printed), or start a new run"
        )


def check_resumed_job(args: argparse.Namespace) -> None:
    """Resuming imports and runs the job function the run folder names, with its arguments and flags. Refuse a
    record this user's key did not sign (a folder from elsewhere, or edited), or a module:function whose module
    would now come from another file than the one the run recorded (one that moved, or a module of the same name
    planted in this folder), unless --trust-job was given now. Nothing of the job is imported before this."""
    from mixtrain.job import module_file

    saved = read_command(args.resume)
    if saved is None or args.trust_job:  # no record: the job and the flags are this command line's alone
        return
    target = from_flags.task(args)[0]
    here = module_file(target)
    where = Path(args.resume) / COMMAND_FILE
    if not saved.signed:
        raise InputValueError(
            f"--resume {args.resume!r}: {where} is not signed with your key (unsigned, edited, or written by another "
            f"user or machine), and a resume runs what it names: it would {_what_runs(saved, target, here)}. Check "
            "that, then add --trust-job to run it"
        )
    if ":" in target and (saved.job_file is None or here is None or Path(here) != Path(saved.job_file)):
        raise InputValueError(
            f"--resume {args.resume!r} would import and run {target} from {here or 'nowhere (not found)'}, but the run "
            f"started with {saved.job_file or 'no recorded file'}; resuming runs the job code the folder names. Check "
            f"{where} and that file, then add --trust-job to run it"
        )


def _what_runs(saved: SavedCommand, target: str, here: str | None) -> str:
    """What a resume would run, in words, for the line that asks for --trust-job."""
    call = ", ".join(f"{k}={v!r}" for k, v in saved.job_args.items())
    job = f"train {target}"
    if ":" in target:
        job = f"import and run {target}({call}) from {here or 'nowhere (not found)'}"
    flags = " ".join(saved.argv) or "none"
    config = f", config {json.dumps(saved.config)}" if saved.config else ""
    return f"{job} with the flags {flags}{config}"[:600]
