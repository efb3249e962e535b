"""The preprocessing drift check: the device's preprocessing against the declared training-side one.

Both run on the same raw files (the data stage packed them into ``<split>.raw.npz``; the training
side's model inputs are ``<split>.npz``). The difference in the model's input is measured on every
sample; the difference in the task metric runs through the engine under test on the samples whose
input differs (the others give the engine the same input, so the same answer), paired, and judged as
the metric gate judges an engine: the observed drop above ``max_metric_drop`` and the exact one-sided
McNemar test calling the device's preprocessing worse. Where the two differ, each differing step is
swapped in alone to name the step that moves the metric (else the input) most.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.core.budget import Budget
from pipeline.core.errors import ConfigError
from pipeline.core.progress import Progress
from pipeline.project.artifacts import layout, load_arrays, read_report, run_plan
from pipeline.project.config import FilePreprocessing, ModelSpec, Pair, device_preprocessing
from pipeline.project.data import run_dataset
from pipeline.project.files import unpack
from pipeline.project.processing import Preprocessor, describe, differing_steps, with_step
from pipeline.results import gatestats
from pipeline.results.reports import (
    DataReport,
    InputDiff,
    PrepareReport,
    PreprocessingDrift,
    StepDrift,
    TaskAgreement,
)
from pipeline.verify.task import GATED, agreement_drop, metric_correct, step_kind, take, task_short, task_text

if TYPE_CHECKING:
    import numpy as np

# the split the check runs on: the first of these given as files (labelled sets first)
DRIFT_SPLITS = ("evaluation", "hard_tail", "golden", "calibration")


def input_diff(reference: np.ndarray, device: np.ndarray) -> InputDiff:
    """Element-wise difference of two stacks of samples (float64; NaN on one side only counts as differing)."""
    import numpy as np

    if reference.shape != device.shape:
        raise ConfigError(
            f"the device's preprocessing gives samples of shape {list(device.shape[1:])}, the reference's "
            f"{list(reference.shape[1:])}",
            hint="the device must fill the same model input: fix skus.<sku>.preprocessing.device",
        )
    a = reference.astype(np.float64).reshape(len(reference), -1)
    b = device.astype(np.float64).reshape(len(device), -1)
    with np.errstate(invalid="ignore"):
        delta = np.abs(a - b)
    differs = (delta > 0) | (np.isnan(a) != np.isnan(b))
    delta = np.where(np.isnan(delta), 0.0, delta)
    return InputDiff(
        max_abs=float(delta.max()) if delta.size else 0.0,
        mean_abs=float(delta.mean()) if delta.size else 0.0,
        samples_differing=int(differs.any(axis=1).sum()),
        elements_differing=float(differs.mean()) if differs.size else 0.0,
    )


def _differing_rows(reference: np.ndarray, device: np.ndarray) -> np.ndarray:
    import numpy as np

    a, b = reference.reshape(len(reference), -1), device.reshape(len(device), -1)
    return np.flatnonzero(~((a == b) | (np.isnan(a) & np.isnan(b))).all(axis=1))


class _Paired:
    """Paired task-metric counts of a variant's inputs against the training-side inputs through the
    engine, run on the samples whose inputs differ only: (worse, better); (0, 0) without a metric.
    The engine's answers on the training-side inputs are kept per sample: each variant (the device's
    steps, then each step alone) runs the engine on its own inputs only."""

    def __init__(
        self,
        runner: Any,
        budget: Budget | None,
        name: str,
        reference: np.ndarray,
        labels: np.ndarray | None,
        spec: ModelSpec,
        in_idx: dict[str, int | None],
        out_idx: dict[str, int | None],
        batch: int,
    ):
        self.runner, self.budget, self.name, self.reference, self.labels = runner, budget, name, reference, labels
        self.spec = spec
        self.kind = spec.metric.kind if labels is not None and spec.metric is not None else None
        self.in_idx, self.out_idx, self.batch = in_idx, out_idx, batch
        self.known: dict[int, bool] = {}  # sample -> right with the training-side inputs

    def _correct(self, x: np.ndarray, rows: np.ndarray, label: str) -> np.ndarray:
        assert self.kind is not None and self.labels is not None
        infer = self.runner.infer
        if self.budget is not None:
            infer = self.budget.calls(infer, f"validate drift {label}", len(rows), "sample")
        got = run_dataset(infer, {self.name: x[rows]}, self.in_idx, self.out_idx, self.batch)
        return metric_correct(self.spec, got, take(self.labels, rows.tolist()))[0]

    def __call__(self, x: np.ndarray, label: str) -> tuple[int, int]:
        import numpy as np

        rows = _differing_rows(self.reference, x)
        if self.kind is None or not len(rows):
            return 0, 0
        missing = np.array([i for i in rows.tolist() if i not in self.known], dtype=np.int64)
        if len(missing):
            for i, ok in zip(missing.tolist(), self._correct(self.reference, missing, "training side"), strict=True):
                self.known[i] = bool(ok)
        r = np.array([self.known[i] for i in rows.tolist()])
        d = self._correct(x, rows, label)
        return int(np.count_nonzero(r & ~d)), int(np.count_nonzero(d & ~r))


@dataclass
class _DriftRun:
    """What the drift check of every input of one (model, SKU) shares: the engine, the samples'
    raw files and training-side inputs, the run plan."""

    pair: Pair
    runner: Any
    budget: Budget | None
    split: str
    plan: tuple[dict, dict, int]  # in_idx, out_idx, batch
    raw: tuple[Any, Any, Any]  # blobs, names, labels
    trained: dict[str, Any]
    data: DataReport
    engine_scores: dict[str, float]

    def input_drift(self, name: str, reference: Any) -> PreprocessingDrift:
        """One input's check: the device's preprocessing against the training side's, the steps
        that differ, the metric drop (labels) or the postprocess's agreement (none)."""
        pair, runner, budget, split = self.pair, self.runner, self.budget, self.split
        sku, spec, sku_spec = pair.sku, pair.spec, pair.sku_spec
        in_idx, out_idx, batch = self.plan
        blobs, names, labels = self.raw
        data, engine_scores = self.data, self.engine_scores
        gate = sku_spec.preprocessing
        confidence = pair.metric_gate.confidence
        device = device_preprocessing(reference, gate.device)
        dtype = spec.input(name).dtype
        ref_x = self.trained[name]
        dev_x = Preprocessor(device, dtype)(blobs, names)
        diff = input_diff(ref_x, dev_x)
        judged = spec.metric is not None and labels is not None
        judge = _Paired(runner, budget, name, ref_x, labels, spec, in_idx, out_idx, batch)
        worse, better = judge(dev_x, "device")
        # label-free: the postprocess's results with the device's inputs against the training side's
        agreement_gate = gate.max_agreement_drop
        if agreement_gate is None and not judged:
            agreement_gate = gate.max_metric_drop  # no labels: the drop is judged as agreement
        task_tol = pair.tolerance.task
        agreement = (
            agreement_drop(
                spec,
                task_tol,
                _outputs(runner, budget, name, dev_x, in_idx, out_idx, batch, "device"),
                _outputs(runner, budget, name, ref_x, in_idx, out_idx, batch, "training side"),
                split,
                agreement_gate,
                confidence,
            )
            if task_tol is not None and step_kind(spec) in GATED
            else None
        )
        drifted = bool(diff.samples_differing)
        steps = _attribute(reference, device, blobs, names, dtype, judge) if drifted else []
        n = len(ref_x)
        drop = (worse - better) / n if judged and n else None
        culprit = _culprit(steps)
        failure, judgeable = _failure(
            name,
            split,
            sku,
            drop,
            worse,
            better,
            n,
            diff,
            gate.max_metric_drop,
            gate.max_input_diff,
            confidence,
            spec.metric.kind if spec.metric else None,
            judged,
            steps,
            culprit,
            agreement,
        )
        reference_score = engine_scores.get(split)
        return PreprocessingDrift(
            input=name,
            split=split,
            samples=n,
            reference=data.preprocessing.get(name, describe(reference)),
            device=describe(device),
            differing_steps=differing_steps(reference, device),
            diff=diff,
            metric=spec.metric.kind if judged and spec.metric else None,
            metric_reference=reference_score if judged else None,
            metric_device=(
                reference_score - drop if judged and reference_score is not None and drop is not None else None
            ),
            metric_drop=drop,
            worse=worse,
            better=better,
            p_value=gatestats.mcnemar_p(worse, better) if judged else None,
            drop_interval=gatestats.drop_interval(worse, better, n, confidence) if judged and n else None,
            confidence=confidence,
            max_metric_drop=gate.max_metric_drop,
            max_input_diff=gate.max_input_diff,
            steps=steps,
            culprit=culprit,
            passed=failure is None,
            failure=failure,
            judgeable=judgeable,
            agreement=agreement,
            max_agreement_drop=agreement_gate if agreement is not None else None,
        )


