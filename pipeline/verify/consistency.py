"""Cross-SKU consistency: every SKU's outputs on the golden set, against the reference and against
each other. Per model and output, a matrix over ``reference`` and the SKUs of max and mean abs
error and, for classification scores, top-1 agreement.

Error statistics follow validate's (pipeline/verify/compare.py): taken over the elements finite on both
sides, with the NaN/Inf values counted apart; an output's kind (declared in
``models.<m>.output_kinds``, else inferred from the reference) says whether it holds class scores,
whose top-1 agreement is computed.

It reads what validate left: ``outputs.npz`` next to ``validate.json``, trusted only when its
hash is the one the report records and the report is about the engine ``build.json`` describes
(a SKU that fails either check is listed under ``skipped`` with the reason, never compared).
The report holds nothing volatile (no time, host or absolute path): the checked-in copy under
``reports/consistency/`` changes only when an engine's outputs change.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import Field

from pipeline.core.errors import InputError
from pipeline.core.io import atomic_write_bytes, atomic_write_json, read_json, sha256_arrays
from pipeline.core.paths import Layout
from pipeline.engine.matrix import EMULATE_STAGE
from pipeline.project.config import CLASS_KINDS, Registry
from pipeline.results.reports import BuildReport, OutputKind, ReferenceReport, Result, ValidationReport
from pipeline.verify.compare import infer_kind

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

REFERENCE = "reference"


class ComparedSku(Result):
    sku: str
    backend: str
    precision: str
    validate_passed: bool = Field(description="the SKU's validate gates (this matrix is a report, not a gate)")
    engine_sha256: str
    outputs_sha256: str
    emulated: bool = Field(
        False, description="outputs of the engine under QEMU emulation (emulate.json): its device's are not here"
    )


class SkippedSku(Result):
    sku: str
    reason: str


class NonFinite(Result):
    nan: int
    inf: int


class OutputMatrix(Result):
    """One output: square matrices over ``labels`` (``reference``, then the SKUs), symmetric, zero
    (agreement one) on the diagonal."""

    output: str
    dtype: str
    shape: list[int]
    kind: OutputKind = Field(description="declared in models.<m>.output_kinds, else inferred from the reference")
    labels: list[str]
    max_abs_error: list[list[float | None]] = Field(description="over the elements finite on both sides (null: none)")
    mean_abs_error: list[list[float | None]]
    nonfinite_mismatch: list[list[int]] = Field(
        description="elements where one side is NaN/Inf and the other is not, or holds another non-finite value"
    )
    top1_agreement: list[list[float | None]] | None = Field(
        None,
        description="class scores only: the share of rows (positions before the last axis) whose top class "
        "agrees (a tie on either side agrees; a row with NaN/Inf agrees only with the same row)",
    )
    nonfinite: dict[str, NonFinite] = Field(description="NaN and Inf counts per label")

    def cell(self, metric: str, a: str, b: str) -> float | int | None:
        table = getattr(self, metric)
        return None if table is None else table[self.labels.index(a)][self.labels.index(b)]


class ConsistencyReport(Result):
    model: str
    samples: int = Field(description="golden samples")
    reference_sha256: str = Field(description="sha256_arrays of the reference golden outputs")
    skus: list[ComparedSku]
    skipped: list[SkippedSku]
    outputs: list[OutputMatrix]


def consistency(registry: Registry, model: str) -> ConsistencyReport:
    """The matrix of ``model`` over every SKU whose golden outputs can be trusted.

    InputError when the model has no reference outputs (or they do not match reference.json);
    SKUs without trustworthy outputs are skipped with a reason.
    """
    spec = registry.model(model)  # an unknown model: ConfigError naming the known ones
    out = Layout(registry.root)
    ref, expected = _reference(out, model)
    compared: list[ComparedSku] = []
    skipped: list[SkippedSku] = []
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for _, sku in registry.pairs(models=[model]):
        found = _sku_outputs(registry, out, model, sku, ref, expected)
        if isinstance(found, str):
            skipped.append(SkippedSku(sku=sku, reason=found))
            log.debug("[%s/%s] not in the consistency matrix: %s", model, sku, found)
            continue
        entry, values = found
        compared.append(entry)
        arrays[sku] = values
    matrices = [
        _matrix(name, expected[name], {s: a[name] for s, a in arrays.items()}, spec.output_kinds.get(name))
        for name in ref.outputs
    ]
    return ConsistencyReport(
        model=model,
        samples=ref.samples.get("golden", 0),
        reference_sha256=ref.output_sha256["golden"],
        skus=compared,
        skipped=skipped,
        outputs=matrices,
    )


def write_report(registry: Registry, report: ConsistencyReport) -> list[str]:
    """Write ``reports/consistency/<model>.json`` and ``.md`` (atomically); their paths, relative to the root."""
    out = Layout(registry.root)
    json_path, md_path = out.consistency_report(report.model, ".json"), out.consistency_report(report.model, ".md")
    atomic_write_json(json_path, report.to_json())
    atomic_write_bytes(md_path, markdown(report).encode())
    return [p.relative_to(registry.root).as_posix() for p in (json_path, md_path)]


def refresh_reports(registry: Registry, models: list[str] | None = None) -> dict[str, list[str] | str]:
    """Write the report of each model (default: all) that has a reference and at least one SKU with
    trustworthy outputs: model -> the files written, or why none were (an older report is kept, not
    replaced by an empty one). What `skuforge repro` and `skuforge ci assemble` run at their end."""
    done: dict[str, list[str] | str] = {}
    for model in models or list(registry.models):
        try:
            report = consistency(registry, model)
        except InputError as exc:
            done[model] = exc.message
            continue
        if not report.skus:
            done[model] = (
                "no SKU has golden outputs to compare ("
                + "; ".join(f"{s.sku}: {s.reason}" for s in report.skipped[:3])
                + (" …" if len(report.skipped) > 3 else "")
                + ")"
            )
            continue
        done[model] = write_report(registry, report)
    return done


# --- reading what validate wrote ----------------------------------------------------------------


def _rel(out: Layout, path) -> str:
    return path.relative_to(out.root).as_posix()


def _load(path) -> dict[str, np.ndarray]:
    import numpy as np

    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _reference(out: Layout, model: str) -> tuple[ReferenceReport, dict[str, np.ndarray]]:
    report_path, golden = out.report(model, None, "reference"), out.reference_dir(model) / "golden.npz"
    hint = f"run the reference stage: skuforge reference --model {model} (or dvc repro / dvc pull)"
    if not report_path.is_file() or not golden.is_file():
        missing = report_path if not report_path.is_file() else golden
        raise InputError(
            f"{_rel(out, missing)} does not exist: no reference outputs to compare {model}'s SKUs with", hint=hint
        )
    try:
        ref = ReferenceReport.model_validate(read_json(report_path))
        arrays = _load(golden)
    except Exception as exc:  # not JSON, not a reference report, a damaged archive
        raise InputError(f"cannot read the reference of {model}: {type(exc).__name__}: {exc}", hint=hint) from exc
    if "golden" not in ref.output_sha256 or sha256_arrays(arrays) != ref.output_sha256["golden"]:
        raise InputError(
            f"{_rel(out, golden)} is not the file {_rel(out, report_path)} describes (sha256 differs)", hint=hint
        )
    return ref, {name: arrays[name] for name in ref.outputs}


def _sku_outputs(
    registry: Registry, out: Layout, model: str, sku: str, ref: ReferenceReport, expected: dict[str, np.ndarray]
) -> tuple[ComparedSku, dict[str, np.ndarray]] | str:
    """The SKU's entry and golden outputs, or why they cannot be trusted: the device's validation,
    else the engine's under emulation (an aarch64 SKU checked on an x86 host)."""
    stage = "validate" if out.report(model, sku, "validate").is_file() else EMULATE_STAGE
    val_path, build_path, npz = (
        out.report(model, sku, stage),
        out.report(model, sku, "build"),
        out.engine_outputs(model, sku, stage),
    )
    again = f"validate it again (skuforge {stage} --model {model} --sku {sku}) or dvc pull its outputs"
    if not val_path.is_file():
        return "not validated in this checkout (no validate.json)"
    try:
        val = ValidationReport.model_validate(read_json(val_path))
    except ValueError as exc:
        return f"{_rel(out, val_path)} is not a validate report ({type(exc).__name__}): {again}"
    if not build_path.is_file():
        return f"no build.json: cannot tell whether {_rel(out, val_path)} is about the current engine"
    try:
        build = BuildReport.model_validate(read_json(build_path))
    except ValueError as exc:
        return f"{_rel(out, build_path)} is not a build report ({type(exc).__name__}): rebuild it"
    if val.engine_sha256 != build.engine_sha256:
        return (
            f"{val_path.name} is about engine {val.engine_sha256[:12]}, build.json describes "
            f"{build.engine_sha256[:12]}: {again}"
        )
    if val.outputs_sha256 is None:
        return f"{val_path.name} records no golden outputs (written before outputs.npz existed): {again}"
    if not npz.is_file():
        return f"{_rel(out, npz)} does not exist: {again}"
    try:
        arrays = _load(npz)
    except Exception as exc:  # a damaged archive: zipfile, OSError or ValueError
        return f"{_rel(out, npz)} is damaged ({type(exc).__name__}): {again}"
    digest = sha256_arrays(arrays)
    if digest != val.outputs_sha256:
        return (
            f"{_rel(out, npz)} has sha256 {digest[:12]} but {val_path.name} records {val.outputs_sha256[:12]} "
            f"(altered, or left by another run): {again}"
        )
    for name, reference in expected.items():
        if name not in arrays:
            return f"{_rel(out, npz)} has no output {name!r}: {again}"
        if arrays[name].shape != reference.shape:
            return f"output {name!r} has shape {list(arrays[name].shape)}, the reference {list(reference.shape)}"
    entry = ComparedSku(
        sku=sku,
        backend=build.backend,
        precision=val.precision,
        validate_passed=val.passed,
        engine_sha256=val.engine_sha256,
        outputs_sha256=val.outputs_sha256,
        emulated=stage == EMULATE_STAGE,
    )
    return entry, {name: arrays[name] for name in expected}


