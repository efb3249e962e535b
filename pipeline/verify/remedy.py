"""The remedy for a divergent engine: keep the bisection's suspects in higher precision, rebuild,
re-validate, repeat until the gate passes or the rounds are spent; then, if it still fails, keep
nodes by their contribution to the error until it passes and drop those it can spare
(accuracy-aware mixed precision, within the build cap).

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
from pipeline.backends.reference import CPU, SessionRunner, create_session, session_options
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.io import atomic_write_bytes
from pipeline.project.artifacts import layout, load_arrays, read_report, run_plan
from pipeline.project.config import parse_registry
from pipeline.project.data import LABELS, iter_batches
from pipeline.results.reports import (
    Bisection,
    FixStep,
    LayerInfo,
    MetricResult,
    Outcome,
    OutputError,
    PrepareReport,
    Remedy,
    TensorError,
)
from pipeline.verify.bisect import (
    Graph,
    bisect,
    classify,
    float_node_inputs,
    remedy_nodes,
    scan_builds,
    scratch_build,
)
from pipeline.verify.check import correctness, correctness_failures

if TYPE_CHECKING:
    from pipeline.project.config import Pair, Registry

TIMING_ROUNDS = 5
TIMING_CALLS = 40


def override_yaml(model: str, sku: str, nodes: list[str]) -> str:
    import yaml

    return yaml.safe_dump({"models": {model: {"higher_precision": {sku: list(nodes)}}}}, sort_keys=False)


def judge(pair: Pair, runner: Any) -> tuple[list[OutputError], list[MetricResult], list[str]]:
    """The validate stage's correctness figures for a loaded engine (golden outputs, task metric)."""

    j = correctness(pair, runner)
    return j.errors, j.metrics, correctness_failures(pair.spec, j)


