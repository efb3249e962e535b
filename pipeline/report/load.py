"""What the report reads of one (model, SKU): the stage reports as plain dicts, the latency samples.

Reports are read as dicts, not through their typed models: the report shows runs of older
formats too (a missing key is a piece left out and said so on the page). A file that is not JSON,
or JSON that is not an object, is an InputError naming it: the report never guesses at a damaged file.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError
from pipeline.core.io import read_json
from pipeline.core.paths import Layout

ROOFLINE = "roofline.json"


def read_optional(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such file."""
    if not path.is_file():
        return None
    data = read_json(path)  # MalformedFile (an InputError) naming the file when it is not JSON
    if not isinstance(data, dict):
        raise InputError(
            f"{path} is not a report: it holds a JSON {type(data).__name__}, not an object",
            hint="regenerate it with the step that writes it (or delete it and run again)",
        )
    return data


def read_samples(path: Path, columns: tuple[str, ...]) -> list[dict[str, str]] | None:
    """The rows of a CSV file whose header holds ``columns``; None when the file is missing or has
    another header (an older format: the report leaves that plot out)."""
    if not path.is_file():
        return None
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            if not reader.fieldnames or not set(columns) <= set(reader.fieldnames):
                return None
            return list(reader)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise InputError(
            f"{path} is not a CSV file of latencies ({exc})", hint="rerun the bench stage to write it again"
        ) from exc


def _floats(path: Path, rows: list[dict[str, str]], column: str) -> list[float]:
    values = []
    for n, row in enumerate(rows, start=2):
        try:
            value = float(row[column])
        except (TypeError, ValueError):
            raise InputError(
                f"{path} line {n}: {column} is {row[column]!r}, not a number",
                hint="rerun the bench stage to write it again",
            ) from None
        if math.isfinite(value):
            values.append(value)
    return values


@dataclass
class Timeline:
    iteration: list[int]
    phase: list[str]
    latency_ms: list[float]


@dataclass
class PairData:
    """Everything on disk about one (model, SKU); None (or empty) where a piece is missing."""

    model: str
    sku: str
    build: dict[str, Any] | None = None
    validate: dict[str, Any] | None = None
    bench: dict[str, Any] | None = None
    roofline: dict[str, Any] | None = None
    latency_ms: list[float] | None = None
    timeline: Timeline | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def has_page(self) -> bool:
        return self.bench is not None or self.validate is not None


def load_pair(out: Layout, model: str, sku: str) -> PairData:
    pair = PairData(model, sku)
    pair.build = read_optional(out.report(model, sku, "build"))
    pair.validate = read_optional(out.report(model, sku, "validate"))
    pair.bench = read_optional(out.report(model, sku, "bench"))
    pair.roofline = read_optional(out.sku_dir(model, sku) / ROOFLINE)
    if pair.bench is None:
        return pair
    latency_path = out.latency_csv(model, sku)
    rows = read_samples(latency_path, ("latency_ms",))
    if rows is None:
        pair.notes.append("no latency.csv with a latency_ms column: no latency histogram")
    else:
        pair.latency_ms = _floats(latency_path, rows, "latency_ms")
    timeline_path = out.timeline_csv(model, sku)
    rows = read_samples(timeline_path, ("iteration", "phase", "latency_ms"))
    if rows is None:
        pair.notes.append(
            "no timeline.csv with columns iteration, phase, latency_ms (a bench run before warm-up "
            "was recorded): the timeline shows "
            "the steady samples of latency.csv alone"
        )
    else:
        lat = _floats(timeline_path, rows, "latency_ms")
        its = _floats(timeline_path, rows, "iteration")
        if len(lat) == len(its) == len(rows):
            pair.timeline = Timeline([int(i) for i in its], [r["phase"] for r in rows], lat)
        else:
            pair.notes.append("timeline.csv holds non-finite latencies: timeline left out")
    return pair