# --- the matrices -------------------------------------------------------------------------------


def pair_stats(a: np.ndarray, b: np.ndarray, classes: bool) -> tuple[float | None, float | None, int, float | None]:
    """``a`` against ``b``: max and mean abs error over the elements finite on both sides (None:
    there are none), the count of elements whose non-finite values differ, and for class scores
    (``classes``) the top-1 agreement. Symmetric in ``a`` and ``b``."""
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    fx, fy = np.isfinite(x), np.isfinite(y)
    both = fx & fy
    d = np.abs(x[both] - y[both])
    same = (x == y) | (np.isnan(x) & np.isnan(y))
    mismatch = int(np.count_nonzero(~both & ~same))
    max_abs = float(d.max()) if d.size else None
    mean_abs = float(d.mean()) if d.size else None
    return max_abs, mean_abs, mismatch, _top1(x, y, same) if classes else None


def _top1(x: np.ndarray, y: np.ndarray, same: np.ndarray) -> float | None:
    import numpy as np

    if x.ndim == 0 or x.shape[-1] < 2 or x.size == 0:
        return None
    rows_x, rows_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    finite = np.isfinite(rows_x).all(axis=1) & np.isfinite(rows_y).all(axis=1)
    identical = same.reshape(-1, x.shape[-1]).all(axis=1)
    with np.errstate(invalid="ignore"):
        at_max_x = rows_x == rows_x.max(axis=1, keepdims=True)
        at_max_y = rows_y == rows_y.max(axis=1, keepdims=True)
    idx = np.arange(len(rows_x))
    # ties on either side agree: the other's top class is one of this side's maxima
    agree = at_max_x[idx, np.argmax(rows_y, axis=1)] | at_max_y[idx, np.argmax(rows_x, axis=1)]
    return float(np.mean(np.where(finite, agree, identical)))


