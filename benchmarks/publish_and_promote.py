"""Publish time per SKU and promotion time, embedded store and a local `mlflow server` side by side.

Run from the project root after the example project has been built (`skuforge repro`). The
engines are published into throw-away stores in a temporary folder (the project's own
mlflow.db and publish receipts are not touched):

    python benchmarks/publish_and_promote.py [--no-server] [--model digits_cnn]

Columns: first publish (run, params, metrics, inputs, artifacts, registered version), the same
manifest again (idempotent: a lookup), and the promotion steps (gates: manifest and latency
samples downloaded and checked). The statistics of the performance gate are timed on their own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def start_server(folder: Path) -> tuple[subprocess.Popen, str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            "--backend-store-uri",
            f"sqlite:///{folder / 'server.db'}",
            "--artifacts-destination",
            str(folder / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    while time.perf_counter() - t0 < 120:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=1):
                return proc, uri, time.perf_counter() - t0
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit(f"mlflow server did not start on {uri}")


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--model", help="the model whose release is promoted (default: the first with manifests)")
    ap.add_argument("--no-server", action="store_true", help="only the embedded store")
    args = ap.parse_args()
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

    from pipeline.core.paths import Layout
    from pipeline.project.config import load_registry
    from pipeline.results.latency import compare_latency
    from pipeline.tracking.client import Tracking
    from pipeline.tracking.evidence import collect
    from pipeline.tracking.promotion import promote, rollback
    from pipeline.tracking.publish import publish_engine

    reg = load_registry(args.params)
    pairs = [(m, s) for m, s in reg.pairs() if Layout(reg.root).manifest(m, s).is_file()]
    if not pairs:
        sys.exit("no manifests: run `skuforge repro` in the example project first")
    model = args.model or pairs[0][0]
    inputs = {pair: collect(reg.pair(*pair)) for pair in pairs}
    tmp = Path(tempfile.mkdtemp(prefix="skuforge-bench-"))
    stores: dict[str, Tracking] = {}
    notes = []
    server = None
    try:
        import mlflow  # noqa: F401  (not timed: every command pays it once)

        db = tmp / "embedded" / "mlflow.db"
        db.parent.mkdir()
        stores["embedded"] = Tracking(
            uri=f"sqlite:///{db}",
            registry_uri=f"sqlite:///{db}",
            embedded=True,
            artifact_location=(db.parent / "mlartifacts").as_uri(),
            policy=reg.release.tracking,
        )
        _, seconds = timed(stores["embedded"].client.search_experiments)
        notes.append(f"embedded store created in {seconds:.2f} s (the first publish of a project pays it)")
        if not args.no_server:
            (tmp / "server").mkdir()
            server, uri, seconds = start_server(tmp / "server")
            stores["server"] = Tracking(
                uri=uri, registry_uri=uri, embedded=False, artifact_location=None, policy=reg.release.tracking
            )
            notes.append(f"mlflow server ({uri}, 1 worker, SQLite) started in {seconds:.1f} s")

        names = list(stores)
        print(f"{'publish (seconds)':44}" + "".join(f"{n + ' first':>16}{n + ' again':>16}" for n in names))
        totals = {n: [0.0, 0.0] for n in names}
        for pair in pairs:
            row = f"  {pair[0] + '/' + pair[1]:42}"
            for n in names:
                _, first = timed(publish_engine, stores[n], reg.release, inputs[pair])
                _, again = timed(publish_engine, stores[n], reg.release, inputs[pair])
                totals[n][0] += first
                totals[n][1] += again
                row += f"{first:16.3f}{again:16.3f}"
            print(row)
        print(
            f"  {'total (' + str(len(pairs)) + ' engines)':42}"
            + "".join(f"{a:16.3f}{b:16.3f}" for a, b in totals.values())
        )

        release = [s for s in reg.release_skus() if (model, s) in inputs]
        one = release[0] if release else next(s for m, s in pairs if m == model)
        steps = [
            (
                f"promote --model {model} --all --to {reg.release.aliases[0]} ({len(release)} SKUs)",
                lambda t: promote(reg, model, reg.release.aliases[0], release, tracking=t),
            ),
            (
                f"promote {model} --sku {one} --to {reg.release.aliases[min(1, len(reg.release.aliases) - 1)]}",
                lambda t: promote(
                    reg, model, reg.release.aliases[min(1, len(reg.release.aliases) - 1)], [one], tracking=t
                ),
            ),
            (
                f"promote {model} --sku {one} --to {reg.release.aliases[0]} (again: already there)",
                lambda t: promote(reg, model, reg.release.aliases[0], [one], tracking=t),
            ),
            (
                f"promote {model} --sku {one} --to {reg.release.aliases[0]} --rollback",
                lambda t: rollback(reg, model, reg.release.aliases[0], [one], reason="benchmark", tracking=t),
            ),
        ]
        print()
        print(f"{'promotion (seconds)':76}" + "".join(f"{n:>16}" for n in names))
        for label, step in steps:
            print(f"  {label:74}" + "".join(f"{timed(step, stores[n])[1]:16.3f}" for n in names))

        import numpy as np

        rng = np.random.default_rng(0)
        a, b = rng.lognormal(-2, 0.1, 500), rng.lognormal(-2, 0.1, 500)
        _, seconds = timed(compare_latency, a, b, resamples=reg.release.performance.bootstrap)
        print(
            f"\nperformance gate statistics alone (500 vs 500 samples, {reg.release.performance.bootstrap} bootstrap "
            f"resamples): {seconds:.3f} s"
        )
        for note in notes:
            print(note)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
