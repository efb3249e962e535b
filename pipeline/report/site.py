"""The static HTML report: an index, a cross-SKU page per model and a page per (model, SKU).

Every value shown comes from a report file and is untrusted: the templates escape everything
(Jinja2 autoescape), the pages carry a Content-Security-Policy that runs no script and loads
nothing from the network, and the charts are PNG files next to the pages (or, in the
self-contained ``report.html`` that publish uploads, data URIs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from pipeline.core.errors import InputError
from pipeline.core.io import atomic_dir, atomic_write_bytes
from pipeline.core.paths import Layout, inside
from pipeline.core.progress import Progress
from pipeline.project.config import Registry
from pipeline.report.common import (
    DEFAULT_DIR,
    MARKER,
    PAIR_REPORT,
    ChartFiles,
    environment,
    inline_png,
    outcomes_of,
    provenance,
    safe_name,
)
from pipeline.report.load import load_pair
from pipeline.report.models import consistency_view, model_charts, model_row, selection_view
from pipeline.report.pair import pair_html

log = logging.getLogger(__name__)


def _target(registry: Registry, out: str | Path | None) -> Path:
    """The report folder, inside the project, and one this module may replace."""
    root = Path(registry.root)
    target = inside(root, out if out is not None else DEFAULT_DIR)
    if target.resolve() == root.resolve():
        raise InputError(
            f"{target} is the project root: the report needs a folder of its own",
            hint=f"pass --out {DEFAULT_DIR.as_posix()} (the default)",
        )
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (target / MARKER).is_file())):
        raise InputError(
            f"{target} exists and is not a skuforge report: writing the report would replace it",
            hint="choose another --out folder (or remove that one)",
        )
    return target


def write_site(
    registry: Registry,
    model: str | None = None,
    out: str | Path | None = None,
    skus: list[str] | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write the HTML report of ``model`` (default: every model) over ``skus`` (default: every
    SKU) under ``out`` (relative to the project root; default build/report), replacing the
    previous report in one swap. Returns the index page. ``progress`` hears of each page (the
    charts make a pair page take a second or more).

    InputError (exit 2) when a report file is not JSON, or ``out`` leaves the project or holds
    something other than an earlier report; missing pieces are left out and said so on the pages.
    """
    models = [model] if model else list(registry.models)
    for m in models:
        registry.model(m)  # an unknown model: ConfigError naming the known ones
    skus = list(dict.fromkeys(skus)) if skus else list(registry.skus)
    for s in skus:
        registry.sku(s)
    target = _target(registry, out)
    layout = Layout(registry.root)
    pairs = {(m, s): load_pair(layout, safe_name(m), safe_name(s)) for m, s in registry.pairs(models, skus)}
    index_notes: list[str] = []
    outcomes = outcomes_of(registry, models, pairs, index_notes)
    env = environment()
    with atomic_dir(target) as tmp:
        (tmp / MARKER).write_text("written by skuforge report: `skuforge report` replaces this folder\n")
        index_models = []
        counts: dict[str, int] = {}
        pages = sum(1 for pair in pairs.values() if pair.has_page) + len(models) + 1
        written = 0

        def page(what: str) -> None:
            nonlocal written
            if progress is not None:
                progress(f"report {what}", written / pages)
            written += 1

        for m in models:
            rows, listed = [], []
            for s in [s for pm, s in pairs if pm == m]:  # the SKUs the model selects
                pair, outcome = pairs[m, s], outcomes[m, s]
                counts[outcome[0]] = counts.get(outcome[0], 0) + 1
                href = None
                if pair.has_page:
                    page(f"{m}/{s}")
                    folder = tmp / m / s
                    folder.mkdir(parents=True)
                    html = pair_html(env, pair, outcome, ChartFiles(folder), nav=True)
                    (folder / "index.html").write_text(html, encoding="utf-8")
                    href = f"{s}/index.html"
                row = model_row(pair, outcome, href)
                rows.append(row)
                listed.append(
                    {
                        "sku": s,
                        "backend": registry.sku(s).backend,
                        "outcome": outcome[0],
                        "detail": outcome[1],
                        "p50": row["p50"],
                        "p99": row["p99"],
                        "href": f"{m}/{href}" if href else None,
                        "gaps": registry.sku(s).known_gaps,
                    }
                )
            (tmp / m).mkdir(exist_ok=True)
            page(m)
            notes: list[str] = []
            charts = model_charts(m, rows, ChartFiles(tmp / m), notes)
            html = env.get_template("model.html.j2").render(
                model=m,
                rows=rows,
                show_drift=any(r["drift"] for r in rows),
                show_energy=any(r["energy"] for r in rows),
                charts=charts,
                consistency=consistency_view(layout.consistency_report(m)),
                selection=selection_view(registry, m, ChartFiles(tmp / m), notes),
                page_notes=notes,
            )
            (tmp / m / "index.html").write_text(html, encoding="utf-8")
            index_models.append({"name": m, "href": f"{m}/index.html", "pairs": listed})
        html = env.get_template("index.html.j2").render(
            models=index_models, counts=counts, page_notes=index_notes, written=provenance(Path(registry.root))
        )
        (tmp / "index.html").write_text(html, encoding="utf-8")
        if progress is not None:
            progress("report written", 1.0)
    log.info("report of %s written to %s", ", ".join(models), target)
    return target / "index.html"


def write_pair_report(registry: Registry, model: str, sku: str, out_dir: str | Path | None = None) -> list[Path]:
    """Write the self-contained page of one (model, SKU) (charts inlined) as ``report.html`` in
    ``out_dir`` (default: the pair's build folder, where publish uploads ``*.html`` from). Returns
    the files written: none when the pair has neither a bench nor a validate report."""
    registry.model(model)
    registry.sku(sku)
    layout = Layout(registry.root)
    pair = load_pair(layout, safe_name(model), safe_name(sku))
    if not pair.has_page:
        return []
    outcome = outcomes_of(registry, [model], {(model, sku): pair})[model, sku]
    html = pair_html(environment(), pair, outcome, inline_png, nav=False)
    path = Path(out_dir if out_dir is not None else layout.sku_dir(model, sku)) / PAIR_REPORT
    atomic_write_bytes(path, html.encode("utf-8"))
    return [path]


def pages(index: Path) -> Iterable[Path]:
    """Every page of a written report (the index first)."""
    yield index
    yield from sorted(p for p in index.parent.rglob("index.html") if p != index)
