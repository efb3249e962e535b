"""The job summary of one SKU's build: a Markdown table from its manifests."""

from __future__ import annotations

from ..config import Registry
from ..redact import redact

COLUMNS = [("model", "model"), ("passed", "correct"), ("max_abs_error", "max abs error"), ("p50_ms", "p50 ms"),
           ("p99_ms", "p99 ms"), ("throughput_per_s", "samples/s"), ("build_s", "build s"), ("digest", "digest"),
           ("mlflow", "MLflow")]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(registry: Registry, sku: str) -> str:
    """A heading and one row per model with a manifest for ``sku`` (correctness and benchmark)."""
    from ..repro import summary

    registry.sku(sku)  # an unknown SKU is a config error naming the known ones
    rows = [r for r in summary(registry) if r["sku"] == sku]
    lines = [f"### skuforge: {sku}", ""]
    if not rows:
        lines.append("No manifest was written for this SKU (see the job log).")
    else:
        lines.append("| " + " | ".join(title for _, title in COLUMNS) + " |")
        lines.append("|" + "---|" * len(COLUMNS))
        lines += ["| " + " | ".join(_cell(r.get(key)) for key, _ in COLUMNS) + " |" for r in rows]
    return redact("\n".join(lines + [""]))  # the summary is public on the run's page