def preprocessing_drift(
    pair: Pair,
    runner: Any,
    engine_scores: dict[str, float],
    progress: Progress | None = None,
    budget: Budget | None = None,
) -> list[PreprocessingDrift]:
    """The drift check of each input made from raw files (none: an empty list). ``engine_scores``:
    the engine's task metric per split with the training-side inputs (the validate stage's)."""
    model, spec = pair.model, pair.spec
    files = spec.file_inputs
    split = next((s for s in DRIFT_SPLITS if (src := getattr(spec.datasets, s)) is not None and src.files), None)
    if not files or split is None:
        return []
    out = layout(pair.registry)
    data = read_report(out.report(model, None, "data"), DataReport, "data")
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    in_idx, out_idx, batch = run_plan(pair, prep.signature)
    blobs, names, labels = unpack(load_arrays(out.split(model, split, raw=True), "data"))
    trained = load_arrays(out.split(model, split), "data")
    run = _DriftRun(
        pair=pair,
        runner=runner,
        budget=budget,
        split=split,
        plan=(in_idx, out_idx, batch),
        raw=(blobs, names, labels),
        trained=trained,
        data=data,
        engine_scores=engine_scores,
    )
    results = []
    for name, reference in files.items():
        if progress is not None:
            progress(f"validate preprocessing {name}", 0.0)
        results.append(run.input_drift(name, reference))
        if progress is not None:
            progress(f"validate preprocessing {name}", 1.0)
    return results


