"""What every page of the HTML report shares: the Jinja filters and environment, where the charts go,
the outcome of each pair, and the readers of untyped report values."""

from __future__ import annotations

import base64
import logging
import math
import re
import subprocess
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, SkuforgeError
from pipeline.engine.matrix import matrix
from pipeline.project.config import Registry
from pipeline.report.load import PairData

log = logging.getLogger(__name__)


DEFAULT_DIR = Path("build") / "report"
MARKER = ".skuforge-report"  # names a folder this module wrote: the only kind it replaces
PAIR_REPORT = "report.html"
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_PASSED = {"passed"}
_FAILED = {"gate failed", "build failed", "publish failed", "failed", "bad input", "unsupported"}
PLOT_ERRORS = (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, OverflowError)


# --- formatting (Jinja filters) -------------------------------------------------------------------


def fmt(value: Any) -> str:
    """A cell: floats to 4 significant digits (whole numbers with thousands separators from 10,000
    up, never ``1.8e+04``), yes/no, '–' for nothing; a mapping or a list of mappings as small
    key/value lists (escaped markup), never raw JSON."""
    import markupsafe

    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if 1e4 <= abs(value) < 1e15 else f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        if not value:
            return "–"
        items = markupsafe.Markup("").join(
            markupsafe.Markup('<li><span class="k">{}</span> {}</li>').format(k, fmt(v))
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
        )
        return markupsafe.Markup('<ul class="kv">{}</ul>').format(items)
    if isinstance(value, (list, tuple)):
        if not value:
            return "–"
        if any(isinstance(v, (dict, list, tuple)) for v in value):
            return markupsafe.Markup(" ").join(fmt(v) for v in value)
        parts = [fmt(v) for v in value]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        return "[" + ", ".join(parts) + "]" if numeric else ", ".join(parts)
    return str(value)


def interval(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        return f"[{fmt(float(value[0]))} – {fmt(float(value[1]))}]"
    return ""


def status_class(outcome: str) -> str:
    base = outcome.split(" (")[0]  # PairOutcome.label: "passed (mixed: ...; cache: ...; warn: ...)"
    return "passed" if base in _PASSED else "failed" if base in _FAILED else "other"


def provenance(root: Path) -> dict[str, Any]:
    """What the index says it was written from: the project's git commit (None outside git), whether
    tracked files differ from it, and the time (UTC)."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(fmt=fmt, ci=interval, status_class=status_class)
    return env


# --- where the charts go --------------------------------------------------------------------------


class ChartFiles:
    """Charts as PNG files in ``folder``; the page refers to them by name."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __call__(self, name: str, png: bytes) -> str:
        (self.folder / name).write_bytes(png)
        return name


def inline_png(name: str, png: bytes) -> str:
    """Charts as data URIs: the page is one self-contained file."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


Images = Callable[[str, bytes], str]


def chart(images: Images, notes: list[str], name: str, what: str, draw: Callable[[], bytes]) -> str | None:
    """Draw one chart; an odd report (an empty or non-positive series) leaves the chart out with a
    note on the page rather than failing the whole report."""
    try:
        return images(name, draw())
    except PLOT_ERRORS as exc:
        log.warning("%s: chart left out (%s: %s)", what, type(exc).__name__, exc)
        notes.append(f"{what}: chart left out ({type(exc).__name__}: {exc})")
        return None


# --- outcomes -------------------------------------------------------------------------------------


def outcomes_of(
    registry: Registry, models: list[str], pairs: dict[tuple[str, str], PairData], notes: list[str] | None = None
) -> dict[tuple[str, str], tuple[str, str]]:
    """(model, SKU) -> (outcome, detail) as `skuforge summary` shows them (matrix(): the manifests,
    the failures stage commands recorded, what this host can build). A pair summary calls "not run"
    whose reports are here (the manifest stage has not run yet) keeps that outcome and says what
    validate.json holds in its detail. Only when the matrix cannot be read (a damaged manifest) do
    the outcomes come from validate.json alone, said in ``notes``."""

    try:
        rows = matrix(registry, models, list(dict.fromkeys(s for _, s in pairs)))
        found: dict[tuple[str, str], tuple[str, str]] = {(r.model, r.sku): (r.label, r.detail) for r in rows}
    except SkuforgeError as exc:
        log.warning("outcomes from the reports alone: %s", exc.message)
        if notes is not None:
            notes.append(f"outcomes from validate.json alone, not the manifests: {exc.message}")
        found = {}
        for key, pair in pairs.items():
            passed = as_dict(pair.validate).get("passed")
            detail = "; ".join(str(f) for f in as_list(as_dict(pair.validate).get("failures")))
            found[key] = (
                ("passed" if passed else "gate failed", detail) if isinstance(passed, bool) else ("not run", "")
            )
        return found
    for key, pair in pairs.items():
        outcome, detail = found[key]
        if outcome == "not run" and pair.validate is not None and isinstance(pair.validate.get("passed"), bool):
            said = "passed" if pair.validate["passed"] else "failed"
            found[key] = (outcome, f"{detail}; validate.json here says {said} (the manifest stage makes it an outcome)")
    return found


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def as_number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def as_interval(value: Any) -> tuple[float, float] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(as_number(v) is not None for v in value):
        return float(value[0]), float(value[1])
    return None


def engine_bytes(build: dict[str, Any] | None) -> int | None:
    files = as_list(as_dict(build).get("engine_files"))
    sizes = [n for f in files if isinstance(f, dict) and isinstance(n := f.get("bytes"), int)]
    return sum(sizes) if sizes else None


def safe_name(name: str) -> str:
    """``name`` as a folder name and URL path segment (registry names always are)."""
    if not SAFE_NAME.fullmatch(name):
        raise InputError(f"{name!r} cannot name a report page", hint="use a registry name (letters, digits, '_')")
    return name
