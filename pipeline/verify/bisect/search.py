"""The search: the anchor engine, scratch builds with tensors marked, the first divergent node."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends import backend_class, get_backend
from pipeline.backends.opset import convert_opset, recorded_conversion
from pipeline.backends.reference import reference_runner
from pipeline.core.errors import ConfigError, EnvironmentProblem
from pipeline.engine.build import Built, build_engine
from pipeline.model.graph import default_opset, pin_axes
from pipeline.project.artifacts import layout, load_arrays, read_report, run_plan
from pipeline.project.data import LABELS, iter_batches, run_dataset
from pipeline.results.reports import Bisection, PrepareReport, Probe, TensorError
from pipeline.verify.bisect.diagnosis import overflow_source, reference_abs_max, suspect_of, tensor_error
from pipeline.verify.bisect.graph import Graph, float_node_inputs, numel
from pipeline.verify.check import correctness, correctness_failures
from pipeline.verify.compare import output_error, output_problems

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from pipeline.project.config import Pair, SkuSpec
    from pipeline.verify.check import Judgement

LOG = logging.getLogger("skuforge.bisect")
MAX_SAMPLES = 256
SCAN_MARKS = 8  # tensors marked per build when scanning every candidate
MAX_INTERMEDIATE_BYTES = 1 << 30


# --- running ----------------------------------------------------------------------------------------


def scratch_build(
    pair: Pair,
    folder: Path,
    keep: tuple[str, ...] | list[str],
    prepared: Path | None = None,
) -> Built:
    """The build stage's engine, built into ``folder/engine`` with a copy of the SKU's cache (the
    real engine and cache are never touched); returns what the build reported."""

    real = layout(pair.registry).cache_dir(pair.model, pair.sku)
    if real.is_dir() and not real.is_symlink():
        shutil.copytree(real, folder / "cache", symlinks=True)  # a link stays a link: the copy is as untrusted
    # the marked outputs make new tuning tasks: a scratch build may miss the cache without failing, and
    # takes the compiler's default schedules for them rather than searching (numerics, not speed, matter here)
    return build_engine(
        pair,
        folder / "engine",
        prepared=prepared,
        cache_dir=folder / "cache",
        cache_required=False,
        search=False,
        keep_precise=tuple(keep),
    )


def run_engine(sku_spec: SkuSpec, engine: Path, feeds: dict[str, np.ndarray], in_idx: dict, batch: int):
    """An engine's every output on ``feeds``, stacked per run (one batch per run)."""
    with get_backend(sku_spec.backend).load(engine, sku_spec) as runner:
        return run_dataset(runner.infer, feeds, in_idx, {t: None for t in runner.output_names}, batch)