def _outputs(
    runner: Any,
    budget: Budget | None,
    name: str,
    x: np.ndarray,
    in_idx: dict[str, int | None],
    out_idx: dict[str, int | None],
    batch: int,
    label: str,
) -> dict[str, np.ndarray]:
    infer = runner.infer
    if budget is not None:
        infer = budget.calls(infer, f"validate drift {label}", len(x), "sample")
    return run_dataset(infer, {name: x}, in_idx, out_idx, batch)


def _attribute(
    reference: FilePreprocessing,
    device: FilePreprocessing,
    blobs: list[bytes],
    names: list[str],
    dtype: str,
    judge: _Paired,
) -> list[StepDrift]:
    """Each differing step swapped in alone: its input difference and metric drop."""
    ref_steps, dev_steps = reference.steps(), device.steps()
    out = []
    for step in differing_steps(reference, device):
        try:
            variant = with_step(reference, device, step)
        except ConfigError:
            continue  # a step that cannot stand alone: the whole device pipeline's figures still stand
        x = Preprocessor(variant, dtype)(blobs, names)
        worse, better = judge(x, step)
        out.append(
            StepDrift(
                step=step,
                reference=ref_steps[step],
                device=dev_steps[step],
                input=input_diff(judge.reference, x),
                metric_drop=(worse - better) / len(x) if judge.kind is not None and len(x) else None,
                worse=worse,
                better=better,
            )
        )
    return out


def _culprit(steps: list[StepDrift]) -> str | None:
    """The step that alone costs the most metric, else moves the input most; steps that tie
    exactly (a library swap shows in every step that library runs) are named together."""
    if not steps:
        return None

    def key(s: StepDrift) -> tuple[float, float]:  # a step that moves the metric either way is drift
        return (abs(s.metric_drop or 0.0), s.input.max_abs)

    top = max(key(s) for s in steps)
    if top == (0.0, 0.0):
        return None
    return "+".join(s.step for s in steps if key(s) == top)


