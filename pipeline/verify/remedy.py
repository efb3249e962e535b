"""The remedy for a divergent engine: keep the bisection's suspects in higher precision, rebuild,
re-validate, repeat until the gate passes or the rounds are spent.

What is kept is a list of ONNX node names of the prepared model per (model, SKU):
``models.<model>.higher_precision.<sku>`` in params.yaml. Backends apply it with their own
mechanism (INT8: the nodes stay out of QDQ quantization; FP16: the converter's node block list,
OpenVINO's ``disable_fp16_compression``, TensorRT's per-layer precision). The build records it in
the build report and the manifest, so the engine is reproducible from params.yaml alone.
"""

from __future__ import annotations

import io
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends import get_backend
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.io import atomic_write_bytes
from pipeline.project.artifacts import layout, load_arrays, read_report, run_plan
from pipeline.project.config import parse_registry
from pipeline.project.data import LABELS, iter_batches
from pipeline.results.reports import Bisection, MetricResult, Outcome, OutputError, PrepareReport, Remedy
from pipeline.verify.bisect import bisect, scratch_build
from pipeline.verify.check import correctness, correctness_failures

if TYPE_CHECKING:
    from pipeline.project.config import Registry

TIMING_ROUNDS = 5
TIMING_CALLS = 40


def upstream(registry: Registry, model: str, node: str) -> list[str]:
    """The nodes of the prepared model whose outputs ``node`` reads (computed tensors only)."""
    import onnx

    graph = onnx.load(str(layout(registry).prepared_model(model)), load_external_data=False).graph
    producer = {o: n.name for n in graph.node for o in n.output if n.name}
    target = next((n for n in graph.node if n.name == node), None)
    return [producer[i] for i in (target.input if target is not None else []) if i in producer]


def override_yaml(model: str, sku: str, nodes: list[str]) -> str:
    import yaml

    return yaml.safe_dump({"models": {model: {"higher_precision": {sku: list(nodes)}}}}, sort_keys=False)


def judge(
    registry: Registry, model: str, sku: str, runner: Any
) -> tuple[list[OutputError], list[MetricResult], list[str]]:
    """The validate stage's correctness figures for a loaded engine (golden outputs, task metric)."""

    errors, metrics, _, _ = correctness(registry, model, sku, runner)
    return errors, metrics, correctness_failures(registry, model, errors, metrics)


