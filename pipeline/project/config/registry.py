"""The Registry: params.yaml parsed, the one object every command resolves models and SKUs from."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
)

from pipeline.core.errors import ConfigError
from pipeline.core.paths import inside
from pipeline.core.validation import did_you_mean
from pipeline.project.config.base import (
    Strict,
)
from pipeline.project.config.model import (
    TASK_KEYS,
    BenchSpec,
    Defaults,
    MetricGate,
    ModelSpec,
    TolerancePolicy,
    default_task_tolerances,
    default_tolerances,
)
from pipeline.project.config.pair import Pair, Pins
from pipeline.project.config.sku import (
    Example,
    KnownGap,
    Release,
    RolloutSpec,
    SelectionSpec,
    SkuSpec,
)


class Registry(Strict):
    # Both keys are required because dvc.yaml names them (DVC has no default for a missing key).
    defaults: Defaults = Field(description="dvc.yaml tracks it: write `defaults: {}` to take the built-in defaults")
    examples: dict[str, Example] = Field(description="dvc.yaml iterates over it: write `examples: {}` if you have none")
    models: dict[str, ModelSpec]
    skus: dict[str, SkuSpec]
    release: Release = Field(default_factory=Release)
    selection: SelectionSpec = Field(default_factory=SelectionSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    _root: Path = PrivateAttr(default_factory=lambda: Path("."))

    @property
    def root(self) -> Path:
        """The folder holding params.yaml: every path in the registry is relative to it."""
        return self._root

    def model(self, name: str) -> ModelSpec:
        return _lookup(self.models, name, "model")

    def sku(self, name: str) -> SkuSpec:
        return _lookup(self.skus, name, "SKU")

    def known_gaps(self) -> dict[str, list[KnownGap]]:
        """SKU -> its declared upstream gaps (skus.<s>.known_gaps), for the SKUs that declare any."""
        return {name: list(spec.known_gaps) for name, spec in self.skus.items() if spec.known_gaps}

    def path(self, *parts: str) -> Path:
        """``parts`` under the root; an InputError when they resolve (symlinks too) outside it."""
        return inside(self.root, *parts)

    def model_file(self, model: str) -> Path:
        spec = self.model(model)
        return self.path(spec.dir, spec.source)

    def pair(self, model: str, sku: str) -> Pair:
        """The (model, SKU) resolved once: its two specs and every setting derived from them. A
        command resolves it at its edge and passes it down; nothing below looks either name up again."""
        spec, s = self.model(model), self.sku(sku)
        return Pair(
            registry=self,
            model=model,
            sku=sku,
            spec=spec,
            sku_spec=s,
            pins=Pins(_pins(spec, s)),
            higher_precision=tuple(spec.higher_precision.get(sku, [])),
            tolerance=self._tolerance(spec, s),
            metric_gate=self._metric_gate(spec, s),
            bench=self._bench(sku, s),
        )

    def tolerance(self, model: str, sku: str) -> TolerancePolicy:
        return self._tolerance(self.model(model), self.sku(sku))

    def _tolerance(self, spec: ModelSpec, s: SkuSpec) -> TolerancePolicy:
        """Per output kind: the built-in default for the SKU's precision, then the keys set in
        defaults, the model and the SKU (each wins over the one before, for every kind)."""
        overrides = [self.defaults.tolerances.get(s.precision), spec.tolerances.get(s.precision), s.tolerance]
        update = {k: v for o in overrides if o is not None for k, v in o.model_dump(exclude_none=True).items()}
        enforce = bool(update.pop("enforce", False))
        # one confidence for every test of the pair; the other task keys are the task's alone
        task_update = {k: update.pop(k) if k != "confidence" else update[k] for k in TASK_KEYS if k in update}
        kinds = {kind: tol.model_copy(update=update) for kind, tol in default_tolerances()[s.precision].items()}
        task = default_task_tolerances()[s.precision].model_copy(update=task_update)
        return TolerancePolicy(
            precision=s.precision, kinds=kinds, declared=dict(spec.output_kinds), task=task, enforce=enforce
        )

    def higher_precision(self, model: str, sku: str) -> list[str]:
        """ONNX nodes of ``model`` kept in higher precision than ``sku``'s (params.yaml override)."""
        self.sku(sku)
        return list(self.model(model).higher_precision.get(sku, []))

    def metric_gate(self, model: str, sku: str) -> MetricGate:
        return self._metric_gate(self.model(model), self.sku(sku))

    def _metric_gate(self, spec: ModelSpec, s: SkuSpec) -> MetricGate:
        base = self.defaults.metric
        m = spec.metric
        for override in (m.gate if m else None, s.metric):
            if override is not None:
                base = base.model_copy(update=override.model_dump(exclude_none=True))
        return base

    def bench(self, sku: str) -> BenchSpec:
        return self._bench(sku, self.sku(sku))

    def _bench(self, sku: str, s: SkuSpec) -> BenchSpec:
        merged = {**self.defaults.bench.model_dump(), **s.bench.model_dump(exclude_none=True)}
        try:
            return BenchSpec.model_validate(merged)
        except ValidationError as exc:
            raise ConfigError(
                f"skus.{sku}.bench with defaults.bench: {exc.errors()[0]['msg']}",
                hint="make min_seconds at most max_seconds (params.yaml)",
            ) from None

    def pins(self, model: str, sku: str | None = None) -> dict[str, int]:
        """Axis values for a (model, SKU): model pins, then the SKU's shapes, then profile opt."""
        return _pins(self.model(model), None if sku is None else self.sku(sku))

    def pairs(self, models: Iterable[str] | None = None, skus: Iterable[str] | None = None) -> list[tuple[str, str]]:
        """Every (model, SKU) the registry builds, model-major in registry order: each model with the
        SKUs ``models.<m>.skus`` selects (all when unset). ``models`` / ``skus`` narrow it (None: all)."""
        wanted_models = set(self.models if models is None else models)
        wanted_skus = set(self.skus if skus is None else skus)
        return [
            (m, s)
            for m, spec in self.models.items()
            if m in wanted_models
            for s in self.skus
            if s in wanted_skus and (spec.skus is None or s in spec.skus)
        ]

    def device_classes(self) -> dict[str, list[str]]:
        """Device class -> its SKUs, in registry order (SKUs without a class are in none)."""
        classes: dict[str, list[str]] = {}
        for name, spec in self.skus.items():
            if spec.device_class is not None:
                classes.setdefault(spec.device_class, []).append(name)
        return classes

    def release_skus(self) -> list[str]:
        """The SKUs a release requires (promote --all)."""
        return list(self.release.skus) if self.release.skus is not None else list(self.skus)


def _pins(spec: ModelSpec, s: SkuSpec | None) -> dict[str, int]:
    pins = dict(spec.pins)
    axes = {a for i in spec.inputs for a in i.axes}
    if spec.batch_axis in axes:
        pins.setdefault(spec.batch_axis, 1)
    if s is not None:
        pins.update({k: v for k, v in s.shapes.items() if k in axes})
        pins.update({k: p.opt for k, p in s.profiles.items() if k in axes})
    return pins


def _lookup(table: dict[str, Any], name: str, what: str) -> Any:
    try:
        return table[name]
    except KeyError:
        raise ConfigError(
            f"unknown {what} {name!r}{did_you_mean(name, table)}",
            hint=f"known {what}s: {', '.join(sorted(table)) or '(none)'}",
        ) from None


def invalid_registry(source: str, problems: list[str]) -> ConfigError:
    return ConfigError(
        f"{source}: invalid registry\n" + "\n".join(f"  - {p}" for p in problems),
        hint="fix the keys named above; see docs/registry.md",
    )
