"""``skuforge compare``: the cross-SKU consistency matrix of one model (a report, not a gate)."""

from __future__ import annotations

import argparse
import json
import sys

from pipeline.cli import tables
from pipeline.cli.tables import Column
from pipeline.project.config import load_registry
from pipeline.verify.consistency import consistency, describe, nonfinite_line, table, write_report


def compare(args: argparse.Namespace) -> int:

    registry = load_registry(args.params)
    report = consistency(registry, args.model)
    if args.write:
        for path in write_report(registry, report):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        print(text(report))
    return 0


def _aligned(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """A matrix of ``consistency.table`` (header row first) through the CLI's table printer: SKUs
    down and across, every column kept (a cell is never cut)."""
    header, *body = rows
    columns = [Column("c0", header[0] or " ")] + [
        Column(f"c{i}", title, numeric=True) for i, title in enumerate(header[1:], 1)
    ]
    cells = [{f"c{i}": x for i, x in enumerate(r)} for r in body]
    return [indent + line for line in tables.render(columns, cells, wide=True).splitlines()]


def text(report) -> str:
    """Per output, the max abs error matrix (top-1 agreement in brackets for classification scores)."""

    skus = ", ".join(
        f"{s.sku} ({s.backend} {s.precision}{'' if s.validate_passed else ', validate FAILED'})" for s in report.skus
    )
    lines = [
        f"{report.model}: {report.samples} golden samples; {len(report.skus)} SKUs compared"
        + (f": {skus}" if skus else "")
    ]
    lines += [f"  not compared: {s.sku}: {s.reason}" for s in report.skipped]
    if not report.skus:
        return "\n".join(lines)
    for m in report.outputs:
        lines.append(describe(m).replace("`", ""))
        lines += _aligned(table(m))
        extra = nonfinite_line(m)
        if extra:
            lines.append(f"  {extra}")
    return "\n".join(lines)