def fix(
    pair: Pair,
    *,
    max_rounds: int | None = None,
    max_builds: int | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> Remedy:
    """Bisect, keep the suspects precise, rebuild and re-validate until the gate passes. A round
    whose nodes do not move the error is widened (what the engine shows, then both ways), else undone and
    ends the search, with what it showed. When the suspects do not fix it, the accuracy-aware
    phase keeps nodes by their contribution to the error until the gate passes, then drops those
    it can spare (``accuracy_aware``)."""
    model, sku, spec = pair.model, pair.sku, pair.sku_spec
    max_rounds = max_rounds or spec.bisect.max_fix_rounds
    max_builds = max_builds or spec.bisect.max_builds
    if spec.precision == "fp32":
        raise ConfigError(
            f"{sku} builds in fp32: there is no higher precision to keep nodes in",
            hint="a divergent FP32 engine is a compiler problem: report it with skuforge bisect's findings",
        )
    original = list(pair.higher_precision)
    with tempfile.TemporaryDirectory(prefix="skuforge-fix-") as tmp:
        search = Search(pair, Path(tmp), prepared_graph(pair.registry, model), original)
        before_dir = search.start()
        search.suspect_rounds(max_rounds, max_builds, progress)
        if not search.best.passed:
            search.accuracy_aware(max_builds)
        before, after, fp32_ms = _compare(pair, before_dir, search.current, original, search.keep)
    rounds, steps, lessons, keep, best = search.rounds, search.steps, search.lessons, search.keep, search.best
    builds = search.builds()
    ratio = after.p50_ms / before.p50_ms if before.p50_ms and after.p50_ms else None
    fp32_ratio = after.p50_ms / fp32_ms if fp32_ms and after.p50_ms else None
    added = [n for n in keep if n not in before.keep_precise]
    caps = f"cap {max_builds} builds per bisection, {max_rounds} rounds"
    how = f"{len(rounds)} round(s)" + (", the accuracy-aware phase" if search.scan is not None else "")
    if after.passed:
        summary = (
            f"passes with {len(added)} more node(s) kept in higher precision ({', '.join(added) or 'none'}) after "
            f"{how}, {builds} builds ({caps})"
            + (f"; latency x{ratio:.2f} of the all-{spec.precision} engine" if ratio else "")
            + (f", x{fp32_ratio:.2f} of ONNX Runtime FP32" if fp32_ratio else "")
            + "".join(f"; {lesson}" for lesson in lessons)
        )
    else:
        first = steps[0].max_abs_error
        summary = (
            f"still fails after {how}, {builds} builds ({caps}); best found: "
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
        scan=search.scan,
        ranked=search.ranked,
        fp32_p50_ms=fp32_ms,
        fp32_latency_ratio=round(fp32_ratio, 4) if fp32_ratio else None,
    )


def prepared_graph(registry: Registry, model: str) -> Graph:
    """The prepared model's dataflow (node names as params.yaml's higher_precision gives them)."""
    import onnx

    return Graph.of(onnx.load(str(layout(registry).prepared_model(model)), load_external_data=False))


def producers(graph: Graph, nodes: list[str]) -> list[str]:
    """The nodes whose outputs ``nodes`` read (computed tensors only; for an If, Loop or Scan also
    those its subgraphs read from the outer scope)."""
    by_name = {n.name: n for n in graph.model.graph.node if n.name}
    reads = [i for name in nodes if name in by_name for i in graph.inputs(by_name[name])]
    return list(dict.fromkeys(graph.producer[i].name for i in reads if i in graph.producer and graph.producer[i].name))


def consumers(graph: Graph, tensors: list[str]) -> list[str]:
    return list(dict.fromkeys(c.name for t in tensors for c in graph.consumers.get(t, []) if c.name))


def neighbours(graph: Graph, nodes: list[str], exclude: list[str]) -> list[str]:
    """The nodes next to ``nodes`` both ways: the producers of what they read (a compiler fuses a
    producer into its consumer's layer) and the consumers of what they write (an INT8 tensor is
    quantized again at every consumer's input, whatever its producer keeps)."""
    writes = [o for n in graph.model.graph.node if n.name in nodes for o in n.output]
    found = producers(graph, nodes) + consumers(graph, writes)
    return [n for n in dict.fromkeys(found) if n not in exclude and n not in nodes]


def widenings(graph: Graph, nodes: list[str], keep: list[str], quantized: list[str]) -> list[list[str]]:
    """What to keep beside ``nodes`` when keeping them did not move the error, in the order to try:
    the readers of the tensors the engine still quantizes (else the producers of what the nodes
    read, a compiler fusing one into its consumer's layer), then every neighbour both ways."""
    taken = keep + nodes
    first = [n for n in consumers(graph, quantized) if n not in taken]
    first = first or [n for n in producers(graph, nodes) if n not in taken]
    both = neighbours(graph, nodes, keep)
    return [w for w in (first, both) if w and (w is first or set(w) != set(first))]


def still_quantized(graph: Graph, layers: list[LayerInfo], nodes: list[str]) -> list[str]:
    """The output tensors of kept ``nodes`` the engine still quantizes: a QuantizeLinear on them
    (``<tensor>_QuantizeLinear``, the QDQ quantizer's name, a layer of its own or fused into one)
    for a consumer that reads them in INT8. Keeping a node out of QDQ keeps its compute in float,
    not its output."""
    names = {layer.name for layer in layers} | {f for layer in layers for f in layer.fused_from}
    by_name = {n.name: n for n in graph.model.graph.node if n.name}
    return [
        out
        for name in nodes
        if name in by_name
        for out in by_name[name].output
        if out and f"{out}_QuantizeLinear" in names
    ]


class Search:
    """The remedy's state: the configurations built (steps), the bisections, what was learned."""

    def __init__(self, pair: Pair, work: Path, graph: Graph, keep: list[str]) -> None:
        self.pair, self.model, self.sku, self.work, self.graph = pair, pair.model, pair.sku, work, graph
        self.precision = pair.precision
        self.int8 = self.precision == "int8"
        self.keep = list(keep)
        self.rounds: list[Bisection] = []
        self.steps: list[FixStep] = []
        self.lessons: list[str] = []
        self.scan: Bisection | None = None
        self.ranked: list[str] = []
        self.current = work
        self.best = FixStep(keep_precise=[], passed=False, builds=0)

    def builds(self) -> int:
        return sum(r.builds for r in self.rounds) + (self.scan.builds if self.scan else 0) + len(self.steps)

    def attempt(self, nodes: list[str], phase: str) -> tuple[Path, FixStep]:
        folder = self.work / f"build{len(self.steps)}"
        built = scratch_build(self.pair, folder, nodes)
        errors, _, passed, _ = judged(self.pair, folder / "engine")
        step = FixStep(
            keep_precise=list(nodes),
            passed=passed,
            max_abs_error=worst_error(errors),
            builds=self.builds() + 1,
            still_quantized=still_quantized(self.graph, built.outcome.layers, nodes)
            if self.precision == "int8"
            else [],
            phase=phase,
        )
        self.steps.append(step)
        return folder / "engine", step

    def accept(self, folder: Path, step: FixStep) -> None:
        self.keep, self.current, self.best = list(step.keep_precise), folder, step

    def start(self) -> Path:
        folder, step = self.attempt(self.keep, "before")
        self.accept(folder, step)
        return folder

    def suspect_rounds(self, max_rounds: int, max_builds: int, progress: Callable[[str, float], None] | None) -> None:
        """Bisect, keep the suspect's nodes, rebuild, until the gate passes or the rounds are spent."""
        keep = self.keep
        while not self.best.passed and len(self.rounds) < max_rounds:
            found = bisect(self.pair, keep=tuple(self.keep), max_builds=max_builds, progress=progress)
            self.rounds.append(found)
            if found.verdict != "diverges" or not found.suspects:
                self.lessons.append(found.summary)
                return
            suspect = found.suspects[0]
            keep = self.keep
            new = [n for s in found.suspects for n in s.keep if n not in keep]
            if not new:
                # the suspect is already kept and still diverges, or cannot be kept (an If whose
                # subgraphs the precision conversion does not reach): the error comes in through what
                # feeds it (a compiler fuses the producer into the suspect's layer; a recurrent
                # subgraph amplifies its inputs' quantization error), so keep that
                new = [n for n in producers(self.graph, [suspect.node]) if n not in keep]
            if not new:
                self.lessons.append(f"{suspect.node} ({suspect.op_type}): {suspect.explanation}; nothing left to keep")
                return
            folder, step = self.attempt(keep + new, "bisect")
            lesson = unmoved(self.best, step, new)
            if lesson is not None:
                # a build or two around the kept nodes instead of bisecting again to the same node:
                # first what the engine shows (the readers of a kept tensor it still quantizes), else
                # what feeds them (a compiler fuses a producer into its consumer's layer); then both ways
                quantized = step.still_quantized
                tried: list[str] = []
                for around in widenings(self.graph, new, keep, quantized):
                    step.kept = False
                    folder, step = self.attempt(keep + new + around, "widen")
                    tried.append(f"keeping {', '.join(around)} too did not")
                    if unmoved(self.best, step, new + around) is None:
                        lesson = None
                        break
                if lesson is not None:
                    step.kept = False
                    said = f"; the engine still quantized {', '.join(quantized)} for its readers" if quantized else ""
                    self.lessons.append(lesson + said + "".join(f"; {t}" for t in tried))
                    return
            self.accept(folder, step)

    def accuracy_aware(self, budget: int) -> None:
        """When the suspects do not fix it: rank the nodes by the error they add (a scan of every
        tensor, ``SCAN_MARKS`` per build), keep them greedily in that order until the gate passes,
        then drop each kept node again, the latest first, while the gate still passes. At most
        ``budget`` builds, the scan's included (NNCF's accuracy-aware quantization, by the gate)."""
        start = self.builds()
        needed = scan_builds(self.graph, self.precision)
        if needed >= budget:
            self.lessons.append(
                f"the accuracy-aware phase did not run: its scan of every tensor takes {needed} builds, and the cap "
                f"is {budget} (raise skus.{self.sku}.bisect.max_builds or --max-builds)"
            )
            return
        self.scan = bisect(self.pair, keep=tuple(self.keep), scan=True)
        units = contributions(self.graph, self.scan, self.precision)
        self.ranked = list(dict.fromkeys(n for unit in units for n in unit))
        floor = self.best

        def left() -> int:
            return budget - (self.builds() - start)

        for unit in units:
            if self.best.passed or left() <= 0:
                break
            new = [n for n in unit if n not in self.keep]
            if not new:
                continue
            folder, step = self.attempt(self.keep + new, "greedy")
            if step.passed or unmoved(self.best, step, new) is None:
                self.accept(folder, step)
            else:
                step.kept = False
        if not self.best.passed:
            self.lessons.append(
                f"the accuracy-aware phase kept {len(self.keep)} node(s) by their contribution and still fails "
                f"(max abs error {_num(self.best.max_abs_error)}, was {_num(floor.max_abs_error)}; "
                f"{self.builds() - start} of {budget} builds)"
            )
            return
        # the latest first: a node kept late was kept for what the earlier ones left
        for name in [n for n in reversed(self.keep) if n not in self.steps[0].keep_precise]:
            if left() <= 0:
                break
            trial = [n for n in self.keep if n != name]
            folder, step = self.attempt(trial, "drop")
            if step.passed:
                self.accept(folder, step)
            else:
                step.kept = False


def contributions(graph: Graph, scan: Bisection, precision: str) -> list[list[str]]:
    """The scan's tensors as groups of nodes to keep, the tensor adding the most error first: its
    error beyond its inputs' (relative or median channel, the larger), each group what the
    remedy keeps for that tensor's cause (``remedy_nodes``)."""
    measured = {t.tensor: t for t in scan.tensors}

    def error(t: TensorError | None) -> float:
        if t is None:
            return 0.0
        if t.nan or t.inf or t.relative_error is None:
            return float("inf")
        return max(t.relative_error, t.channel_relative_error or 0.0)

    scored = []
    for tensor, err in measured.items():
        if tensor not in graph.producer:
            continue
        inputs = [measured.get(i) for i in float_node_inputs(graph, tensor)]
        added = error(err) - max((error(i) for i in inputs), default=0.0)
        if added > 0:
            scored.append((added, tensor))
    units = []
    for _, tensor in sorted(scored, key=lambda x: -x[0]):
        err = measured[tensor]
        ins = [i for i in (measured.get(x) for x in float_node_inputs(graph, tensor)) if i is not None]
        cause, _ = classify(err, ins, graph.producer[tensor].op_type, precision)
        absmax = {t.tensor: t.reference_abs_max for t in scan.tensors}.get
        units.append(remedy_nodes(graph, tensor, cause, precision, absmax))
    return [u for u in units if u]


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


def judged(pair: Pair, engine: Path) -> tuple[list, list, bool, list[str]]:

    with get_backend(pair.backend).load(engine, pair.sku_spec) as runner:
        errors, metrics, failures = judge(pair, runner)
    return errors, metrics, not failures, failures


def _compare(
    pair: Pair, before: Path, after: Path, keep_before: list[str], keep_after: list[str]
) -> tuple[Outcome, Outcome, float | None]:
    """Both engines judged, and timed interleaved on one golden batch (same process, same moment)
    with the prepared model on ONNX Runtime CPU FP32 (every graph optimisation): its p50 is the third."""
    import numpy as np

    model, sku_spec = pair.model, pair.sku_spec
    out = layout(pair.registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    in_idx, _, batch = run_plan(pair, prep.signature)
    golden = load_arrays(out.split(model, "golden"), "data")
    golden.pop(LABELS, None)
    _, feeds = next(iter_batches(golden, in_idx, batch))
    backend = get_backend(sku_spec.backend)
    outcomes: list[dict[str, Any]] = []
    times: tuple[list[float], list[float], list[float]] = ([], [], [])  # seconds per call: before, after, FP32
    fp32 = SessionRunner(create_session(out.prepared_model(model), session_options("all"), [CPU]))
    with backend.load(before, sku_spec) as a, backend.load(after, sku_spec) as b, fp32:
        runners = (a, b, fp32)
        for keep, runner in zip((keep_before, keep_after), (a, b), strict=True):
            errors, metrics, failures = judge(pair, runner)
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
        Outcome(**o, p50_ms=round(float(np.median(t)) * 1e3, 6)) for o, t in zip(outcomes, times[:2], strict=True)
    )
    return first, second, round(float(np.median(times[2])) * 1e3, 6)


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
