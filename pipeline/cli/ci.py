"""``skuforge ci``: render the GitHub Actions workflows, and the steps those workflows call."""

from __future__ import annotations

import argparse
import json
import sys

from pipeline.ci.assemble import assemble as do_assemble
from pipeline.ci.render import render as do_render
from pipeline.ci.summary import markdown
from pipeline.project.config import load_registry
from pipeline.verify.consistency import refresh_lines


def _registry(args: argparse.Namespace):

    return load_registry(args.params)


def _json(data: object) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def render(args: argparse.Namespace) -> int:

    result = do_render(_registry(args), args.out, check=args.check)
    stale = bool(args.check and result.differ)
    if args.json:
        _json({**result.to_json(), "check": args.check, "current": not result.differ if args.check else None})
    elif stale:
        print("workflows differ from what the registry renders:", file=sys.stderr)
        for name in result.differ:
            print(f"  {name}", file=sys.stderr)
        print("  hint: run `skuforge ci render` and commit the result", file=sys.stderr)
    elif args.check:
        print(f"{len(result.files)} workflows current")
    else:
        for name in result.files:
            print(f"{'wrote' if name in result.differ else 'unchanged'} {name}")
    return 1 if stale else 0


def summary(args: argparse.Namespace) -> int:

    text = markdown(_registry(args), args.sku, args.report_url)
    if args.json:
        _json({"sku": args.sku, "markdown": text})
    else:
        print(text)
    return 0


def assemble(args: argparse.Namespace) -> int:

    result = do_assemble(_registry(args), args.locks_dir)
    if args.json:
        _json(result)
        return 0
    written = ", ".join(result["written"])
    print(f"locks from the SKUs {', '.join(result['skus'])}: {f'updated {written}' if written else 'unchanged'}")
    for line in refresh_lines(result["consistency"]):
        print(line)
    return 0
