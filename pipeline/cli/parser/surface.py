"""The CLI's surface derived from the parser: which command takes --json, --model, --sku, --all and
--out, and what breaks the one-spelling rule. docs/cli.md's consistency table is this table (a test
compares them); ``python -m pipeline.cli.parser.surface`` prints it.

Nothing here imports the library (it reads only the argparse tree)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

from pipeline.cli.parser import build_parser

FLAGS = ("--json", "--model", "--sku", "--all", "--out")
"""The flags of the table: one spelling each, on every command they apply to."""

OLD_SPELLINGS = {"--all-skus": "--all", "--output": "--out", "--models": "--model", "--skus": "--sku"}
"""Spellings no command may take again (the one that replaced each)."""

MARKER_START = "<!-- cli-surface:start -->"
MARKER_END = "<!-- cli-surface:end -->"


@dataclass(frozen=True)
class Command:
    name: str  # "rollout status"
    parser: argparse.ArgumentParser

    def option(self, flag: str) -> argparse.Action | None:
        return next((a for a in self.parser._actions if flag in a.option_strings), None)

    @property
    def positionals(self) -> list[str]:
        return [
            a.dest
            for a in self.parser._actions
            if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
        ]

    def cell(self, flag: str) -> str:
        """How the command takes ``flag``: "yes", "required", "repeatable" (append), or "-"."""
        action = self.option(flag)
        if action is None:
            return "-"
        if isinstance(action, argparse._AppendAction):
            return "repeatable, required" if action.required else "repeatable"
        if action.required:
            return "required"
        if flag == "--model" and _exclusive_with(self.parser, action, "--all"):
            return "or --all"
        return "yes"


def _exclusive_with(parser: argparse.ArgumentParser, action: argparse.Action, flag: str) -> bool:
    return any(
        action in g._group_actions and any(flag in a.option_strings for a in g._group_actions)
        for g in parser._mutually_exclusive_groups
    )


def commands(parser: argparse.ArgumentParser | None = None) -> Iterator[Command]:
    """Every command that runs (a leaf of the tree, or a command with an optional sub-action such
    as `agent`), in the parser's order."""

    def walk(p: argparse.ArgumentParser, prefix: tuple[str, ...]) -> Iterator[Command]:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if prefix and (not subs or not subs[0].required):
            yield Command(" ".join(prefix), p)
        for s in subs:
            for name, child in s.choices.items():
                yield from walk(child, (*prefix, name))

    yield from walk(parser or build_parser(), ())


def problems(parser: argparse.ArgumentParser | None = None) -> list[str]:
    """What breaks the one-spelling rule: a command without --json, a positional model, an old
    spelling."""
    found = []
    for c in commands(parser):
        if c.option("--json") is None:
            found.append(f"`{c.name}` prints a result and has no --json")
        if "model" in c.positionals:
            found.append(f"`{c.name}` takes the model as a positional: use --model")
        for old, new in OLD_SPELLINGS.items():
            if c.option(old) is not None:
                found.append(f"`{c.name}` spells {new} as {old}")
    return found


def markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The consistency table of docs/cli.md: one row per command, one column per flag."""
    parser = parser or build_parser()
    head = ["command", *(f"`{f}`" for f in FLAGS), "`--version`"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    version = "yes" if any("--version" in a.option_strings for a in parser._actions) else "-"
    lines.append("| `skuforge` | " + " | ".join("-" for _ in FLAGS) + f" | {version} |")
    for c in commands(parser):
        lines.append(f"| `{c.name}` | " + " | ".join(c.cell(f) for f in FLAGS) + " | - |")
    return "\n".join(lines)


def section(text: str) -> str | None:
    """The table between the markers in a docs page, or None when the markers are missing."""
    if MARKER_START not in text or MARKER_END not in text:
        return None
    return text.split(MARKER_START, 1)[1].split(MARKER_END, 1)[0].strip()


if __name__ == "__main__":
    print(markdown())
