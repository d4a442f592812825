"""`mixtrain` subcommands.

Command lines:
    mixtrain train --example digits --workers 2
    mixtrain train --example digits --workers 2 --shares 40,24 --global-batch 64 --epochs 5 --run-dir runs/a
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _shares(text: str) -> list[int] | str:
    if text in ("auto", "equal"):
        return text
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not auto, equal, or a comma-separated list of integers, e.g. 40,24"
        ) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixtrain", description="Train one PyTorch model on every device you own.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a built-in example", description="Train a built-in example.")
    train.add_argument("--example", default="digits", help="built-in example to train (digits)")
    train.add_argument("--workers", type=_positive_int, default=2, help="number of workers (default 2)")
    train.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs reserved per worker (default 1)")
    train.add_argument("--global-batch", type=_positive_int, help="samples per step over all workers")
    train.add_argument(
        "--shares",
        type=_shares,
        default="auto",
        help="auto (default: follow measured speed), equal (fixed equal split), or samples per worker, e.g. 40,24",
    )
    train.add_argument("--epochs", type=_positive_int, help="passes over the training data")
    train.add_argument("--lr", type=float, help="learning rate")
    train.add_argument("--seed", type=int, default=0, help="seed for initialisation and sample order")
    train.add_argument("--steps-per-round", type=_positive_int, help="steps per driver call (default: about 1.5 s)")
    train.add_argument("--run-dir", help="folder for this run's files (default mixtrain_runs/run-TIMESTAMP)")
    train.add_argument("--address", help="Ray cluster address (default: an embedded local Ray)")
    train.add_argument("--quiet", action="store_true", help="no live progress")
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from mixtrain import RunConfig, ScalingConfig, Trainer
    from mixtrain.examples import load_example

    ex = load_example(args.example, lr=args.lr, seed=args.seed)
    trainer = Trainer(
        ex.task_factory,
        ex.train,
        eval_data=ex.eval,
        global_batch=args.global_batch or ex.global_batch,
        scaling=ScalingConfig(
            num_workers=args.workers, cpus_per_worker=args.cpus_per_worker, shares=args.shares, address=args.address
        ),
        run=RunConfig(
            run_dir=args.run_dir, seed=args.seed, steps_per_round=args.steps_per_round, progress=not args.quiet
        ),
    )
    result = trainer.fit(epochs=args.epochs or ex.epochs)
    metrics = result.metrics
    summary = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k in ("loss", "accuracy"))
    print(f"held-out {summary}")
    print(f"run folder: {result.run_dir}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args)
    except (ValueError, TypeError) as exc:  # bad input: nothing started
        print(f"mixtrain: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ConnectionError) as exc:  # a worker, the cluster or a timeout: a clear line, no traceback
        print(f"mixtrain: error: {exc}", file=sys.stderr)
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
