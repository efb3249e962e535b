"""One spelling per concept, checked on the parser: docs/cli.md's consistency table is the one the
parser gives, and no command prints without --json, takes a positional model or an old spelling."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.parser import build_parser
from pipeline.cli.parser.surface import FLAGS, commands, markdown, problems, section

DOCS = Path(__file__).resolve().parents[2] / "docs/cli.md"


def test_docs_table_is_the_parsers():
    documented = section(DOCS.read_text())
    assert documented is not None, "docs/cli.md lost its <!-- cli-surface --> markers"
    assert documented == markdown(), (
        "docs/cli.md's consistency table differs from the parser; paste `python -m pipeline.cli.parser.surface`"
    )


def test_every_command_is_in_the_table_with_every_flag_column():
    table = markdown().splitlines()
    assert all(line.count("|") == len(FLAGS) + 3 for line in table)
    names = {line.split("|")[1].strip().strip("`") for line in table[2:]}
    expected = {c.name for c in commands()} | {"skuforge"}
    assert names == expected
    assert {"promote", "releases", "summary", "report", "ci render", "release init", "agent"} <= names


def test_the_parser_keeps_one_spelling_per_concept():
    assert problems() == []


def test_the_check_catches_what_it_forbids():
    parser = argparse.ArgumentParser(prog="skuforge")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("promote")
    p.add_argument("model")
    p.add_argument("--all-skus", action="store_true")
    p.add_argument("--json", action="store_true")
    q = sub.add_parser("render")
    q.add_argument("--output")
    found = problems(parser)
    assert any("`promote` takes the model as a positional" in x for x in found), found
    assert any("`promote` spells --all as --all-skus" in x for x in found), found
    assert any("`render` prints a result and has no --json" in x for x in found), found
    assert any("`render` spells --out as --output" in x for x in found), found


def test_version_flag_is_in_the_table():
    assert "| `skuforge` | - | - | - | - | - | yes |" in markdown(build_parser())
