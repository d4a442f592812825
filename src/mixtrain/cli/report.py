"""`mixtrain report` and `mixtrain export`: what a run folder holds, as plots and a summary, or as a Hugging Face
model folder."""

from __future__ import annotations

import argparse
from typing import Any


def add_report_parser(sub: Any) -> None:
    report = sub.add_parser(
        "report",
        help="plots and a summary of a run",
        description="Write PNG plots of a run (loss and held-out metric vs. samples seen; samples/s per device; "
        "shares over time) and a short text summary, from its metrics.jsonl.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (it holds metrics.jsonl)")
    report.add_argument("--out", help="folder for the files (default RUN_DIR/report)")


def add_export_parser(sub: Any) -> None:
    export = sub.add_parser(
        "export",
        help="a run's or a checkpoint's weights as a Hugging Face model folder",
        description="Write the weights of a run folder (its final weights) or of one of its checkpoints with "
        "save_pretrained, for AutoModel.from_pretrained; the run must have trained a transformers.PreTrainedModel.",
    )
    export.add_argument(
        "path", metavar="PATH", help="a run folder, or a checkpoint folder (RUN_DIR/checkpoints/step-N)"
    )
    export.add_argument("--out", help="the folder to write (default RUN_DIR/hf_model, or RUN_DIR/hf_step-N)")


def cmd_report(args: argparse.Namespace) -> int:
    from mixtrain.observe.report import write_report

    out = write_report(args.run_dir, args.out)
    print(out.summary)
    for path in out.files:
        print(f"wrote {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mixtrain.pretrained import export_pretrained

    print(f"wrote {export_pretrained(args.path, args.out)}")
    return 0
