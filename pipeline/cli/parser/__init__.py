"""The arguments of every ``skuforge`` command. Nothing here imports the library (import-linter
keeps it so): ``skuforge --help`` and argument errors stay fast. Each command names its handler as
"pipeline.cli.<group>:<function>", loaded by pipeline.cli.handler when it runs."""

from __future__ import annotations

import argparse
from typing import NoReturn

from pipeline.cli.parser import bisect, cache, ci, commands, compare, keys, rollout


class _Version(argparse.Action):
    """``--version``: the installed package's version, looked up only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("skuforge")
        except PackageNotFoundError:  # run from a source tree that was never installed
            text = "unknown (not installed: pip install -e .)"
        print(f"skuforge {text}")  # stdout, as --help (argparse's exit message goes to stderr)
        parser.exit()


class Parser(argparse.ArgumentParser):
    """argparse with skuforge's hints: every command names its model with ``--model`` (the parsers
    of subcommands inherit this class)."""

    def error(self, message: str) -> NoReturn:
        if "--model" in message and "required" in message:
            message += f"\n  hint: name the model with --model (`{self.prog} --model M ...`), never as a positional"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="skuforge",
        description="Build, gate, benchmark and describe ML inference engines per device SKU.",
        epilog="exit codes: 0 ok, 1 gate failed, 2 bad config or input, 3 environment (backend, hardware, "
        "toolchain), 4 external service, 70 internal error, 130 interrupted",
    )
    parser.add_argument("--params", default="params.yaml", help="the registry (default: params.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.register(sub)
    ci.register(sub)
    keys.register(sub)
    bisect.register(sub)
    compare.register(sub)
    cache.register(sub)
    rollout.register(sub)
    return parser
