"""The arguments of `skuforge bisect` (no library import: `--help` stays fast)."""

from __future__ import annotations

import argparse


def count(value: str) -> int:
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return int(value)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bisect",
        help="find the first node whose output leaves tolerance, and why (--fix: keep it "
        "in higher precision until the gate passes)",
    )
    p.add_argument("--model", required=True)
    p.add_argument("--sku", required=True)
    p.add_argument(
        "--fix",
        action="store_true",
        help="rebuild with the suspects in higher precision and re-validate, round after round, until the gate passes",
    )
    p.add_argument(
        "--apply",
        action="store_true",
        help="with --fix: write the nodes into params.yaml (models.<model>.higher_precision.<sku>)",
    )
    p.add_argument("--max-builds", type=count, help="builds one bisection may take (default: skus.<sku>.bisect)")
    p.add_argument("--marks", type=count, help="tensors marked as outputs per build (default: skus.<sku>.bisect)")
    p.add_argument("--rounds", type=count, help="--fix rounds (default: skus.<sku>.bisect.max_fix_rounds)")
    p.add_argument(
        "--scan",
        action="store_true",
        help="measure every intermediate tensor (passing engine or not): the per-layer error profile",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.bisect:run")