def _matrix(
    name: str, reference: np.ndarray, engines: dict[str, np.ndarray], declared: OutputKind | None
) -> OutputMatrix:
    import numpy as np

    labels = [REFERENCE, *engines]
    values = [reference, *engines.values()]
    kind = declared or infer_kind(reference)
    classes = kind in CLASS_KINDS
    n = len(labels)
    max_abs: list[list[float | None]] = [[0.0] * n for _ in range(n)]
    mean_abs: list[list[float | None]] = [[0.0] * n for _ in range(n)]
    mismatch = [[0] * n for _ in range(n)]
    top1: list[list[float | None]] | None = [[1.0] * n for _ in range(n)] if classes else None
    for i in range(n):
        for j in range(i + 1, n):
            mx, mean, bad, agree = pair_stats(values[i], values[j], classes)
            max_abs[i][j] = max_abs[j][i] = mx
            mean_abs[i][j] = mean_abs[j][i] = mean
            mismatch[i][j] = mismatch[j][i] = bad
            if top1 is not None:
                top1[i][j] = top1[j][i] = agree
    nonfinite = {}
    for label, v in zip(labels, values, strict=True):
        floating = np.issubdtype(v.dtype, np.floating)
        nonfinite[label] = NonFinite(
            nan=int(np.isnan(v).sum()) if floating else 0, inf=int(np.isinf(v).sum()) if floating else 0
        )
    return OutputMatrix(
        output=name,
        dtype=str(reference.dtype),
        shape=list(reference.shape),
        kind=kind,
        labels=labels,
        max_abs_error=max_abs,
        mean_abs_error=mean_abs,
        nonfinite_mismatch=mismatch,
        top1_agreement=top1,
        nonfinite=nonfinite,
    )


