"""``skuforge select``: the engine chosen per device class for one model, with its evidence; and the
selection lines under the matrix (`repro`, `summary`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.cli import tables
from pipeline.cli.tables import Column
from pipeline.core.errors import ConfigError
from pipeline.ops.reproduce import publish_record
from pipeline.project.config import KnownGap, load_registry
from pipeline.results.selection import ClassSelection, SelectionRecord
from pipeline.verify.selection import check_class, select, write_selection

CANDIDATE_COLUMNS = (
    Column("mark", " "),
    Column("sku"),
    Column("backend"),
    Column("precision", "prec"),
    Column("value", "figure", numeric=True),
    Column("low", "low", numeric=True),
    Column("high", "high", numeric=True),
    Column("samples", "n", numeric=True),
    Column("evidence"),
    Column("gates"),
)

SELECTION_COLUMNS = (Column("model"), Column("device_class", "class"), Column("chosen", "selected"), Column("why"))


def select_command(args: argparse.Namespace) -> int:
    """Compute and write the model's selection record; print it (one class with ``--class``). Exit 1
    when a class shown has no engine to choose: every SKU of it that was judged failed."""
    registry = load_registry(args.params)
    record = select(registry, args.model)
    if not record.classes:
        raise ConfigError(
            f"no SKU of model {args.model} names a device class: nothing to select among",
            hint="set skus.<s>.device_class in params.yaml for the SKUs that serve the same devices (docs/registry.md)",
        )
    shown = [check_class(record, args.device_class)] if args.device_class else record.classes
    path = write_selection(registry, record)
    print(f"wrote {path.relative_to(registry.root)}", file=sys.stderr)
    if args.publish:
        print(publish_record(registry, record).line(), file=sys.stderr)
    if args.json:  # the record as written, its classes narrowed to --class (digest: the file's)
        print(json.dumps({**record.to_json(), "classes": [c.to_json() for c in shown]}, indent=2, sort_keys=True))
    else:
        print(record_text(record, shown, registry.known_gaps()))
    return 1 if any(c.decision == "none passed" for c in shown) else 0


Gaps = Mapping[str, Sequence[KnownGap]]  # SKU -> skus.<s>.known_gaps (Registry.known_gaps)


def upstream_notes(c: ClassSelection, sku: str, gaps: Gaps) -> list[str]:
    """``slower upstream: <ref>: <says>`` for a candidate of ``c`` that was not chosen and whose
    stack has a declared upstream gap: why it lost, said next to it (the choice is unchanged)."""
    if sku == c.chosen:
        return []
    return [f"slower upstream: {gap.line}" for gap in gaps.get(sku, ())]


def record_text(record: SelectionRecord, shown: list[ClassSelection], gaps: Gaps | None = None) -> str:
    """Per class: the decision in one line, its candidates (the chosen one marked *; under a losing one,
    its stack's known gap upstream), how the margin was measured, notes; then the rule."""
    gaps = gaps or {}
    unit = "samples/s" if record.objective == "throughput" else "ms"
    lines = [
        f"{record.model}: objective {record.objective} ({unit}), {record.confidence:.0%} intervals; "
        f"digest {record.digest[:12]}"
    ]
    for c in shown:
        lines += ["", f"{c.device_class}: {c.summary}"]
        cells = [
            {
                "mark": "*" if x.sku == c.chosen else " ",
                "sku": x.sku,
                "backend": x.backend,
                "precision": x.precision,
                "value": x.value,
                "low": x.interval[0] if x.interval else None,
                "high": x.interval[1] if x.interval else None,
                "samples": x.samples,
                "evidence": x.evidence,
                "gates": "passed" if x.eligible else x.reason,
            }
            for x in c.candidates
        ]
        below = [upstream_notes(c, x.sku, gaps) for x in c.candidates]
        lines += ["  " + line for line in tables.render(CANDIDATE_COLUMNS, cells, below).splitlines()]
        if c.margin is not None:
            lines.append(f"  margin: {c.margin.method}")
        lines += [f"  note: {n}" for n in c.notes]
    rules = list(dict.fromkeys(c.rule for c in shown))
    return "\n".join([*lines, "", *(f"rule: {r}" for r in rules)])


def selection_text(records: list[SelectionRecord], wide: bool = False, gaps: Gaps | None = None, **render: Any) -> str:
    """The selection under the matrix: per model and device class, the engine chosen and why; under
    it, the losing candidates whose stack has a known gap upstream (``gaps``: Registry.known_gaps)."""
    gaps = gaps or {}
    pairs = [(r, c) for r in records for c in r.classes]
    if not pairs:
        return ""
    rows = [
        {"model": r.model, "device_class": c.device_class, "chosen": c.chosen or "none", "why": c.why} for r, c in pairs
    ]
    below = [[f"{x.sku} {n}" for x in c.candidates for n in upstream_notes(c, x.sku, gaps)] for _, c in pairs]
    objectives = ", ".join(sorted({r.objective for r in records}))
    title = f"\n\nSelected per device class (objective {objectives}; `skuforge select --model M`: the evidence)\n"
    return title + tables.render(SELECTION_COLUMNS, rows, below, wide=wide, **render)
