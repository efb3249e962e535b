"""The one table printer of the CLI (the matrix, releases, skus, cache status, compare).

Numbers are formatted once here, so a column never mixes ``1.8e+04`` with ``7000``: three
significant digits, thousands grouped. Tables are drawn with rich, without box lines; colour only
on a terminal, so a CI log or a pipe gets plain aligned text. Each row is one line (cells are never
wrapped; a table wider than its limit shortens its widest text cells with an ellipsis), which lets
a row carry a note printed indented under it (why a pair failed)."""

from __future__ import annotations

import io
import math
import shutil
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

DEFAULT_WIDTH = 120
"""The width a table fits when it is not --wide and stdout is not a narrower terminal."""

_SIGNIFICANT = 3


def number(value: float | int, signed: bool = False) -> str:
    """A number as a table cell: integers and values of 1000 or more grouped in thousands
    (``18,234``), others to three significant digits in fixed notation (``0.0234``, ``1.23``);
    only magnitudes under 1e-4 (an fp32 engine's max error) use an exponent (``2.4e-07``)."""
    sign = "+" if signed and value > 0 else ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{sign}{value:,}"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude < 1e-4:
        return f"{sign}{value:.1e}"
    decimals = max(0, _SIGNIFICANT - 1 - math.floor(math.log10(magnitude)))
    return f"{sign}{value:,.{decimals}f}"


def cell(value: Any, signed: bool = False) -> str:
    """Any value as a cell: ``-`` for none, numbers by :func:`number`, lists comma-joined."""
    if value is None or value == "":
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return number(value, signed)
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {cell(v)}" for k, v in value.items()) or "-"
    return str(value)


@dataclass(frozen=True)
class Column:
    """One column: the row key it shows, its header, and how its numbers read."""

    key: str
    header: str = ""
    numeric: bool = False  # right-aligned, never cut
    signed: bool = False  # a delta: +0.0022

    @property
    def title(self) -> str:
        return self.header or self.key


def is_terminal(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stdout
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def render(
    columns: Sequence[Column],
    rows: Sequence[dict[str, Any]],
    notes: Sequence[Sequence[str]] | None = None,
    *,
    wide: bool = False,
    width: int | None = None,
    footer: Sequence[str] = (),
    stream: TextIO | None = None,
) -> str:
    """The table as text for ``stream`` (stdout by default): a header line, one line per row, each
    row's ``notes`` indented under it, then ``footer`` lines. Fits ``width`` (default: 120, or the
    terminal's width when narrower; on a terminal the notes are wrapped to it) unless ``wide``."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    tty = is_terminal(stream)
    if width is None:
        width = DEFAULT_WIDTH
        if tty:
            width = min(width, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)
    texts = [[cell(r.get(c.key), c.signed) for c in columns] for r in rows]
    widths = [max([len(c.title)] + [len(t[i]) for t in texts]) for i, c in enumerate(columns)]
    if not wide:
        _fit(columns, widths, width - 2 * (len(columns) - 1))
    table = Table(box=box.SIMPLE_HEAD if tty else None, show_edge=False, pad_edge=False, header_style="bold")
    for c, w in zip(columns, widths, strict=True):
        table.add_column(c.title, justify="right" if c.numeric else "left", no_wrap=True, width=w)
    for t in texts:
        table.add_row(*(_cut(x, w) for x, w in zip(t, widths, strict=True)))
    out = io.StringIO()
    console = Console(
        file=out,
        width=sum(widths) + 2 * len(columns) + 2,
        force_terminal=tty,
        color_system="auto" if tty else None,
        highlight=False,
        emoji=False,
        markup=False,
    )
    console.print(table)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    header_lines = len(lines) - len(rows)  # the header (and on a terminal its rule)
    result = lines[:header_lines]
    for i, line in enumerate(lines[header_lines:]):
        result.append(line)
        for note in (notes[i] if notes else ()) or ():
            # On a terminal wrapped to the table's width; in a log or a pipe one line (greppable, a
            # command in it stays whole: a log viewer wraps it), and whole with --wide.
            wrapped = (
                textwrap.wrap(note, width, initial_indent="    ", subsequent_indent="      ")
                if tty and not wide
                else [f"    {note}"]
            )
            result += [f"\x1b[2m{x}\x1b[0m" if tty else x for x in wrapped]
    result += list(footer)
    return "\n".join(result)


_MIN_TEXT = 8


def _fit(columns: Sequence[Column], widths: list[int], room: int) -> None:
    """Narrow the widest text columns, one character at a time, until the table fits ``room``
    (numbers are never cut; a text column keeps at least 8 characters)."""
    while sum(widths) > room:
        text = [i for i, c in enumerate(columns) if not c.numeric and widths[i] > _MIN_TEXT]
        if not text:
            return
        widest = max(text, key=lambda i: widths[i])
        widths[widest] -= 1


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
