"""``skuforge ci``: render the GitHub Actions workflows, and the steps those workflows call."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.ci.assemble import assemble as do_assemble
from pipeline.ci.render import render as do_render
from pipeline.ci.summary import markdown
from pipeline.cli.compare import refresh_lines
from pipeline.project.config import load_registry


def register(sub: argparse._SubParsersAction) -> None:
    ci = sub.add_parser("ci", help="GitHub Actions workflows rendered from the registry")
    csub = ci.add_subparsers(dest="ci_command", metavar="ACTION", required=True)

    r = csub.add_parser("render", help="write .github/workflows/ from params.yaml (--check: exit 1 if stale)")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 listing the files that differ")
    r.add_argument("--output", type=Path, help="the folder to write (default: .github/workflows at the project root)")
    r.set_defaults(func=render)

    s = csub.add_parser("summary", help="a Markdown job summary of one SKU's manifests (correctness, benchmark)")
    s.add_argument("--sku", required=True)
    s.add_argument("--report-url", metavar="URL", help="link the HTML report (skuforge report) there")
    s.set_defaults(func=summary)

    a = csub.add_parser(
        "assemble",
        help="merge the SKU jobs' <sku>/dvc.lock files into dvc.lock; write the "
        "consistency reports from their golden outputs",
    )
    a.add_argument("locks_dir", type=Path, help="the folder holding <sku>/dvc.lock")
    a.set_defaults(func=assemble)


def _registry(args: argparse.Namespace):

    return load_registry(args.params)


def render(args: argparse.Namespace) -> int:

    result = do_render(_registry(args), args.output, check=args.check)
    if args.check:
        if result.differ:
            print("workflows differ from what the registry renders:", file=sys.stderr)
            for name in result.differ:
                print(f"  {name}", file=sys.stderr)
            print("  hint: run `skuforge ci render` and commit the result", file=sys.stderr)
            return 1
        print(f"{len(result.files)} workflows current")
        return 0
    for name in result.files:
        print(f"{'wrote' if name in result.differ else 'unchanged'} {name}")
    return 0


def summary(args: argparse.Namespace) -> int:

    print(markdown(_registry(args), args.sku, args.report_url))
    return 0


def assemble(args: argparse.Namespace) -> int:

    result = do_assemble(_registry(args), args.locks_dir)
    print(f"dvc.lock {'updated' if result['changed'] else 'unchanged'} from the SKUs {', '.join(result['skus'])}")
    for line in refresh_lines(result["consistency"]):
        print(line)
    return 0
