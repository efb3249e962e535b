"""export: train an example model from code and write it, with its data, into its folder."""

from __future__ import annotations

from typing import Any

from pipeline.core.errors import ConfigError
from pipeline.core.io import atomic_dir
from pipeline.core.progress import Progress
from pipeline.examples.digits import export_example
from pipeline.project.artifacts import RESULT, log
from pipeline.project.config import Registry


def export(registry: Registry, example: str, progress: Progress | None = None) -> dict[str, Any]:

    if example not in registry.examples:
        raise ConfigError(
            f"unknown example {example!r}", hint=f"examples in params.yaml: {', '.join(registry.examples) or '(none)'}"
        )
    spec = registry.examples[example]
    with atomic_dir(registry.path(spec.dir)) as staging:
        result = export_example(
            example, staging, opset=spec.opset, seed=spec.seed, epochs=spec.epochs, progress=progress
        )
    log(example).info("exported: accuracy %s", result.get("accuracy"), extra=RESULT)
    return result
