"""The arguments of `skuforge cache` (no library import: `--help` stays fast)."""

from __future__ import annotations

import argparse


def _trials(value: str) -> int:
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a trial count: give a positive integer such as 64")
    return int(value)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="the checked-in compiler caches (TVM tuning databases, TensorRT timing caches)")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    s = csub.add_parser(
        "status",
        help="per SKU and model: present, size, compiler version, target, stale or not, "
        "last tuned, hit rate of the last build",
    )
    s.add_argument("--sku", action="append", help="only this SKU (repeatable)")
    s.add_argument("--model", action="append", help="only this model (repeatable)")
    s.add_argument(
        "--fail-on",
        choices=("corrupt", "not-fresh"),
        help="exit 1 when a cache listed is corrupt, or is anything but fresh (stale, corrupt, missing)",
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler="pipeline.cli.cache:status")
    r = csub.add_parser(
        "refresh",
        help="rebuild a SKU's caches from scratch (TVM tunes; TensorRT times every "
        "tactic); a cache is replaced only when its build succeeds",
    )
    r.add_argument("--sku", required=True)
    r.add_argument("--model", action="append", help="only this model (repeatable; default: every model)")
    r.add_argument("--trials", type=_trials, help="tuning trials per model (default: the SKU's options.trials)")
    r.add_argument("--json", action="store_true")
    r.set_defaults(handler="pipeline.cli.cache:refresh")

    b = sub.add_parser("backends", help="the backends and what each supports (precisions, devices, cache, ...)")
    b.add_argument("--json", action="store_true")
    b.add_argument("--markdown", action="store_true", help="the table of docs/backends.md")
    b.set_defaults(handler="pipeline.cli.cache:backends")
