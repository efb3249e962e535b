"""Typed results of publish, promotion and the release listing (JSON via ``to_json``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipeline.results.reports import Result

GateName = Literal[
    "chain", "manifest", "signature", "correctness", "placement", "engine", "performance", "release_skus"
]


class PublishResult(Result):
    model: str
    sku: str
    digest: str
    tracking_uri: str = Field(description="the store, without credentials")
    experiment_id: str
    run_id: str
    artifact_uri: str
    registered_model: str
    version: str
    created_run: bool = Field(False, description="this call created the run (else it found or resumed one)")
    created_version: bool = Field(False, description="this call registered the version (else it existed)")
    resumed: bool = Field(False, description="an unfinished run with this digest was completed")
    seconds: float = 0.0

    def receipt(self) -> dict[str, Any]:
        """What the publish stage writes: the same for a re-publish of the same manifest."""
        return self.model_dump(mode="json", exclude={"created_run", "created_version", "resumed", "seconds"})


class SelectionPublishResult(Result):
    """Where a model's selection record went in MLflow (pipeline/tracking/selection.py)."""

    model: str
    digest: str = Field(description="the selection record's digest")
    tracking_uri: str = Field(description="the store, without credentials")
    experiment_id: str
    run_id: str
    artifact_uri: str
    classes: dict[str, str | None] = Field(description="device class -> the SKU chosen (None: nothing chosen)")
    created_run: bool = Field(False, description="this call created the run (else it found or resumed one)")
    seconds: float = 0.0

    def line(self) -> str:
        state = "new run" if self.created_run else "run already there"
        return (
            f"published the selection of {self.model} ({self.digest[:12]}): run {self.run_id[:12]}, {state}, "
            f"at {self.tracking_uri}"
        )


class GateResult(Result):
    name: GateName
    passed: bool
    detail: str
    data: dict[str, Any] = Field(default_factory=dict)


class Move(Result):
    """One SKU's part of a promotion or rollback."""

    sku: str
    registered_model: str
    version: str | None = Field(description="the version the alias moves to (None: the alias is removed)")
    previous: str | None = Field(description="the version that held the alias before")
    digest: str | None = None
    gates: list[GateResult] = Field(default_factory=list)
    already: bool = Field(False, description="the version already held the alias: nothing to move")
    moved: bool = False

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)


class PromotionReport(Result):
    model: str
    alias: str
    action: Literal["promote", "rollback"]
    tracking_uri: str
    who: str
    when: str
    why: str
    gates: list[GateResult] = Field(default_factory=list, description="release-level gates")
    moves: list[Move]
    passed: bool


class HistoryEntry(Result):
    id: int
    action: Literal["promote", "rollback"]
    version: str | None
    previous: str | None
    who: str
    when: str
    why: str
    reverts: int | None = None


class VersionRow(Result):
    version: str
    digest: str | None
    created: str
    run_id: str | None
    aliases: list[str]
    correctness: str | None
    p50_ms: float | None
    git_commit: str | None


class SkuRelease(Result):
    sku: str
    registered_model: str
    aliases: dict[str, str]
    versions: list[VersionRow]
    history: dict[str, list[HistoryEntry]] = Field(default_factory=dict)


class ReleaseListing(Result):
    model: str
    tracking_uri: str
    chain: list[str]
    required_skus: list[str]
    skus: list[SkuRelease]
    missing: list[str] = Field(description="SKUs the release requires that have no published version")
