"""The arguments of every ``skuforge`` command. Nothing here imports the library (import-linter
keeps it so): ``skuforge --help`` and argument errors stay fast. Each command names its handler as
"pipeline.cli.<group>:<function>", loaded by pipeline.cli.handler when it runs."""

from __future__ import annotations

import argparse

from pipeline.cli.parser import bisect, cache, ci, commands, compare, keys, rollout


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skuforge",
        description="Build, gate, benchmark and describe ML inference engines per device SKU.",
        epilog="exit codes: 0 ok, 1 gate failed, 2 bad config or input, 3 environment (backend, hardware, "
        "toolchain), 4 external service, 70 internal error, 130 interrupted",
    )
    parser.add_argument("--params", default="params.yaml", help="the registry (default: params.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.register(sub)
    ci.register(sub)
    keys.register(sub)
    bisect.register(sub)
    compare.register(sub)
    cache.register(sub)
    rollout.register(sub)
    return parser
