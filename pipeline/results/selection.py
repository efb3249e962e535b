"""The selection record: per model, the engine chosen for each device class, with its evidence.

One JSON document per model (``build/.selection/<model>.json``), validated against a published
schema (``pipeline/schemas/selection.schema.json``). Like the manifest it carries ``digest``, the
sha256 of the document without it, and it names the digest of every manifest it weighed: a reader
refuses a record whose manifests changed since (pipeline.verify.selection.read_selection). No
timestamp: the same manifests and samples give the same document.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

from pydantic import Field

from pipeline.core.errors import InputError
from pipeline.core.io import read_json, sha256_json
from pipeline.results.reports import Result

SCHEMA_FILE = "selection.schema.json"

Decision = Literal["separated", "tie", "only candidate", "none passed", "no candidates"]
Evidence = Literal["samples", "intervals"]


class SelectionCandidate(Result):
    """One SKU of the class with a manifest for the model (or, ``manifest_digest`` None, without one)."""

    sku: str
    backend: str
    precision: str
    manifest_digest: str | None = Field(description="the manifest's own digest; None: no manifest, not a candidate")
    outcome: str = Field(description="the pair's outcome in the matrix (pipeline.engine.matrix): 'passed', ...")
    eligible: bool = Field(description="its gates passed: it may be chosen")
    reason: str = Field("", description="why it may not be chosen (empty when eligible)")
    value: float | None = Field(
        None, description="the objective's figure: ms for p50 and p99, samples per second for throughput"
    )
    interval: tuple[float, float] | None = Field(None, description="the figure's interval, where one is known")
    confidence: float | None = Field(None, description="level of ``interval`` (the SKU's bench.confidence)")
    evidence: Evidence | None = Field(
        None,
        description="samples: the bench's steady-state samples (latency.csv, bound to the manifest's engine); "
        "intervals: the manifest's figure and interval alone",
    )
    samples: int | None = Field(None, description="steady-state samples behind the figure")
    latency_sha256: str | None = Field(None, description="sha256 of the samples file used (evidence: samples)")
    host: str | None = Field(None, description="the CPU the engine was timed on (the manifest's host)")


class Margin(Result):
    """How far the chosen engine is ahead of the runner-up on the objective."""

    ratio: float = Field(
        description="the runner-up's figure over the chosen one's for latency, the chosen one's over the "
        "runner-up's for throughput: above 1, the chosen one is better"
    )
    interval: tuple[float, float] | None = Field(
        description="two-sided interval of the ratio; None: none could be made"
    )
    confidence: float
    method: str = Field(description="how the interval was made")
    separated: bool = Field(description="the interval lies wholly above 1")


class ClassSelection(Result):
    """The choice for one device class."""

    device_class: str
    decision: Decision
    chosen: str | None
    runner_up: str | None
    margin: Margin | None
    tied: list[str] = Field(
        default_factory=list, description="the eligible candidates not separated from the fastest (decision tie)"
    )
    rule: str = Field(description="the decision rule, in words")
    why: str = Field(description="the decision's reason in short: the margin and whether it is separated, a tie, ...")
    notes: list[str] = Field(default_factory=list, description="what makes the comparison doubtful")
    candidates: list[SelectionCandidate]

    @property
    def summary(self) -> str:
        """``x86_ov_int8 selected for x86-avx2 (1.4x over runner-up x86_ort_int8 [1.3, 1.5], separated)``."""
        if self.chosen is None:
            return f"none selected for {self.device_class}: {self.why}"
        return f"{self.chosen} selected for {self.device_class} ({self.why})"


class SelectionRecord(Result):
    schema_version: Literal[1] = 1
    model: str
    digest: str = Field(description="sha256 of this document without 'digest'")
    objective: str
    confidence: float
    prefer: list[str] = Field(description="the backends' order of preference that breaks a tie")
    manifests: dict[str, str] = Field(description="SKU -> digest of each manifest weighed (every class's)")
    classes: list[ClassSelection]

    def get(self, device_class: str) -> ClassSelection | None:
        return next((c for c in self.classes if c.device_class == device_class), None)


def schema() -> dict[str, Any]:
    """The JSON Schema of the selection record, generated from the typed model."""
    doc = SelectionRecord.model_json_schema()
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["$id"] = "https://skuforge.dev/schemas/selection-1.json"
    return doc


@lru_cache(maxsize=1)
def published_schema() -> dict[str, Any]:
    return json.loads(resources.files("pipeline.schemas").joinpath(SCHEMA_FILE).read_text())


def digest(body: dict[str, Any]) -> str:
    return sha256_json({k: v for k, v in body.items() if k != "digest"})


def sealed(record: SelectionRecord) -> SelectionRecord:
    """``record`` with its digest set."""
    return record.model_copy(update={"digest": digest(record.to_json())})


@lru_cache(maxsize=1)
def _schema_validator() -> Any:
    """One validator of the published schema per process (the schema itself is checked by a test)."""
    import jsonschema

    schema_doc = published_schema()
    return jsonschema.validators.validator_for(schema_doc)(schema_doc)


def validate_document(doc: Any, where: str = "selection record") -> SelectionRecord:
    """Check a selection record against the published schema and its own digest."""
    import jsonschema

    exc = jsonschema.exceptions.best_match(_schema_validator().iter_errors(doc))
    if exc is not None:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InputError(
            f"{where} does not match the selection schema at {path}: {exc.message}",
            hint="compute it again: skuforge select --model M",
        )
    if doc["digest"] != digest(doc):
        raise InputError(
            f"{where}: digest does not match its content (edited by hand?)",
            hint="compute it again: skuforge select --model M",
        )
    return SelectionRecord.model_validate(doc)


def load_document(path: Any) -> SelectionRecord:
    """The record at ``path``, schema-valid and matching its digest (its manifests are not checked here)."""
    try:
        doc = read_json(path)
    except FileNotFoundError:
        raise InputError(f"{path} does not exist", hint="compute it: skuforge select --model M") from None
    return validate_document(doc, str(path))
