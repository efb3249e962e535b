"""The resolved (model, SKU): what every stage of one pair reads, computed once per command.

A command names a model and a SKU at its edge (the CLI, a DVC stage's command line); it asks the
registry for the pair once (``Registry.pair``) and passes this object down to the build service,
validate, bench, bisection, the remedy and the manifest. Nothing below the edge looks a name up
again, so what a stage used and what ``stages/config.py`` wrote for DVC to hash are one
computation (``resolved`` writes its settings file from this same object).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.project.config.base import Precision
from pipeline.project.config.model import BenchSpec, MetricGate, ModelSpec, TolerancePolicy
from pipeline.project.config.sku import SkuSpec

if TYPE_CHECKING:  # the registry builds pairs; a pair only points back at it for the project root
    from pipeline.project.config.registry import Registry


class Pins(dict[str, int]):
    """A pair's axis values: a dict (JSON, pickling to a spawned build) that refuses changes, so a
    stage that wants other values makes its own copy."""

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a resolved pair's pins are read-only: copy them (dict(pair.pins)) to change them")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type[Pins], tuple[dict[str, int]]]:
        return (Pins, (dict(self),))


@dataclass(frozen=True)
class Pair:
    registry: Registry
    model: str
    sku: str
    spec: ModelSpec
    sku_spec: SkuSpec
    pins: Pins  # model pins, then the SKU's shapes, then profile opt
    higher_precision: tuple[str, ...]
    tolerance: TolerancePolicy
    metric_gate: MetricGate
    bench: BenchSpec

    @property
    def precision(self) -> Precision:
        return self.sku_spec.precision

    @property
    def backend(self) -> str:
        return self.sku_spec.backend

    def settings(self) -> dict[str, Any]:
        """The settings file DVC tracks for this pair's stages (``Layout.config_file``, under build/config/)."""
        return {
            "model": self.model,
            "sku": self.sku,
            "spec": self.spec.model_dump(mode="json", exclude={"higher_precision"}),
            # the device class decides which engine a device gets, not the engine, and known gaps are a
            # note: no stage reruns for either
            "sku_spec": self.sku_spec.model_dump(mode="json", exclude={"device_class", "known_gaps"}),
            "higher_precision": list(self.higher_precision),
            "pins": dict(self.pins),
            "tolerance": self.tolerance.model_dump(mode="json"),
            "metric_gate": self.metric_gate.model_dump(mode="json"),
            "bench": self.bench.model_dump(mode="json"),
        }
