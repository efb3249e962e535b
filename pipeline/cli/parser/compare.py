"""The arguments of `skuforge compare` (no library import: `--help` stays fast)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="every SKU's golden outputs against the reference and each other (max/mean abs error, top-1 agreement)",
    )
    p.add_argument("--model", required=True)
    p.add_argument(
        "--write", action="store_true", help="also write reports/consistency/<model>.json and .md (checked in)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler="pipeline.cli.compare:compare")
