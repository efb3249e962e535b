"""Screenshots of the HTML report and of the MLflow UI over a built project, for docs/images/.

Run from anywhere after the project was built (`skuforge repro`):

    python scripts/screenshots.py --project DIR --out docs/images

It writes the report (`skuforge report`, unless --keep-report), starts `mlflow server` on loopback
against the project's embedded store (``mlflow.db``, ``mlartifacts/``), and opens each page in
headless Chromium (playwright with /usr/bin/chromium, as tests/test_report.py does) at 1400 px:

- report-index.png, report-model.png, report-pair.png: the report's index, a model page, a pair page;
- mlflow-experiments.png: the experiments list;
- mlflow-experiment.png: an experiment as it opens (the runs table, not GenAI traces);
- mlflow-runs-key-view.png: the runs table in the saved view "skuforge: key metrics";
- mlflow-run.png: one run (its parameters, metrics, tags);
- mlflow-models.png: the model registry;
- mlflow-version.png: one registered version (its tags; the signature is not among the visible ones).

The PNGs are quantized to a palette and tall pages are cut at --max-height so that each stays
under 400 KB. The script prints each file with its size; it changes nothing in the project except
the report folder. A project that published with an older skuforge gets the experiments' UI tags
by publishing again (`skuforge publish --all`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from pipeline.tracking.views import runs_view_url, ui_url

BIN = Path(sys.executable).parent
CHROMIUM = Path(os.environ.get("SKUFORGE_CHROMIUM", "/usr/bin/chromium"))
WIDTH, HEIGHT = 1400, 900
MAX_BYTES = 400_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_report(project: Path) -> Path:
    """`skuforge report` in the project; the index it printed."""
    proc = subprocess.run(
        [str(BIN / "skuforge"), "report"], cwd=project, capture_output=True, text=True, timeout=1800, check=False
    )
    if proc.returncode != 0:
        sys.exit(f"skuforge report failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    found = re.findall(r"\S+index\.html", proc.stdout)
    index = Path(found[-1]) if found else project / "build/report/index.html"
    return index if index.is_absolute() else project / index


def report_pages(index: Path, model: str | None, sku: str | None) -> dict[str, Path]:
    """The index, a model page and a pair page (by default the one with the most charts)."""
    root = index.parent
    models = sorted(p.parent.name for p in root.glob("*/index.html"))
    if not models:
        sys.exit(f"no model pages under {root}")
    model = model or models[0]
    pairs = sorted(p.parent.name for p in (root / model).glob("*/index.html"))
    if not pairs:
        sys.exit(f"no pair pages under {root / model}")
    charts = {p: (root / model / p / "index.html").read_text(errors="replace").count("<img") for p in pairs}
    chosen = sku if sku in pairs else max(pairs, key=lambda p: (charts[p], p))
    return {
        "report-index": index,
        "report-model": root / model / "index.html",
        "report-pair": root / model / chosen / "index.html",
    }


@contextlib.contextmanager
def mlflow_server(project: Path) -> Iterator[str]:
    """`mlflow server` on a free loopback port over the project's embedded store; its URL."""
    db = project / "mlflow.db"
    if not db.is_file():
        sys.exit(f"{db} does not exist: build and publish the project first (skuforge repro)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(BIN / "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{db.resolve()}",
        "--artifacts-destination",
        str((project / "mlartifacts").resolve()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    sys.exit(f"mlflow server did not start:\n{log.read().decode(errors='replace')[-3000:]}")
                time.sleep(0.5)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # uvicorn waits on the browser's open connections
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def mlflow_pages(url: str) -> dict[str, str]:
    """The UI's pages for the first experiment with runs, its first run and that run's version."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=url, registry_uri=url)
    versions = client.search_model_versions(max_results=1000)
    if not versions:
        sys.exit(f"no registered versions at {url}: publish the project first (skuforge publish --all)")
    version = sorted(versions, key=lambda v: (v.name, int(v.version)))[0]
    run = client.get_run(version.run_id)
    exp = run.info.experiment_id
    return {
        "mlflow-experiments": ui_url(url, "experiments"),
        "mlflow-experiment": ui_url(url, f"experiments/{exp}"),
        "mlflow-runs-key-view": runs_view_url(url, exp),
        "mlflow-run": ui_url(url, f"experiments/{exp}/runs/{run.info.run_id}"),
        "mlflow-models": ui_url(url, "models"),
        "mlflow-version": ui_url(url, f"models/{version.name}/versions/{version.version}"),
    }


def save_small(png: bytes, path: Path, max_height: int) -> int:
    """The screenshot as a palette PNG cut at ``max_height``, with fewer colours until it fits."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    if image.height > max_height:
        image = image.crop((0, 0, image.width, max_height))
    for colors in (256, 128, 64, 32):
        buf = io.BytesIO()
        image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(buf, "PNG", optimize=True)
        if buf.tell() <= MAX_BYTES:
            break
    path.write_bytes(buf.getvalue())
    return buf.tell()


def shoot(pages: dict[str, str], out: Path, max_height: int, settle_ms: int) -> list[str]:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM))
        try:
            context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
            # a first visit opens the UI's assistant panel over a third of the page (on localhost) and
            # a promotion of the registry's new look over the models list: as a returning user sees it
            context.add_init_script(
                "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
                "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
                "localStorage.setItem('_mlflow_model_registry_promo_modal_dismissed_v1', 'true');"
            )
            for name, target in pages.items():
                page = context.new_page()  # a fresh load: a hash change alone keeps the last page's state
                page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                page.goto(target, wait_until="load")
                with contextlib.suppress(PlaywrightTimeout):  # the runs table polls: never idle for long
                    page.wait_for_load_state("networkidle", timeout=10_000)
                page.wait_for_timeout(settle_ms)  # the UI renders after its last answer
                full = target.startswith("file:")  # the UI scrolls inside its own panes
                size = save_small(page.screenshot(full_page=full), out / f"{name}.png", max_height)
                print(f"{out / (name + '.png')}: {size // 1000} KB  <- {target}")
                if size > MAX_BYTES:
                    problems.append(f"{name}.png is {size // 1000} KB (over {MAX_BYTES // 1000} KB)")
                page.close()
        finally:
            browser.close()
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, default=Path.cwd(), help="a built project (default: here)")
    ap.add_argument("--out", type=Path, default=Path("docs/images"), help="where the PNGs go")
    ap.add_argument("--model", help="the model of the model and pair pages (default: the first)")
    ap.add_argument("--sku", help="the SKU of the pair page (default: the one with the most charts)")
    ap.add_argument("--keep-report", action="store_true", help="use build/report as it is")
    ap.add_argument("--max-height", type=int, default=3000, help="cut taller report pages (px)")
    ap.add_argument("--settle-ms", type=int, default=2500, help="wait after each page loads")
    args = ap.parse_args(argv)
    if not CHROMIUM.is_file():
        sys.exit(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set SKUFORGE_CHROMIUM)")
    project = args.project.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    index = project / "build/report/index.html" if args.keep_report else write_report(project)
    pages = {k: v.as_uri() for k, v in report_pages(index, args.model, args.sku).items()}
    with mlflow_server(project) as url:
        pages.update(mlflow_pages(url))
        problems = shoot(pages, args.out, args.max_height, args.settle_ms)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
