"""Engines worth shipping: every CPU SKU's engine, timed side by side with ONNX Runtime defaults.

For each model of benchmarks/ship_models.py (a MobileNetV2-style classifier, a DBNet-style text
detector, a CRNN text recognizer), builds a temporary project (nothing under build/ is read or
written) whose params.yaml holds the model and the CPU SKUs of ./params.yaml with their options
as they stand, runs the pipeline's own stages (prepare, data, reference, calibrate,
build_engine), loads each engine as the validate and bench stages do, and times

- each SKU's engine through its runner's ``infer`` (what a device runs), and
- ONNX Runtime defaults: ``InferenceSession(model)`` on the exported model, no options,

in interleaved rounds (every engine once per round, so load drifts on a shared host hit all of
them alike) and prints per model each engine's p50 latency and its speed-up over ORT defaults.
TVM builds with ``trials`` 0 (TVM's default schedules, no tuning database).

    python benchmarks/speedup.py [--models classifier,recognizer] [--skus x86_ort_fp32,x86_ov_int8]
                                 [--seconds 2] [--threads 1] [--variant NAME=SKU:JSON ...] [--json out.json]

``--threads N`` pins every engine, ORT defaults included, to N threads (on a shared host, one
thread and the ``cpu ms`` column, the process CPU time per call, compare compute cost with less
noise than wall time). ``--variant`` adds a SKU copied from one of ./params.yaml with its options
updated by JSON, e.g.
``--variant 'iree_ukernels=x86_iree_cpu_fp32:{"extra_flags":["--iree-llvmcpu-enable-ukernels=all"]}'``:
the way a default change is judged, before and after side by side in one run.

The roofline column is achieved FLOP/s over the host's measured FP32 peak (``pipeline.perf.roofline``
FLOPs per ONNX layer, ``pipeline.host.peaks`` host peaks); without those modules it says n/a.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ship_models import MODELS, build  # noqa: E402

CPU_SKUS = (
    "x86_ort_fp32",
    "x86_ort_int8",
    "portable_ort_fp32",
    "x86_ov_fp32",
    "x86_ov_int8",
    "x86_iree_cpu_fp32",
    "x86_iree_cpu_fp16",
    "x86_tvm_fp32",
)
ORT_DEFAULTS = "ort_defaults"


# each backend's option for its runtime's thread count (IREE's is process-wide: see main)
THREAD_OPTIONS = {"onnxruntime": "intra_op_num_threads", "openvino": "inference_num_threads", "tvm": "num_threads"}


def make_project(
    root: Path,
    source: Path,
    models: list[str],
    skus: list[str],
    variants: dict[str, tuple[str, dict[str, Any]]],
    threads: int | None = None,
) -> Path:
    """A project in ``root``: the models written by ship_models, generated data sets, the SKUs of
    ``source/params.yaml`` (and the variants: a SKU with options updated)."""
    import yaml

    params = yaml.safe_load((source / "params.yaml").read_text())
    out: dict[str, Any] = {"defaults": params["defaults"], "examples": {}, "models": {}, "skus": {}}
    for name in models:
        spec = MODELS[name]
        build(name, root / "models" / name / "model.onnx")
        out["models"][name] = {
            "dir": f"models/{name}",
            "source": "model.onnx",
            "pins": {"batch": 1},
            "inputs": [
                {
                    "name": spec["input"],
                    "dtype": "float32",
                    "shape": ["batch", *spec["shape"][1:]],
                    "range": spec["range"],
                }
            ],
            "datasets": {
                "golden": {"generate": {"count": 8, "seed": 1}},
                "calibration": {"generate": {"count": 32, "seed": 2}},
            },
        }
    for sku in skus:
        out["skus"][sku] = dict(params["skus"][sku])
    for name, (base, update) in variants.items():
        spec = dict(params["skus"][base])
        spec["options"] = {**spec.get("options", {}), **update}
        out["skus"][name] = spec
    for spec in out["skus"].values():
        spec["bench"] = {}
        if threads and spec["backend"] in THREAD_OPTIONS:
            spec["options"] = {**spec.get("options", {}), THREAD_OPTIONS[spec["backend"]]: threads}
    (root / "params.yaml").write_text(yaml.safe_dump(out, sort_keys=False))
    return root / "params.yaml"


def measure(
    calls: dict[str, Callable[[], Any]], seconds: float, rounds: int = 9
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per-call wall latencies (ms) of each call, ``rounds`` interleaved rounds of about
    ``seconds / rounds`` per call each after a warm-up; and each call's mean process CPU time (ms,
    all threads). On a shared host the CPU time of a one-thread engine is its compute cost, which
    other processes' load does not inflate the way it inflates wall time."""
    samples: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [0.0, 0] for k in calls}
    for call in calls.values():
        for _ in range(10):
            call()
    for _ in range(rounds):
        for name, call in calls.items():
            # the previous engine's idle workers spin-wait a while (ONNX Runtime, OpenVINO): on a
            # 2-core host they would take a core from this one; let them go to sleep first
            time.sleep(0.1)
            start, c0, n = time.perf_counter(), time.process_time(), 0
            while True:
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                samples[name].append((t1 - t0) * 1000)
                n += 1
                if t1 - start >= seconds / rounds and n >= 3:
                    break
            cpu[name][0] += (time.process_time() - c0) * 1000
            cpu[name][1] += n
    return samples, {k: total / count for k, (total, count) in cpu.items()}


