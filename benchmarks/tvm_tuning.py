"""What the checked-in tuning database buys: build time and latency of the TVM SKU, side by side.

Run from the project root after the example's stages up to the build (`skuforge repro` or
`dvc repro`), so the prepared models, golden data and the SKU's database exist:

    python benchmarks/tvm_tuning.py [--sku x86_tvm_fp32] [--model M ...] [--trials N] [--rounds 7]

Per model, in one run on this host:
- build time: replaying the checked-in database (caches/<sku>/<model>/, as `dvc repro` builds)
  against tuning from scratch with the SKU's trial budget (as `skuforge cache refresh` does), and
  the ratio; both builds go to temporary folders, the project's engines and caches are not touched;
- engine-only latency, interleaved round by round so drift hits all alike: the tuned engine, an
  untuned build of the same model (TVM's default schedules, trials 0), and ONNX Runtime (CPU
  provider, default session options, optimisation level "all") on the same prepared model and
  golden inputs; p50 per engine over the rounds' medians, and the ratios.

Tuning measures on this host: run it on a quiet machine. The figures go to stdout (and with
--json, as JSON).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.backends import get_backend  # noqa: E402
from pipeline.engine.build import build_engine  # noqa: E402
from pipeline.project.artifacts import batch_indices, layout, load_arrays, read_report  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402
from pipeline.project.data import LABELS, iter_batches  # noqa: E402
from pipeline.results.reports import PrepareReport  # noqa: E402


def feeds_of(registry, model: str, sku: str) -> dict:
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    golden = load_arrays(out.split(model, "golden"), "data")
    golden.pop(LABELS, None)
    in_idx, _ = batch_indices(registry.model(model), prep.signature)
    batch = registry.pins(model, sku).get(registry.model(model).batch_axis or "", 1)
    return next(iter_batches(golden, in_idx, batch))[1]


def timed_build(registry, model: str, sku: str, folder: Path, cache: Path, **policy) -> tuple[float, object]:
    started = time.perf_counter()
    built = build_engine(registry.pair(model, sku), folder, cache_dir=cache, **policy)
    return time.perf_counter() - started, built


def ort_session(registry, model: str):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(layout(registry).prepared_model(model)), so, providers=["CPUExecutionProvider"])


def latency(runners: dict, feeds: dict, rounds: int, seconds: float) -> dict[str, float]:
    """Engine-only p50 (ms): per round, each engine runs for ``seconds`` and its median is kept."""
    for run in runners.values():  # warm-up, apart from the measurement
        for _ in range(20):
            run()
    medians: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            samples, deadline = [], time.perf_counter() + seconds
            while time.perf_counter() < deadline or len(samples) < 20:
                t = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t)
            medians[name].append(statistics.median(samples) * 1e3)
    return {name: statistics.median(values) for name, values in medians.items()}


def with_trials(registry, sku: str, trials: int):
    """The registry with the SKU's options.trials replaced (an untuned build: 0)."""
    spec = registry.sku(sku)
    changed = spec.model_copy(update={"options": {**spec.options, "trials": trials}})
    copy = registry.model_copy(update={"skus": {**registry.skus, sku: changed}})
    copy._root = registry.root
    return copy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--sku", default="x86_tvm_fp32")
    parser.add_argument("--model", action="append", help="default: every model")
    parser.add_argument("--trials", type=int, help="the from-scratch budget (default: the SKU's options.trials)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.5, help="per engine per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    registry = load_registry(args.params)
    spec = registry.sku(args.sku)
    backend = get_backend(spec.backend)
    trials = args.trials or spec.options.get("trials", 0)
    if spec.backend != "tvm" or not trials:
        parser.error(f"{args.sku} is not a tuned TVM SKU (backend tvm, options.trials > 0)")
    results = []
    for model in args.model or sorted(registry.models):
        checked_in = layout(registry).cache_dir(model, args.sku)
        if not (checked_in / "cache.json").is_file():
            print(
                f"{model}: no database in {checked_in}: run skuforge cache refresh --sku {args.sku} first",
                file=sys.stderr,
            )
            continue
        with tempfile.TemporaryDirectory(prefix="skuforge-bench-tvm-") as tmp:
            work = Path(tmp)
            shutil.copytree(checked_in, work / "cache-replay")
            replay_s, replay = timed_build(
                registry, model, args.sku, work / "replay", work / "cache-replay", cache_required=True
            )
            scratch_s, _ = timed_build(
                registry,
                model,
                args.sku,
                work / "scratch",
                work / "cache-scratch",
                cache_refresh=True,
                tuning_trials=trials,
            )
            scratch_records = json.loads((work / "cache-scratch" / "cache.json").read_text()).get("trials")
            untuned = with_trials(registry, args.sku, 0)
            default_s, _ = timed_build(untuned, model, args.sku, work / "default", work / "cache-default")
            feeds = feeds_of(registry, model, args.sku)
            tuned_runner = backend.load(work / "replay", spec)
            default_runner = backend.load(work / "default", untuned.sku(args.sku))
            session = ort_session(registry, model)
            names = [i.name for i in session.get_inputs()]
            runners = {
                "tvm tuned": lambda r=tuned_runner, f=feeds: r.infer(f),
                "tvm default": lambda r=default_runner, f=feeds: r.infer(f),
                "onnxruntime": lambda s=session, f=feeds, ns=names: s.run(None, {n: f[n] for n in ns}),
            }
            p50 = latency(runners, feeds, args.rounds, args.seconds)
            tuned_runner.close()
            default_runner.close()
        row = {
            "model": model,
            "sku": args.sku,
            "trials": trials,
            "tasks": replay.outcome.meta.cache["hits"] + replay.outcome.meta.cache["misses"],
            "tuned_functions": replay.outcome.meta.tuned,
            "functions": replay.outcome.meta.functions,
            "build_replay_s": round(replay_s, 2),
            "build_scratch_s": round(scratch_s, 2),
            "build_default_s": round(default_s, 2),
            "scratch_over_replay": round(scratch_s / replay_s, 1),
            "scratch_records": scratch_records,
            "p50_ms": {k: round(v, 4) for k, v in p50.items()},
            "default_over_tuned": round(p50["tvm default"] / p50["tvm tuned"], 2),
            "ort_over_tuned": round(p50["onnxruntime"] / p50["tvm tuned"], 2),
        }
        results.append(row)
        print(
            f"{model} ({args.sku}, {row['tasks']} tasks, {row['tuned_functions']}/{row['functions']} functions "
            f"from the database):"
        )
        print(
            f"  build: replay {replay_s:.1f} s | from scratch ({trials} trials) {scratch_s:.1f} s | "
            f"ratio {row['scratch_over_replay']}x | untuned {default_s:.1f} s"
        )
        print(
            f"  p50:   tuned {p50['tvm tuned']:.4f} ms | untuned {p50['tvm default']:.4f} ms "
            f"({row['default_over_tuned']}x the tuned) | onnxruntime {p50['onnxruntime']:.4f} ms "
            f"({row['ort_over_tuned']}x the tuned)"
        )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