def fix(
    registry: Registry,
    model: str,
    sku: str,
    *,
    max_rounds: int | None = None,
    max_builds: int | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> Remedy:
    """Bisect, keep the suspects precise, rebuild and re-validate until the gate passes."""
    spec = registry.sku(sku)
    max_rounds = max_rounds or spec.bisect.max_fix_rounds
    if spec.precision == "fp32":
        raise ConfigError(
            f"{sku} builds in fp32: there is no higher precision to keep nodes in",
            hint="a divergent FP32 engine is a compiler problem: report it with skuforge bisect's findings",
        )
    keep = list(registry.higher_precision(model, sku))
    rounds: list[Bisection] = []
    builds = 0
    with tempfile.TemporaryDirectory(prefix="skuforge-fix-") as tmp:
        work = Path(tmp)
        before_dir = scratch_build(registry, model, sku, work / "before", keep)
        builds += 1
        current = before_dir
        passed, failures = judged(registry, model, sku, current)[2:]
        while not passed and len(rounds) < max_rounds:
            found = bisect(registry, model, sku, keep=tuple(keep), max_builds=max_builds, progress=progress)
            rounds.append(found)
            builds += found.builds
            new = [n for s in found.suspects for n in s.keep if n not in keep]
            if not new and found.suspects:
                # the suspect is already kept and still diverges: the fault sits in what feeds it
                # (a compiler fuses the producer into the suspect's layer), so keep that too
                new = [n for n in upstream(registry, model, found.suspects[0].node) if n not in keep]
            if found.verdict != "diverges" or not new:
                break
            keep += new
            current = scratch_build(registry, model, sku, work / f"round{len(rounds)}", keep)
            builds += 1
            passed, failures = judged(registry, model, sku, current)[2:]
        before, after = _compare(
            registry, model, sku, before_dir, current, list(registry.higher_precision(model, sku)), keep
        )
    ratio = after.p50_ms / before.p50_ms if before.p50_ms and after.p50_ms else None
    added = [n for n in keep if n not in before.keep_precise]
    if after.passed:
        summary = (
            f"passes with {len(added)} more node(s) kept in higher precision ({', '.join(added) or 'none'}) after "
            f"{len(rounds)} round(s), {builds} builds" + (f"; latency x{ratio:.2f}" if ratio else "")
        )
    else:
        summary = f"still fails after {len(rounds)} round(s), {builds} builds: " + (
            "; ".join(after.failures) or "no further suspect"
        )
    return Remedy(
        model=model,
        sku=sku,
        backend=spec.backend,
        precision=spec.precision,
        passed=after.passed,
        summary=summary,
        keep_precise=keep,
        rounds=rounds,
        builds=builds,
        before=before,
        after=after,
        latency_ratio=round(ratio, 4) if ratio else None,
        overrides=override_yaml(model, sku, keep),
    )


def judged(registry: Registry, model: str, sku: str, engine: Path) -> tuple[list, list, bool, list[str]]:

    sku_spec = registry.sku(sku)
    with get_backend(sku_spec.backend).load(engine, sku_spec) as runner:
        errors, metrics, failures = judge(registry, model, sku, runner)
    return errors, metrics, not failures, failures


def _compare(
    registry: Registry, model: str, sku: str, before: Path, after: Path, keep_before: list[str], keep_after: list[str]
) -> tuple[Outcome, Outcome]:
    """Both engines judged, and timed interleaved on one golden batch (same process, same moment)."""
    import numpy as np

    out = layout(registry)
    sku_spec = registry.sku(sku)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    in_idx, _, batch = run_plan(registry, model, prep.signature, sku)
    golden = load_arrays(out.split(model, "golden"), "data")
    golden.pop(LABELS, None)
    _, feeds = next(iter_batches(golden, in_idx, batch))
    backend = get_backend(sku_spec.backend)
    outcomes: list[dict[str, Any]] = []
    times: tuple[list[float], list[float]] = ([], [])  # seconds per call: before, after
    with backend.load(before, sku_spec) as a, backend.load(after, sku_spec) as b:
        runners = (a, b)
        for keep, runner in zip((keep_before, keep_after), runners, strict=True):
            errors, metrics, failures = judge(registry, model, sku, runner)
            outcomes.append(
                dict(keep_precise=keep, passed=not failures, failures=failures, outputs=errors, metrics=metrics)
            )
        for runner in runners:
            for _ in range(5):
                runner.infer(feeds)  # warm-up
        for _ in range(TIMING_ROUNDS):
            for i, runner in enumerate(runners):
                for _ in range(TIMING_CALLS):
                    start = time.perf_counter()
                    runner.infer(feeds)
                    times[i].append(time.perf_counter() - start)
    first, second = (
        Outcome(**o, p50_ms=round(float(np.median(t)) * 1e3, 6)) for o, t in zip(outcomes, times, strict=True)
    )
    return first, second


def apply_overrides(params: Path, model: str, sku: str, nodes: list[str]) -> None:
    """Write ``models.<model>.higher_precision.<sku>`` into params.yaml, keeping its comments and
    layout (ruamel round trip); the file is replaced atomically and re-validated first."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    try:
        doc = yaml.load(params.read_text())
    except Exception as exc:  # ruamel raises its own parser errors
        raise InputError(f"{params} could not be read for editing: {exc}", hint="fix the YAML, then rerun") from exc
    models = doc.get("models") or {}
    if model not in models:
        raise InputError(f"{params} has no model {model!r}", hint="run skuforge bisect from the project that holds it")
    entry = models[model]
    if "higher_precision" not in entry or entry["higher_precision"] is None:
        entry["higher_precision"] = {}
    entry["higher_precision"][sku] = list(nodes)
    buf = io.StringIO()
    yaml.dump(doc, buf)
    text = buf.getvalue()
    import yaml as pyyaml

    parse_registry(pyyaml.safe_load(text), str(params), params.parent)  # refuse to write a registry that fails
    atomic_write_bytes(params, text.encode())
