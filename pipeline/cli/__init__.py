"""The ``skuforge`` command: parse arguments, call one library function, render, exit.

Argument parsing imports nothing heavy: each command imports the library when it runs.
Exit codes: 0 ok, 1 gate failed, 2 bad config or input, 3 environment, 4 external service,
70 internal error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from ..errors import EXIT_INTERNAL, SkuforgeError
from . import ci, commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skuforge",
        description="Build, gate, benchmark and describe ML inference engines per device SKU.",
        epilog="exit codes: 0 ok, 1 gate failed, 2 bad config or input, 3 environment (backend, hardware, "
               "toolchain), 4 external service, 70 internal error",
    )
    parser.add_argument("--params", default="params.yaml", help="the registry (default: params.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.register(sub)
    ci.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname).1s %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except SkuforgeError as exc:
        print(f"skuforge: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("skuforge: interrupted", file=sys.stderr)
        return 130
    except Exception:
        import traceback

        traceback.print_exc()
        print("skuforge: internal error (a bug): please report it with the traceback above", file=sys.stderr)
        return EXIT_INTERNAL


def run() -> None:
    sys.exit(main())