class ReferenceValues(Mapping[str, "np.ndarray"]):
    """The graph inputs and any float tensor of the graph as ONNX Runtime CPU FP32 (optimisations
    off, so marking changes nothing) computes it on the bisection's samples, stacked per run. A
    tensor is computed when first asked for, with the others asked for at once: every tensor of
    every sample would not fit in memory, the few a build marks do. Kept while they fit
    MAX_INTERMEDIATE_BYTES."""

    def __init__(self, graph: Graph, feeds: dict[str, np.ndarray], in_idx: dict[str, int | None], batch: int) -> None:
        self.graph, self.feeds, self.in_idx, self.batch = graph, feeds, in_idx, batch
        self.known = {*graph.float_values, *(o.name for o in graph.model.graph.output)}  # outputs of any type
        self._values: dict[str, np.ndarray] = {}
        self.runs = 0  # reference runs over the samples, for the log

    def fetch(self, tensors: list[str]) -> None:
        want = [t for t in dict.fromkeys(tensors) if t not in self._values and t in self.known]
        want = [t for t in want if t not in self.feeds]
        if not want:
            return
        with reference_runner(self.graph.with_outputs(want).SerializeToString()) as runner:
            got = run_dataset(runner.infer, self.feeds, self.in_idx, {t: None for t in runner.output_names}, self.batch)
        self.runs += 1
        held = sum(a.nbytes for a in self._values.values())
        for old in list(self._values):  # the oldest go first, never what was just asked for
            if held + sum(got[t].nbytes for t in want) <= MAX_INTERMEDIATE_BYTES:
                break
            if old not in tensors:
                held -= self._values.pop(old).nbytes
        self._values.update({t: got[t] for t in want})

    def __getitem__(self, tensor: str) -> np.ndarray:
        if tensor in self.feeds:
            return self.feeds[tensor]
        if tensor not in self.known:
            raise KeyError(tensor)
        self.fetch([tensor])
        return self._values[tensor]

    def __contains__(self, tensor: object) -> bool:
        return tensor in self.feeds or tensor in self.known

    def __iter__(self) -> Iterator[str]:
        return iter([*self.feeds, *(t for t in self.known if t not in self.feeds)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class Session:
    """One bisection's fixed inputs: the graph the build compiles, the samples, their reference."""

    pair: Pair
    graph: Graph
    feeds: dict[str, np.ndarray]
    in_idx: dict[str, int | None]
    batch: int
    reference: ReferenceValues
    keep: tuple[str, ...]
    work: Path
    builds: int = 0
    probes: list[Probe] = field(default_factory=list)
    measured: dict[str, TensorError] = field(default_factory=dict)  # every tensor's latest measurement

    @property
    def precision(self) -> str:
        return self.pair.precision

    @property
    def model(self) -> str:
        return self.pair.model

    @property
    def sku(self) -> str:
        return self.pair.sku

    def run_engine(self, marked: list[str]) -> dict[str, np.ndarray]:
        """Build the SKU's engine of the model with ``marked`` as extra outputs, run the samples."""
        import onnx

        self.builds += 1
        folder = Path(tempfile.mkdtemp(prefix="build-", dir=self.work))
        try:
            prepared = folder / "marked.onnx"
            onnx.save(self.graph.with_outputs(marked), str(prepared))
            scratch_build(self.pair, folder, self.keep, prepared)
            got = run_engine(self.pair.sku_spec, folder / "engine", self.feeds, self.in_idx, self.batch)
            missing = [t for t in marked if t not in got]
            if missing:
                raise EnvironmentProblem(
                    f"the {self.pair.backend} engine does not expose {missing} as outputs",
                    hint="this backend renames or drops marked outputs: bisection cannot read them",
                )
            return got
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def probe(self, marked: list[str]) -> dict[str, TensorError]:
        self.reference.fetch(marked)
        got = self.run_engine(marked)
        errors = {t: tensor_error(self.graph, t, got[t], self.reference[t], self.precision) for t in marked}
        self.probes.append(Probe(marked=marked, divergent=[t for t in marked if errors[t].divergent]))
        self.measured.update(errors)
        LOG.info(
            "bisect %s/%s build %d: %s",
            self.model,
            self.sku,
            self.builds,
            ", ".join(f"{t} {'DIVERGES' if e.divergent else 'ok'}" for t, e in errors.items()),
        )
        return errors


def gate_samples(pair: Pair) -> tuple[dict, dict, int]:
    """Golden inputs, their batch axes and the SKU's batch."""

    out = layout(pair.registry)
    prep = read_report(out.report(pair.model, None, "prepare"), PrepareReport, "prepare")
    arrays = load_arrays(out.split(pair.model, "golden"), "data")
    arrays.pop(LABELS, None)
    in_idx, _, batch = run_plan(pair, prep.signature)
    return arrays, in_idx, batch


@dataclass(frozen=True)
class Anchor:
    """The SKU's engine with nothing marked, judged by the validate gate itself (its samples, its
    criteria): what the search has to explain."""

    engine: Path
    built: Built
    judgement: Judgement
    failures: list[str]

    def samples(self) -> str:
        return ", ".join(f"{n} {split}" for split, n in self.judgement.samples.items()) or "no samples"

    def failing_outputs(self) -> list[str]:
        """The outputs the gate's tensor checks find off (diagnostics beside a task verdict included)."""
        return [e.output for e in self.judgement.errors if output_problems(e)]


def judge_anchor(pair: Pair, folder: Path, keep: tuple[str, ...]) -> Anchor:
    built = scratch_build(pair, folder, keep)
    with get_backend(pair.backend).load(folder / "engine", pair.sku_spec) as runner:
        judgement = correctness(pair, runner)
    return Anchor(folder / "engine", built, judgement, correctness_failures(pair.spec, judgement))


def as_built(model: onnx.ModelProto, built: Built, probe: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` at the opset the build converted it to (the same conversion), so the reference,
    the candidates and the marked builds are those of the graph the engine was compiled from."""
    conversion = recorded_conversion(built.outcome.calibration, built.outcome.options)
    if conversion is None or conversion.to_opset == default_opset(model):
        return model
    converted, _ = convert_opset(model, conversion.to_opset, probe, conversion.reason)
    return converted


def pick_samples(
    anchor: Anchor, reference: dict[str, np.ndarray], outputs: list[str], total: int, n: int, batch: int
) -> list[int]:
    """The golden samples to bisect on: all of them when ``n`` covers them, else the ``n`` (whole
    batches) whose ``outputs`` the anchor engine gets most wrong (relative error, NaN/Inf first),
    in their order in the set."""
    import numpy as np

    if n >= total:
        return list(range(total))
    n = max(batch, n - n % batch)
    score = np.zeros(total)
    for name in outputs:
        got, ref = anchor.judgement.golden.get(name), reference.get(name)
        if got is None or ref is None or got.shape != ref.shape or len(got) != total:
            continue
        g, r = got.reshape(total, -1).astype(np.float64), ref.reshape(total, -1).astype(np.float64)
        bad = (~np.isfinite(g) & np.isfinite(r)).any(axis=1)
        d = np.where(np.isfinite(g) & np.isfinite(r), g - r, 0.0)
        rel = np.linalg.norm(d, axis=1) / np.maximum(np.linalg.norm(np.where(np.isfinite(r), r, 0.0), axis=1), 1e-12)
        score = np.maximum(score, np.where(bad, np.inf, rel))
    worst = np.argsort(-score, kind="stable")[:n]
    return sorted(int(i) for i in worst)


@dataclass
class _Start:
    """Where a search starts: the session, the anchor's verdict, the outputs off on the samples."""

    session: Session
    anchor: Anchor
    out_errors: list[TensorError]
    failing: list[str]
    note: str
    base: dict[str, Any]


def bisect(
    pair: Pair,
    *,
    keep: tuple[str, ...] | None = None,
    max_builds: int | None = None,
    marks_per_build: int | None = None,
    scan: bool = False,
    progress: Callable[[str, float], None] | None = None,
) -> Bisection:
    """Search the first divergent node of ``model``'s engine for ``sku`` (see the module doc).
    ``scan``: measure every candidate instead (a few marked per build), failing or not: the
    per-layer error profile, and a check that a passing engine has no divergent tensor."""
    sku, spec = pair.sku, pair.sku_spec
    if not backend_class(spec.backend).capabilities.intermediate_outputs:
        raise ConfigError(
            f"the {spec.backend} backend of SKU {sku} cannot build a model with intermediate tensors "
            "marked as outputs: bisection needs that",
            hint="skuforge backends lists what each supports",
        )
    settings = spec.bisect
    max_builds = max_builds or settings.max_builds
    k = marks_per_build or settings.marks_per_build
    keep = pair.higher_precision if keep is None else tuple(keep)
    with tempfile.TemporaryDirectory(prefix="skuforge-bisect-") as tmp:
        start = _start(pair, keep, Path(tmp), max(k, SCAN_MARKS) if scan else k)
        start.base.update(marks_per_build=k, max_builds=max_builds)
        session, base = start.session, start.base
        if not start.anchor.failures and not scan:
            return Bisection(
                **base,
                verdict="clean",
                failing_outputs=[],
                candidates=0,
                builds=session.builds,
                summary=f"the validate gate passes on the anchor engine ({start.anchor.samples()}): nothing to bisect",
                probes=session.probes,
            )
        if scan:
            return _scan(session, base, start.failing, max(k, SCAN_MARKS))
        graph, outputs = session.graph, [e.tensor for e in start.out_errors]
        wanted = graph.ancestors(start.failing)
        candidates = [
            t
            for t in graph.order
            if t in wanted and t not in outputs and not (spec.precision == "int8" and graph.folded_activation(t))
        ]
        lo, hi = _search(session, candidates, k, max_builds, lambda e: e.divergent, progress)
        base.update(failing_outputs=start.failing, candidates=len(candidates))
        if lo < hi:
            return _inconclusive(start, candidates, lo, hi, max_builds)
        return _diverges(start, candidates, lo, k, max_builds)


def _start(pair: Pair, keep: tuple[str, ...], work: Path, marks: int) -> _Start:
    """The anchor (the engine as the build stage makes it, judged by the validate gate itself), the
    graph it compiled, the samples bisected, the outputs off on them."""
    import numpy as np
    import onnx

    model, sku, spec = pair.model, pair.sku, pair.sku_spec
    out = layout(pair.registry)
    arrays, in_idx, batch = gate_samples(pair)
    anchor = judge_anchor(pair, work / "anchor", keep)
    prepared = out.prepared_model(model)
    pinned = pin_axes(
        onnx.load(str(prepared)),
        {k_: v for k_, v in pair.pins.items() if k_ not in spec.profiles},
        prepared,
    )
    graph = Graph.of(as_built(pinned, anchor.built, next(iter_batches(arrays, in_idx, batch))[1]))
    outputs = [o.name for o in graph.model.graph.output]
    # as many of the gate's golden samples as the tensors a build marks (and the outputs) fit
    # MAX_INTERMEDIATE_BYTES for, engine and reference; the ones that fail most when not all fit
    sizes = sorted(numel(graph.float_values[t]) for t in [*graph.order, *outputs] if t in graph.float_values)
    per_run = 2 * 8 * (sum(sizes[-(marks + 2) :]) + sum(numel(v) for v in graph.model.graph.output)) or 1
    total = len(next(iter(arrays.values())))
    cap = min(MAX_SAMPLES, batch * max(1, MAX_INTERMEDIATE_BYTES // per_run))
    expected = load_arrays(out.reference_dir(model) / "golden.npz", "reference")
    picked = pick_samples(anchor, expected, anchor.failing_outputs() or outputs, total, cap, batch)
    feeds = {name: np.take(a, picked, axis=0) for name, a in arrays.items()}
    n = len(picked)
    reference = ReferenceValues(graph, feeds, in_idx, batch)
    session = Session(
        pair=pair,
        graph=graph,
        feeds=feeds,
        in_idx=in_idx,
        batch=batch,
        reference=reference,
        keep=keep,
        work=work,
        builds=1,
    )
    got = run_engine(spec, anchor.engine, feeds, in_idx, batch)
    reference.fetch(outputs)
    tol = pair.tolerance
    out_errors = [tensor_error(graph, o, got[o], reference[o], spec.precision) for o in outputs]
    # the outputs off on the samples bisected, by the gate's tolerance or beyond the precision
    here = [o for o in outputs if output_problems(output_error(o, got[o], reference[o], tol))]
    here += [e.tensor for e in out_errors if e.divergent and e.tensor not in here]
    failing = list(dict.fromkeys([*anchor.failing_outputs(), *here])) or (outputs if anchor.failures else [])
    note = ""
    if anchor.failures and not here:
        note = (
            f"the validate gate fails on the anchor engine ({anchor.samples()}: {anchor.failures[0]}), "
            f"but on the {n} golden sample(s) bisected no output is off: the search runs toward "
            f"{', '.join(failing)} on the samples whose outputs fail most; "
        )
    base: dict[str, Any] = dict(
        model=model,
        sku=sku,
        backend=spec.backend,
        precision=spec.precision,
        samples=n,
        keep_precise=list(keep),
        outputs=out_errors,
        gate_samples=anchor.judgement.samples,
        gate_failures=anchor.failures,
        golden_indices=picked if n < total else [],
        opset=default_opset(graph.model),
    )
    return _Start(session, anchor, out_errors, failing, note, base)


def _inconclusive(start: _Start, candidates: list[str], lo: int, hi: int, max_builds: int) -> Bisection:
    """The build cap reached with candidates left: the range, and the earliest divergent tensor so far."""
    session, sku = start.session, start.session.sku
    # the best found so far: the earliest tensor measured divergent (the range ends before it)
    known = session.measured.get(candidates[hi]) if hi < len(candidates) else None
    best = (
        f"; the earliest divergent tensor measured so far: {known.tensor} ({known.node}, {known.op_type}, "
        f"relative error {f'{known.relative_error:.3g}' if known.relative_error is not None else 'non-finite'}"
        f"{f', max abs {known.max_abs_error:.4g}' if known.max_abs_error is not None else ''})"
        if known is not None
        else ""
    )
    return Bisection(
        **start.base,
        verdict="inconclusive",
        builds=session.builds,
        probes=session.probes,
        search_range=candidates[lo:hi],
        summary=f"{start.note}build cap reached ({session.builds} of {max_builds} builds) with {hi - lo} candidates "
        f"left: {candidates[lo]} .. {candidates[hi - 1]}{best}; raise skus.{sku}.bisect.max_builds "
        "or --max-builds",
    )


def _confirm(
    session: Session, tensor: str, errors: dict[str, TensorError], outputs: list[str], max_builds: int
) -> tuple[str, str | None]:
    """The first divergent tensor confirmed with its node's inputs marked beside it (an input that
    diverges too moves the search back to it: fusion differs between builds, so a neighbour can hide
    a fault), then moved to the maker of values the precision cannot hold. ``errors`` gains every
    measurement; returns the tensor and the node that read the overflowing values (or None)."""
    graph, precision = session.graph, session.precision
    while True:
        ins = [i for i in float_node_inputs(graph, tensor) if i not in errors or i in outputs]
        marked = ([] if tensor in errors else [tensor]) + ins
        if marked and session.builds < max_builds:
            errors.update(session.probe(marked))
        back = next((i for i in float_node_inputs(graph, tensor) if i in errors and errors[i].divergent), None)
        if back is None or session.builds >= max_builds:
            break
        tensor = back
    # a node reading values the precision cannot hold is not where they went wrong: blame their maker
    source = overflow_source(graph, tensor, precision, reference_abs_max(session.reference))
    if source == tensor:
        return tensor, None
    reader, tensor = tensor, source
    todo = [t for t in [tensor, *float_node_inputs(graph, tensor)] if t in graph.producer and t not in errors]
    if todo and session.builds < max_builds:
        errors.update(session.probe(todo))
    if tensor not in errors:  # a graph input, or no build left: what the reference shows
        errors[tensor] = tensor_error(graph, tensor, None, session.reference[tensor], precision)
    return tensor, reader


def _diverges(start: _Start, candidates: list[str], lo: int, k: int, max_builds: int) -> Bisection:
    """The first divergent node, its likely cause and what to keep precise; the first non-finite one."""
    session, failing, out_errors = start.session, start.failing, start.out_errors
    graph, precision = session.graph, session.precision
    # the first divergent tensor: a candidate, or (none diverged) the failing output itself
    errors = {e.tensor: e for e in out_errors}
    tensor, reader = _confirm(
        session, candidates[lo] if lo < len(candidates) else failing[0], errors, list(errors), max_builds
    )
    ins = [i for i in float_node_inputs(graph, tensor) if i in errors]
    suspect = suspect_of(
        session.pair,
        graph,
        tensor,
        errors[tensor],
        [errors[i] for i in ins],
        session.reference,
        reader,
    )
    first_nonfinite = suspect.node if (errors[tensor].nan or errors[tensor].inf) else None
    if first_nonfinite is None and any(e.nan or e.inf for e in out_errors) and session.builds < max_builds:
        later = candidates[lo + 1 :] if lo < len(candidates) else []
        a, b = _search(session, later, k, max_builds, lambda e: bool(e.nan or e.inf), None)
        if a == b:
            first_nonfinite = graph.node_name(later[a]) if a < len(later) else graph.node_name(failing[0])
    summary = f"{start.note}first divergent node {suspect.node} ({suspect.op_type}), likely cause {suspect.cause}: " + (
        f"{suspect.explanation}; an FP32 engine has no higher precision to keep it in"
        if precision == "fp32"
        else f"{suspect.explanation}; keep {suspect.keep} in higher precision"
        if suspect.keep
        else f"{suspect.explanation}; no node to keep in higher precision"
    )
    return Bisection(
        **start.base,
        verdict="diverges",
        builds=session.builds,
        probes=session.probes,
        suspects=[suspect],
        first_nonfinite=first_nonfinite,
        summary=summary,
    )


def scan_candidates(graph: Graph, precision: str) -> list[str]:
    """What a scan measures: every candidate tensor (a folded activation's input left out for INT8)."""
    outputs = {o.name for o in graph.model.graph.output}
    return [t for t in graph.order if t not in outputs and not (precision == "int8" and graph.folded_activation(t))]


def scan_builds(graph: Graph, precision: str, per_build: int = SCAN_MARKS) -> int:
    """The builds a scan takes, the anchor included."""
    return 1 + -(-len(scan_candidates(graph, precision)) // per_build)


def _scan(session: Session, base: dict[str, Any], failing: list[str], per_build: int) -> Bisection:
    """Every candidate tensor's error, ``per_build`` marked per build (all builds, no budget)."""
    graph = session.graph
    candidates = scan_candidates(graph, session.precision)
    errors: dict[str, TensorError] = {}
    for start in range(0, len(candidates), per_build):
        errors.update(session.probe(candidates[start : start + per_build]))
    divergent = [t for t in candidates if errors[t].divergent]
    first = divergent[0] if divergent else None
    nonfinite = next((t for t in candidates if errors[t].nan or errors[t].inf), None)
    suspects = []
    if first is not None:
        ins = [i for i in float_node_inputs(graph, first) if i in errors]
        suspects.append(
            suspect_of(
                session.pair,
                graph,
                first,
                errors[first],
                [errors[i] for i in ins],
                session.reference,
            )
        )
    summary = f"scanned {len(candidates)} tensors in {session.builds} builds: " + (
        f"{len(divergent)} diverge, the first at {graph.node_name(first)}" if first else "none diverges"
    )
    return Bisection(
        **base,
        verdict="diverges" if first else "clean",
        failing_outputs=failing,
        candidates=len(candidates),
        builds=session.builds,
        probes=session.probes,
        suspects=suspects,
        first_nonfinite=graph.node_name(nonfinite) if nonfinite else None,
        summary=summary,
        tensors=[errors[t] for t in candidates],
    )


def _search(
    session: Session,
    candidates: list[str],
    k: int,
    max_builds: int,
    diverges: Callable[[TensorError], bool],
    progress: Callable[[str, float], None] | None,
) -> tuple[int, int]:
    """Narrow [lo, hi) to the first candidate that diverges (hi == len: none before the anchor).
    Each build marks k evenly spaced candidates; returns (lo, hi) with lo == hi when found."""
    lo, hi = 0, len(candidates)
    while lo < hi and session.builds < max_builds:
        width = hi - lo
        marks = list(range(lo, hi)) if width <= k else sorted({lo + (width * (j + 1)) // (k + 1) for j in range(k)})
        errors = session.probe([candidates[m] for m in marks])
        first = next((m for m in marks if diverges(errors[candidates[m]])), None)
        if first is None:
            lo = marks[-1] + 1
        else:
            lo, hi = max([m + 1 for m in marks if m < first], default=lo), first
        if progress is not None:
            progress("bisect", 1 - (hi - lo) / max(len(candidates), 1))
    return lo, hi