def roofline_fraction(model: Path, p50_ms: float, threads: int | None) -> str:
    """ROOFLINE HOOK: achieved FLOP/s (the FP32 model's FLOPs, ``pipeline.perf.roofline.graph_cost``, over
    the p50) as a fraction of this host's measured FP32 peak (``pipeline.host.peaks.host_peaks``:
    all cores, or one core under ``--threads 1``); "n/a" where those modules are absent. INT8
    engines are credited with the FP32 model's FLOPs (the same work in another precision)."""
    try:
        from pipeline.host.peaks import host_peaks
        from pipeline.perf.roofline import graph_cost
    except ImportError:
        return "n/a"
    key = (str(model), threads)
    if key not in _ROOFLINE:
        peaks = host_peaks().compute_gflops
        _ROOFLINE[key] = (graph_cost(model, {"batch": 1}).flops, peaks.one_core if threads == 1 else peaks.all_cores)
    flops, peak_gflops = _ROOFLINE[key]
    fraction = flops / (p50_ms * 1e6) / peak_gflops
    return f"{fraction:.1%}" + ("!" if fraction > 1 else "")  # "!": the cached peak is below what ran


_ROOFLINE: dict[tuple[str, int | None], tuple[int, float]] = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--skus", default=",".join(CPU_SKUS), help="comma-separated SKUs of ./params.yaml")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SKU:JSON",
        help="a SKU of ./params.yaml with its options updated by the JSON object (repeatable)",
    )
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per engine and model")
    ap.add_argument("--threads", type=int, help="threads of every engine (default: each SKU's own setting)")
    ap.add_argument("--json", type=Path, help="write the p50s and speed-ups here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary project (its path is printed)")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    skus = [s for s in args.skus.split(",") if s]
    variants: dict[str, tuple[str, dict[str, Any]]] = {}
    for text in args.variant:
        name, _, rest = text.partition("=")
        base, _, options = rest.partition(":")
        variants[name] = (base, json.loads(options))

    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import numpy as np
    import onnxruntime as ort

    if args.threads:
        import iree.runtime

        # the local-task driver reads its worker count from process-wide flags, before its first device
        iree.runtime.flags.parse_flags(f"--task_topology_group_count={args.threads}")

    from pipeline.backends import get_backend
    from pipeline.engine.build import build_engine
    from pipeline.project.artifacts import layout, load_arrays
    from pipeline.project.config import load_registry
    from pipeline.stages.calibrate import calibrate
    from pipeline.stages.data import make_data
    from pipeline.stages.prepare import prepare
    from pipeline.stages.reference import reference

    tmp = Path(tempfile.mkdtemp(prefix="skuforge-speedup-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        registry = load_registry(make_project(tmp, Path.cwd(), models, skus, variants, args.threads))
        out = layout(registry)
        engines = skus + list(variants)
        for model in models:
            prepare(registry, model)
            make_data(registry, model)
            reference(registry, model)
            if any(registry.sku(s).precision == "int8" for s in engines):
                calibrate(registry, model)
            golden = load_arrays(out.split(model, "golden"), "data")
            golden.pop("labels", None)
            feeds = {k: v[:1] for k, v in golden.items()}
            source = tmp / "models" / model / "model.onnx"
            calls: dict[str, Callable[[], Any]] = {}
            so = ort.SessionOptions()
            so.intra_op_num_threads = args.threads or 0
            default = ort.InferenceSession(str(source), so)  # defaults (but the thread count under --threads)
            calls[ORT_DEFAULTS] = lambda s=default, f=feeds: s.run(None, f)
            want = default.run(None, feeds)[0]
            errors, build_s, runners = {}, {}, []
            for sku in engines:
                spec = registry.sku(sku)
                t0 = time.perf_counter()
                try:
                    build_engine(registry, model, sku, out.engine_dir(model, sku), tuning_trials=0, search=False)
                    runner = get_backend(spec.backend).load(out.engine_dir(model, sku), spec)
                except Exception as exc:  # a backend that cannot build this model: reported, not fatal
                    errors[sku] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    continue
                build_s[sku] = time.perf_counter() - t0
                runners.append(runner)
                got = next(iter(runner.infer(feeds).values()))
                errors[sku] = f"max|d| vs ORT {float(np.abs(got.astype(np.float32) - want).max()):.3g}"
                calls[sku] = lambda r=runner, f=feeds: r.infer(f)
            samples, cpu_ms = measure(calls, args.seconds)
            for runner in runners:
                runner.close()
            p50 = {k: statistics.median(v) for k, v in samples.items()}
            base = p50[ORT_DEFAULTS]
            print(f"\n== {model} {MODELS[model]['shape']}  (ORT defaults p50 {base:.3f} ms)")
            print(
                f"  {'engine':28} {'p50 ms':>9} {'p90 ms':>9} {'speed-up':>9} {'cpu ms':>9} {'roofline':>9}"
                "  build s  note"
            )
            rows = {}
            for name in [ORT_DEFAULTS, *engines]:
                if name not in p50:
                    print(f"  {name:28} {'-':>9} {'-':>9} {'-':>9} {'-':>9} {'-':>9}  {'-':>7}  {errors.get(name, '')}")
                    rows[name] = {"error": errors.get(name)}
                    continue
                p90 = float(np.percentile(samples[name], 90))
                roof = roofline_fraction(source, p50[name], args.threads)
                print(
                    f"  {name:28} {p50[name]:9.3f} {p90:9.3f} {base / p50[name]:8.2f}x {cpu_ms[name]:9.3f} {roof:>9}  "
                    f"{build_s.get(name, 0):7.1f}  {errors.get(name, '')}"
                )
                rows[name] = {
                    "p50_ms": p50[name],
                    "p90_ms": p90,
                    "speedup": base / p50[name],
                    "cpu_ms": cpu_ms[name],
                    "roofline": roof,
                }
            results[model] = rows
        if all(r.get("roofline") in (None, "n/a") for rows in results.values() for r in rows.values()):
            print("\nroofline: n/a (pipeline/perf/roofline.py is not in this tree)")
        else:
            print(
                "\nroofline: the model's FP32 FLOPs / p50 / this host's measured FP32 peak (pipeline.perf.roofline, "
                "pipeline.host.peaks); '!' marks a fraction above 100%: the cached peak (numpy matmul, "
                "measured once per host) is below what the engine achieved, e.g. measured on a loaded host"
            )
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        if args.keep:
            print(f"\nproject kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
