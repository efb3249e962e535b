"""The job summary of one SKU's build: a Markdown table from its manifests."""

from __future__ import annotations

from pipeline.core.redact import redact
from pipeline.engine.matrix import matrix
from pipeline.project.config import Registry

COLUMNS = [
    ("model", "model"),
    ("passed", "correct"),
    ("max_abs_error", "max abs error"),
    ("p50_ms", "p50 ms"),
    ("p99_ms", "p99 ms"),
    ("throughput_per_s", "samples/s"),
    ("build_s", "build s"),
    ("digest", "digest"),
    ("mlflow", "MLflow"),
]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(registry: Registry, sku: str, report_url: str | None = None) -> str:
    """A heading and one row per model for ``sku``: correctness and benchmark where a manifest was
    written; otherwise the outcome (gate failed, build failed, unsupported, not run) and why.
    ``report_url``: where the job's HTML report (``skuforge report``) can be downloaded; a job
    summary cannot show its charts itself (GitHub drops ``data:`` images), so it links to them."""

    registry.sku(sku)  # an unknown SKU is a config error naming the known ones
    pairs = [p for p in matrix(registry, skus=[sku]) if p.manifest is not None or p.outcome != "not run" or p.exit_code]
    lines = [f"### skuforge: {sku}", ""]
    if not pairs:
        lines.append("No manifest was written for this SKU (see the job log).")
    else:
        lines.append("| " + " | ".join(title for _, title in COLUMNS) + " | outcome |")
        lines.append("|" + "---|" * (len(COLUMNS) + 1))
        for p in pairs:
            row = {**(p.manifest or {}), "model": p.model}
            outcome = p.label if p.outcome == "passed" else f"**{p.outcome}**: {_escape(p.detail)}"
            lines.append("| " + " | ".join(_cell(row.get(key)) for key, _ in COLUMNS) + f" | {outcome} |")
    if report_url:
        lines += [
            "",
            f"Latency histograms and CDFs, warm-up timelines, percentile intervals and the cross-SKU "
            f"latency chart: the HTML report in the [run's artifacts]({report_url}) (artifact "
            f"`sku-{sku}`, `build/ci/{sku}/report/index.html`).",
        ]
    return redact("\n".join(lines + [""]))  # the summary is public on the run's page


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
