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
from pipeline.results.reports import (
    Bisection,
    FixStep,
    MetricResult,
    Outcome,
    OutputError,
    PrepareReport,
    Remedy,
)
from pipeline.verify.bisect import bisect, outer_reads, scratch_build
from pipeline.verify.check import correctness, correctness_failures

if TYPE_CHECKING:
    from pipeline.project.config import Registry

TIMING_ROUNDS = 5
TIMING_CALLS = 40


def upstream(registry: Registry, model: str, node: str) -> list[str]:
    """The nodes of the prepared model whose outputs ``node`` reads (computed tensors only; for an
    If, Loop or Scan also those its subgraphs read from the outer scope)."""
    import onnx

    graph = onnx.load(str(layout(registry).prepared_model(model)), load_external_data=False).graph
    producer = {o: n.name for n in graph.node for o in n.output if n.name}
    target = next((n for n in graph.node if n.name == node), None)
    reads = [*target.input, *outer_reads(target)] if target is not None else []
    return list(dict.fromkeys(producer[i] for i in reads if i in producer))


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
    """Bisect, keep the suspects precise, rebuild and re-validate until the gate passes. A round
    whose nodes do not move the error is undone and ends the search, with what it showed."""
    spec = registry.sku(sku)
    max_rounds = max_rounds or spec.bisect.max_fix_rounds
    max_builds = max_builds or spec.bisect.max_builds
    if spec.precision == "fp32":
        raise ConfigError(
            f"{sku} builds in fp32: there is no higher precision to keep nodes in",
            hint="a divergent FP32 engine is a compiler problem: report it with skuforge bisect's findings",
        )
    keep = list(registry.higher_precision(model, sku))
    rounds: list[Bisection] = []
    steps: list[FixStep] = []
    lessons: list[str] = []
    with tempfile.TemporaryDirectory(prefix="skuforge-fix-") as tmp:
        work = Path(tmp)

        def attempt(nodes: list[str]) -> tuple[Path, FixStep]:
            folder = scratch_build(registry, model, sku, work / f"build{len(steps)}", nodes)
            errors, _, passed, _ = judged(registry, model, sku, folder)
            builds = sum(r.builds for r in rounds) + len(steps) + 1
            step = FixStep(keep_precise=list(nodes), passed=passed, max_abs_error=worst_error(errors), builds=builds)
            steps.append(step)
            return folder, step

        before_dir, best = attempt(keep)
        current = before_dir
        while not best.passed and len(rounds) < max_rounds:
            found = bisect(registry, model, sku, keep=tuple(keep), max_builds=max_builds, progress=progress)
            rounds.append(found)
            if found.verdict != "diverges" or not found.suspects:
                lessons.append(found.summary)
                break
            suspect = found.suspects[0]
            new = [n for s in found.suspects for n in s.keep if n not in keep]
            if not new:
                # the suspect is already kept and still diverges, or cannot be kept (an If whose
                # subgraphs the precision conversion does not reach): the error comes in through what
                # feeds it (a compiler fuses the producer into the suspect's layer; a recurrent
                # subgraph amplifies its inputs' quantization error), so keep that
                new = [n for n in upstream(registry, model, suspect.node) if n not in keep]
            if not new:
                lessons.append(f"{suspect.node} ({suspect.op_type}): {suspect.explanation}; nothing left to keep")
                break
            folder, step = attempt(keep + new)
            lesson = unmoved(best, step, new)
            if lesson is not None:
                # one build on what that shows (the node's inputs, which a compiler may fuse into it)
                # instead of bisecting again to the same node
                feeding = list(
                    dict.fromkeys(n for x in new for n in upstream(registry, model, x) if n not in keep + new)
                )
                if feeding:
                    step.kept = False
                    folder, step = attempt(keep + new + feeding)
                    if unmoved(best, step, new + feeding) is None:
                        lesson, new = None, new + feeding
                if lesson is not None:
                    step.kept = False
                    lessons.append(
                        lesson + (f"; keeping its inputs' producers {feeding} too did not" if feeding else "")
                    )
                    break
            keep += new
            current, best = folder, step
        before, after = _compare(
            registry, model, sku, before_dir, current, list(registry.higher_precision(model, sku)), keep
        )
    builds = sum(r.builds for r in rounds) + len(steps)
    ratio = after.p50_ms / before.p50_ms if before.p50_ms and after.p50_ms else None
    added = [n for n in keep if n not in before.keep_precise]
    caps = f"cap {max_builds} builds per bisection, {max_rounds} rounds"
    if after.passed:
        summary = (
            f"passes with {len(added)} more node(s) kept in higher precision ({', '.join(added) or 'none'}) after "
            f"{len(rounds)} round(s), {builds} builds ({caps})" + (f"; latency x{ratio:.2f}" if ratio else "")
        )
    else:
        first = steps[0].max_abs_error
        summary = (
            f"still fails after {len(rounds)} round(s), {builds} builds ({caps}); best found: "
            + (
                f"keeping {', '.join(added)} reached max abs error {_num(best.max_abs_error)} (from {_num(first)})"
                if added
                else f"no node kept helped (max abs error {_num(first)})"
            )
            + "".join(f"; {lesson}" for lesson in lessons)
            + ": "
            + ("; ".join(after.failures) or "no further suspect")
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
        max_builds=max_builds,
        max_rounds=max_rounds,
        steps=steps,
        lessons=lessons,
    )


# a kept node must cut the worst output error by at least this fraction to count as the cause
MOVED = 0.05


def worst_error(errors: list[OutputError]) -> float | None:
    """The largest max abs error over the outputs (inf when one is non-finite, None when unknown)."""
    values = [e.max_abs_error for e in errors if e.max_abs_error is not None]
    return max(values) if values else None


def unmoved(before: FixStep, after: FixStep, added: list[str]) -> str | None:
    """What keeping ``added`` precise showed when it did not move the error (None when it did:
    the gate passes now, or the worst output error fell by ``MOVED`` or more)."""
    if after.passed or before.max_abs_error is None or after.max_abs_error is None:
        return None
    if after.max_abs_error <= before.max_abs_error * (1 - MOVED):
        return None
    return (
        f"keeping {', '.join(added)} precise left max abs error at {_num(after.max_abs_error)} "
        f"(was {_num(before.max_abs_error)}): {'they are' if len(added) > 1 else 'it is'} not the cause; "
        "the divergence comes from upstream (its inputs) or from a node the remedy cannot keep precise"
    )


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


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