def settings_text(value: Any) -> str:
    """A step's settings on one line: ``order bgr, library pillow``."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {settings_text(v)}" for k, v in value.items() if v is not None) or "-"
    if isinstance(value, list | tuple):
        return "x".join(map(str, value))
    return str(value)


def _failure(
    name: str,
    split: str,
    sku: str,
    drop: float | None,
    worse: int,
    better: int,
    n: int,
    diff: InputDiff,
    max_drop: float | None,
    max_diff: float | None,
    confidence: float,
    kind: str | None,
    judged: bool,
    steps: list[StepDrift],
    culprit: str | None,
    agreement: TaskAgreement | None = None,
) -> tuple[str | None, bool]:
    """The gate's verdict as one line naming the step (None: it passes, or nothing is gated), and
    whether the split could judge it (False: no labels or too few samples, which fails closed).
    ``agreement``: the postprocess's results device against training side, gated where it has a
    threshold (max_agreement_drop, or max_metric_drop for a model without labels)."""
    key = f"skus.{sku}.preprocessing"
    blame = ""
    if culprit is not None:
        s = next(x for x in steps if x.step == culprit.split("+")[0])
        alone = (
            f"costs {s.metric_drop:.4g} alone"
            if s.metric_drop is not None
            else f"moves it by up to {s.input.max_abs:.4g}"
        )
        blame = (
            f"; the step: {culprit} (device: {settings_text(s.device)}; training side: "
            f"{settings_text(s.reference)}) {alone}"
        )
    if agreement is not None and agreement.threshold is not None:
        if not agreement.judgeable:
            return (
                f"preprocessing of input {name!r}: {task_short(agreement) or 'nothing to compare'}: the drift "
                "cannot be judged (fails closed)"
            ), False
        if agreement.failure:
            allowed = agreement.threshold if agreement.direction == "max" else 1.0 - agreement.threshold
            return (
                f"preprocessing of input {name!r}: with the device's steps, {task_text(agreement)} against the "
                f"training side's (n={n}), a change above {key}.max_agreement_drop {allowed:g}{blame}"
            ), True
    if max_drop is not None and not judged and (agreement is None or agreement.threshold is None):
        return (
            f"preprocessing of input {name!r}: {key}.max_metric_drop is set but the {split} files have no "
            "labels or the model no metric, and no postprocess to judge its results by: the drift cannot be "
            "judged (fails closed)"
        ), False
    if max_drop is not None and judged:
        assert drop is not None
        needed = gatestats.min_samples_for_drop(max_drop, confidence)
        if n < needed:
            return (
                f"preprocessing of input {name!r}: {n} {split} samples cannot resolve {key}.max_metric_drop "
                f"{max_drop:g} at {confidence:.0%} confidence: it needs {needed} labelled samples (fails closed)"
            ), False
        if gatestats.drop_fails(worse, better, n, max_drop, confidence):
            lo, hi = gatestats.drop_interval(worse, better, n, confidence)
            return (
                f"preprocessing of input {name!r}: the device's steps cost {drop:.4g} {kind} on {split} "
                f"(n={n}: {worse} worse, {better} better, McNemar p={gatestats.mcnemar_p(worse, better):.3g}, "
                f"drop {lo:.4g}..{hi:.4g}), above {key}.max_metric_drop {max_drop:g}{blame}"
            ), True
    if max_diff is not None and diff.max_abs > max_diff:
        return (
            f"preprocessing of input {name!r}: the device's steps move the model input by up to {diff.max_abs:.4g} "
            f"({diff.samples_differing} of {n} samples differ), above {key}.max_input_diff {max_diff:g}{blame}"
        ), True
    return None, True


def drift_line(d: PreprocessingDrift) -> str:
    """One log line: what differs, how far the input moved and what it cost."""
    what = ", ".join(d.differing_steps) or "none (same steps and libraries)"
    line = (
        f"preprocessing {d.input} on {d.split} (n={d.samples}): device {d.device['versions']} vs training side "
        f"{d.reference.get('versions')}; differing steps: {what}; input max |diff| {d.diff.max_abs:.4g}, "
        f"{d.diff.samples_differing} samples differ"
    )
    if d.metric_drop is not None:
        line += f"; {d.metric} drop {d.metric_drop:+.4g} ({d.worse} worse, {d.better} better)"
    if d.agreement is not None:
        line += f"; {task_text(d.agreement)} against the training side's"
    if d.culprit:
        line += f"; most from step {d.culprit}"
    gate = [f"max_metric_drop {d.max_metric_drop:g}"] if d.max_metric_drop is not None else []
    gate += [f"max_agreement_drop {d.max_agreement_drop:g}"] if d.max_agreement_drop is not None else []
    gate += [f"max_input_diff {d.max_input_diff:g}"] if d.max_input_diff is not None else []
    verdict = f" [gate: {', '.join(gate)}: {'pass' if d.passed else 'FAIL'}]" if gate else " [reported, not gated]"
    return line + verdict