# --- rendering ----------------------------------------------------------------------------------


def fmt_error(value: float | None) -> str:
    return "n/a" if value is None else "0" if value == 0 else f"{value:.3g}"


def fmt_agreement(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def table(matrix: OutputMatrix, metric: str = "max_abs_error") -> list[list[str]]:
    """Rows of one metric's matrix, a header row first; ``max_abs_error`` cells carry the top-1
    agreement in brackets for class scores. A cell whose pair differs in NaN/Inf values says how
    many elements. Shared by the Markdown file and the CLI."""
    rows = [["", *matrix.labels]]
    for i, a in enumerate(matrix.labels):
        cells = [a]
        for j, b in enumerate(matrix.labels):
            if i == j:
                cells.append("·")
                continue
            cell = fmt_error(matrix.cell(metric, a, b))
            if metric == "max_abs_error" and matrix.top1_agreement is not None:
                cell += f" ({fmt_agreement(matrix.cell('top1_agreement', a, b))})"
            if matrix.cell("nonfinite_mismatch", a, b):
                cell += f" +{matrix.cell('nonfinite_mismatch', a, b)} NaN/Inf"
            cells.append(cell)
        rows.append(cells)
    return rows


def nonfinite_line(matrix: OutputMatrix) -> str | None:
    bad = [f"{k} {v.nan} NaN, {v.inf} Inf" for k, v in matrix.nonfinite.items() if v.nan or v.inf]
    return ("non-finite values: " + "; ".join(bad)) if bad else None


def describe(matrix: OutputMatrix) -> str:
    what = "max abs error (top-1 agreement)" if matrix.top1_agreement is not None else "max abs error"
    return f"output `{matrix.output}` {matrix.dtype} {matrix.shape}, {matrix.kind}: {what}"


def markdown(report: ConsistencyReport) -> str:
    """The report as a Markdown page (what `reports/consistency/<model>.md` holds)."""

    def md_table(rows: list[list[str]]) -> list[str]:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        return lines + ["| " + " | ".join(r) + " |" for r in rows[1:]]

    intro = (
        f"Every SKU's outputs on the {report.samples} golden samples, against the ONNX Runtime CPU FP32 reference "
        f"(golden outputs `{report.reference_sha256[:12]}`) and against each other. Written by "
        f"`skuforge compare --model {report.model} --write` (and `skuforge repro`); a report, not a gate: "
        f"validate gates each SKU against the reference."
    )
    lines = [f"# Cross-SKU consistency: {report.model}", "", intro, ""]
    if report.skus:
        lines += md_table(
            [["SKU", "backend", "precision", "validate", "engine", "outputs"]]
            + [
                [
                    s.sku,
                    s.backend,
                    s.precision,
                    ("passed" if s.validate_passed else "FAILED") + (" (emulated)" if s.emulated else ""),
                    f"`{s.engine_sha256[:12]}`",
                    f"`{s.outputs_sha256[:12]}`",
                ]
                for s in report.skus
            ]
        )
        lines.append("")
    if report.skipped:
        lines.append("Not compared:")
        lines += [f"- {s.sku}: {s.reason}" for s in report.skipped]
        lines.append("")
    if not report.skus:
        lines += ["No SKU has golden outputs to compare.", ""]
        return "\n".join(lines)
    for m in report.outputs:
        lines += [f"## {describe(m)}", ""]
        lines += md_table(table(m))
        lines += ["", "Mean abs error:", ""]
        lines += md_table(table(m, "mean_abs_error"))
        extra = nonfinite_line(m)
        lines += ["", extra, ""] if extra else [""]
    return "\n".join(lines)


def refresh_lines(done: dict) -> list[str]:
    """One line per model of ``consistency.refresh_reports``'s result (`repro`, `ci assemble`)."""
    return [
        f"consistency {model}: " + (f"wrote {', '.join(r)}" if isinstance(r, list) else f"not written: {r}")
        for model, r in done.items()
    ]
