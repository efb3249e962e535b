"""Tune the ship models (benchmarks/ship_models.py) for a TVM SKU and write the databases that
benchmarks/speedup.py replays: ``benchmarks/tuning/<sku>/<model>/`` (cache.json index and
MetaSchedule's database files, the format of caches/<sku>/<model>/).

Each model is tuned in a temporary project made as speedup.py makes one (``make_project``, the
pipeline's prepare, data and reference stages), by ``skuforge cache refresh``'s library call
(``pipeline.ops.caches.refresh``), so the database's key (apache-tvm version, target) is the one
the SKU's build in speedup.py checks before it replays it. The folder is replaced only when the
model's tuning succeeds.

    python benchmarks/tune_ship_models.py --trials 128 [--trials-per-task 4] [--models classifier,detector]
                                          [--sku x86_tvm_fp32] [--max-minutes 25] [--out benchmarks/tuning]

``--trials`` is the model's budget, ``--trials-per-task`` the cap per tuning task (the SKU's
``trials_per_task``: each task gets one batch of that many candidates when the cap is at most 16):
the trials spent are the smaller of the budget and the cap times the tasks. ``--max-minutes``
stops a model's tuning there (the SKU's ``max_minutes``): tasks not reached keep TVM's default
schedule, recorded as such in the database.

Tuning measures on this host, one core for a ``num_cores: 1`` SKU: run it on a quiet machine
(``nice`` it on a shared one). A model TVM cannot import is reported and skipped (exit 1 at the end).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ship_models import MODELS  # noqa: E402
from speedup import make_project  # noqa: E402

from pipeline.backends.caches import INDEX  # noqa: E402
from pipeline.ops.caches import refresh  # noqa: E402
from pipeline.project.artifacts import layout  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402
from pipeline.stages.data import make_data  # noqa: E402
from pipeline.stages.prepare import prepare  # noqa: E402
from pipeline.stages.reference import reference  # noqa: E402

TUNING = Path(__file__).resolve().parent / "tuning"


def tune(
    model: str,
    sku: str,
    trials: int,
    out: Path,
    source: Path,
    max_minutes: float | None = None,
    per_task: int | None = None,
) -> dict[str, Any]:
    """Tune ``model`` for ``sku`` with ``trials`` in a temporary project; on success replace
    ``out/<sku>/<model>/`` with the project's cache folder. Returns the build's cache record with
    the wall seconds the refresh took."""
    with tempfile.TemporaryDirectory(prefix="skuforge-tune-") as tmp:
        root = Path(tmp)
        update: dict[str, Any] = {"max_minutes": max_minutes} if max_minutes else {}
        if per_task:
            update["trials_per_task"] = per_task
        params = make_project(root, source, [model], [], {sku: (sku, update)})
        registry = load_registry(params)
        prepare(registry, model)
        make_data(registry, model)
        reference(registry, model)
        started = time.perf_counter()
        record = refresh(registry, sku, [model], trials)[0]
        record["wall_s"] = round(time.perf_counter() - started, 1)
        target = out / sku / model
        staged = target.with_name(f".{model}.new")
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(layout(registry).cache_dir(model, sku), staged)
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)  # the new folder in one step: never a half-copied database
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, required=True, help="MetaSchedule trials per model")
    ap.add_argument("--models", help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    ap.add_argument("--sku", default="x86_tvm_fp32", help="a TVM SKU of ./params.yaml")
    ap.add_argument("--trials-per-task", type=int, help="cap per tuning task (default: the trials over the tasks)")
    ap.add_argument("--max-minutes", type=float, help="stop each model's tuning at this many minutes")
    ap.add_argument("--out", type=Path, default=TUNING, help="where <sku>/<model>/ go (default: %(default)s)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    models = [m for m in args.models.split(",") if m] if args.models else list(MODELS)
    failed = 0
    for model in models:
        cap = f", at most {args.trials_per_task} a task" if args.trials_per_task else ""
        print(f"{model}: tuning for {args.sku}, --trials {args.trials}{cap}", flush=True)
        try:
            record = tune(model, args.sku, args.trials, args.out, Path.cwd(), args.max_minutes, args.trials_per_task)
        except Exception as exc:  # one model TVM refuses does not stop the others
            failed += 1
            print(f"{model}: not tuned: {type(exc).__name__}: {exc}", flush=True)
            continue
        index = json.loads((args.out / args.sku / model / INDEX).read_text())
        print(
            f"{model}: {index.get('trials')} trials recorded, {record['wall_s'] / 60:.1f} min, "
            f"database in {args.out / args.sku / model}",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
