"""The arguments of `skuforge ci` (no library import: `--help` stays fast)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    ci = sub.add_parser("ci", help="GitHub Actions workflows rendered from the registry")
    csub = ci.add_subparsers(dest="ci_command", metavar="ACTION", required=True)

    r = csub.add_parser("render", help="write .github/workflows/ from params.yaml (--check: exit 1 if stale)")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 listing the files that differ")
    r.add_argument("--out", type=Path, help="the folder to write (default: .github/workflows at the project root)")
    r.add_argument("--json", action="store_true")
    r.set_defaults(handler="pipeline.cli.ci:render")

    s = csub.add_parser("summary", help="a Markdown job summary of one SKU's manifests (correctness, benchmark)")
    s.add_argument("--sku", required=True)
    s.add_argument("--report-url", metavar="URL", help="link the HTML report (skuforge report) there")
    s.add_argument("--json", action="store_true", help="the Markdown as a JSON string (with the SKU)")
    s.set_defaults(handler="pipeline.cli.ci:summary")

    a = csub.add_parser(
        "assemble",
        help="merge the SKU jobs' <sku>/dvc.lock files into dvc.lock; write the "
        "consistency reports from their golden outputs",
    )
    a.add_argument("locks_dir", type=Path, help="the folder holding <sku>/dvc.lock")
    a.add_argument("--json", action="store_true")
    a.set_defaults(handler="pipeline.cli.ci:assemble")
