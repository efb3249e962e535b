"""``skuforge ci``: render the GitHub Actions workflows, and the steps those workflows call."""

from __future__ import annotations

import argparse
import sys

from pipeline.ci.assemble import assemble as do_assemble
from pipeline.ci.render import render as do_render
from pipeline.ci.summary import markdown
from pipeline.cli.compare import refresh_lines
from pipeline.project.config import load_registry


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
    written = ", ".join(result["written"])
    print(f"locks from the SKUs {', '.join(result['skus'])}: {f'updated {written}' if written else 'unchanged'}")
    for line in refresh_lines(result["consistency"]):
        print(line)
    return 0
