"""Engines worth shipping: every CPU SKU's engine, timed side by side with ONNX Runtime defaults.

For each model of benchmarks/ship_models.py (a MobileNetV2-style classifier, a DBNet-style text
detector, a CRNN text recognizer), or of another project's params.yaml (``--project DIR``: its model
entries as they stand, their folders copied), builds a temporary project (nothing under build/ is
read or written) whose params.yaml holds the model and the CPU SKUs of ./params.yaml with their
options as they stand, runs the pipeline's own stages (prepare, data, reference, calibrate,
build_engine), loads each engine as the validate and bench stages do, and times

- each SKU's engine through its runner's ``infer`` (what a device runs), and
- ONNX Runtime defaults: ``InferenceSession(model)`` on the exported model, no options,

in interleaved rounds (every engine once per round, so load drifts on a shared host hit all of
them alike) and prints per model each engine's p50 latency and its speed-up over ORT defaults.
TVM builds with ``trials`` 0 (TVM's default schedules, no tuning database). The note column is
each engine's largest absolute difference from the reference stage's outputs (ONNX Runtime FP32,
optimisations off) over the first golden samples, all outputs. For engines that delegate (LiteRT:
XNNPACK) a second table gives the share of compute ops the delegate took (data-movement ops, whose
precision is "n/a", left out), the delegate partitions, the TRANSPOSE ops the NCHW->NHWC layout
change added, and the op types left on the built-in kernels.

    python benchmarks/speedup.py [--models classifier,recognizer] [--skus x86_ort_fp32,x86_ov_int8]
                                 [--seconds 2] [--threads 1] [--objective cpu|wall] [--variant NAME=SKU:JSON ...]
                                 [--json out.json] [--project DIR] [--tuning DIR]

TVM: a SKU with a checked-in tuning database for the model under ``benchmarks/tuning/<sku>/<model>/``
(written by benchmarks/tune_ship_models.py, the format of caches/<sku>/<model>/) gets it copied into
the temporary project's caches/<sku>/<model>/ after the checks a build makes (the key: apache-tvm
version and target; every file's sha256 and size; a database that fails them is refused, named, and
the SKU builds untuned) and replays it with the cache required (a task it lacks fails the build):
its note says "tuned (N trials)". Beside each TVM SKU whose ``options.trials`` is above 0, the
variant ``<sku>_untuned`` (trials 0, no database: TVM's default schedules) is timed too, so
untuned, tuned and ORT defaults stand side by side. A SKU without a checked-in database builds
untuned, as before, and says so. ``--tuning DIR`` reads the databases from DIR instead (``--project
. --tuning caches``: a project's own checked-in databases).

``--threads N`` pins every engine, ORT defaults included, to N threads (on a shared host, one
thread and the ``cpu ms`` column, the process CPU time per call, compare compute cost with less
noise than wall time). ``--variant`` adds a SKU copied from one of ./params.yaml with its options
updated by JSON, e.g.
``--variant 'iree_ukernels=x86_iree_cpu_fp32:{"extra_flags":["--iree-llvmcpu-enable-ukernels=all"]}'``:
the way a default change is judged, before and after side by side in one run.

After the table of each model, the selection per device class (``skus.<s>.device_class``): among
the class's engines that built here, the fastest by the objective's samples is selected when the
bootstrap interval of the runner-up's p50 over its p50 lies wholly above 1, else a tie broken by
``selection.prefer`` — ``decide()`` of pipeline/verify/selection.py, the rule ``skuforge select``
applies. The pipeline's gates (correctness, placement, precision) are not run here: "max|d| vs ref"
in the note column is the only check, and selection is by speed among the engines that built.
``--objective cpu`` (the default under ``--threads 1``) selects on CPU time per call, one sample
per round (the process CPU time of the round over its calls: the acceptance figure on a shared
host), in as many rounds as ``selection.min_samples`` (30: fewer samples never separate);
``--objective wall`` (the default otherwise) on the per-call wall latencies. The selection line
says which it used. ``x`` columns are the selected engine's speed-up over ORT defaults in wall p50
and in CPU time per call (the figure to read under ``--threads 1``). The AVX-512 VNNI SKUs are in
the default list only on a host with avx512_vnni (run without it, their u8s8 sums would saturate).

The roofline column is achieved op/s over the host's measured peak for the engine's precision (the
INT8 peak for INT8 engines; ``pipeline.perf.cost`` FLOPs per ONNX layer, ``pipeline.host.peaks``
host peaks); without those modules it says n/a.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ship_models import MODELS, build  # noqa: E402

from pipeline.backends import get_backend  # noqa: E402
from pipeline.backends.caches import INDEX, inspect  # noqa: E402
from pipeline.results.selection import SelectionCandidate  # noqa: E402
from pipeline.verify.selection import QUANTILES, decide  # noqa: E402

CPU_SKUS = (
    "x86_ort_fp32",
    "x86_ort_int8",
    "portable_ort_fp32",
    "x86_ov_fp32",
    "x86_ov_int8",
    "x86_iree_cpu_fp32",
    "x86_iree_cpu_fp16",
    "x86_tvm_fp32",
    "x86_litert_fp32",
    "x86_litert_int8",
)
# INT8 SKUs of the x86-avx512-vnni class: timed only where the host has the instructions
VNNI_SKUS = ("x86_vnni_ort_int8", "x86_vnni_ov_int8", "x86_vnni_litert_int8")
ORT_DEFAULTS = "ort_defaults"
SELECTION_KEY = "selection (by class)"  # in --json per model: not a SKU name (those are [a-z0-9_])
GOLDEN_SAMPLES = 8  # golden samples each engine is compared on
TUNING = Path(__file__).resolve().parent / "tuning"  # checked-in databases: <sku>/<model>/ (tune_ship_models.py)
UNTUNED = "_untuned"  # the suffix of a tuned TVM SKU's untuned variant
OBJECTIVES = ("cpu", "wall")
ROUNDS = 9  # interleaved rounds under --objective wall (its samples are per call)


# each backend's option for its runtime's thread count (IREE's is process-wide: see main)
THREAD_OPTIONS = {
    "onnxruntime": "intra_op_num_threads",
    "openvino": "inference_num_threads",
    "tvm": "num_threads",
    "litert": "num_threads",
}


def make_project(
    root: Path,
    source: Path,
    models: list[str],
    skus: list[str],
    variants: dict[str, tuple[str, dict[str, Any]]],
    threads: int | None = None,
    project: Path | None = None,
) -> Path:
    """A project in ``root``: the models written by ship_models with generated data sets (or, from
    ``project``, its models' params.yaml entries and folders), the SKUs of ``source/params.yaml``
    (and the variants: a SKU with options updated)."""
    import yaml

    params = yaml.safe_load((source / "params.yaml").read_text())
    out: dict[str, Any] = {"defaults": params["defaults"], "examples": {}, "models": {}, "skus": {}}
    if "selection" in params:  # the objective, confidence and preference order the selection uses
        out["selection"] = params["selection"]
    theirs = yaml.safe_load((project / "params.yaml").read_text())["models"] if project else {}
    for name in models:
        if project:
            if name not in theirs:
                raise SystemExit(f"{project}/params.yaml has no model {name!r} (it has: {', '.join(theirs)})")
            out["models"][name] = theirs[name]
            shutil.copytree(project / theirs[name]["dir"], root / theirs[name]["dir"])
            continue
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


@dataclass
class Timings:
    """What ``measure`` saw of each call: per-call wall latencies (ms), and per round the process
    CPU time (ms, all threads) over the calls of that round."""

    wall: dict[str, list[float]]
    cpu_rounds: dict[str, list[float]]
    cpu_total: dict[str, list[float]]  # [ms, calls] over all rounds

    @property
    def cpu_ms(self) -> dict[str, float]:
        """Each call's mean CPU time per call over all rounds."""
        return {k: total / count for k, (total, count) in self.cpu_total.items()}


def measure(calls: dict[str, Callable[[], Any]], seconds: float, rounds: int = ROUNDS) -> Timings:
    """Each call timed in ``rounds`` interleaved rounds of about ``seconds / rounds`` each after a
    warm-up. On a shared host the CPU time of a one-thread engine is its compute cost, which
    other processes' load does not inflate the way it inflates wall time."""
    samples: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [0.0, 0] for k in calls}
    cpu_rounds: dict[str, list[float]] = {k: [] for k in calls}
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
            spent = (time.process_time() - c0) * 1000
            cpu[name][0] += spent
            cpu[name][1] += n
            cpu_rounds[name].append(spent / n)
    return Timings(samples, cpu_rounds, cpu)


def selection_samples(timings: Timings, objective: str) -> dict[str, list[float]]:
    """The samples the selection compares: per-round CPU ms per call (``cpu``) or per-call wall ms
    (``wall``)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: one of {', '.join(OBJECTIVES)}")
    return timings.cpu_rounds if objective == "cpu" else timings.wall


def checked_in_database(sku: str, model: str, root: Path = TUNING) -> Path | None:
    """``root/<sku>/<model>/`` when it holds a cache index, else None."""
    folder = root / sku / model
    return folder if (folder / INDEX).is_file() else None


class DatabaseRefused(ValueError):
    """A checked-in tuning database that a build would not trust."""


def install_database(source: Path, dest: Path, sku: str, model: str, spec: Any) -> int | None:
    """Copy the tuning database at ``source`` to ``dest`` (the project's caches/<sku>/<model>/)
    once it passes the checks a build makes (``pipeline.backends.caches.inspect``: the key of this
    host's compiler and the SKU's target, every listed file's sha256 and size, the backend's own
    reading); only the index and the files it lists are copied. Returns the trials the index
    records. Raises DatabaseRefused, naming why, when the database is not what the build would trust."""
    backend = get_backend(spec.backend)
    status = inspect(backend, sku, model, source, backend.cache_key(spec))
    if status.state != "fresh":
        raise DatabaseRefused(
            f"{source}: {status.state}: {status.reason} (re-tune: python benchmarks/tune_ship_models.py "
            f"--sku {sku} --models {model} --trials N)"
        )
    staged = dest.with_name(f".{dest.name}.new")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for name in [str(f["path"]) for f in status.files] + [INDEX]:
        shutil.copyfile(source / name, staged / name)
    shutil.rmtree(dest, ignore_errors=True)
    staged.rename(dest)
    return status.trials


def roofline_fraction(
    model: Path, pins: dict[str, int], p50_ms: float, threads: int | None, precision: str = "fp32"
) -> str:
    """ROOFLINE HOOK: achieved op/s (the prepared FP32 model's FLOPs at ``pins``,
    ``pipeline.perf.cost.graph_cost``, over the p50) as a fraction of this host's measured peak for
    the engine's precision (``pipeline.host.peaks.host_peaks``: the INT8 peak for INT8 engines, the
    FP32 one otherwise; all cores, or one core under ``--threads 1``); "n/a" where those modules are
    absent. INT8 engines are credited with the FP32 model's FLOPs (the same work in another
    precision) and divided by the INT8 peak."""
    try:
        from pipeline.host.peaks import host_peaks
        from pipeline.perf.cost import graph_cost
    except ImportError:
        return "n/a"
    key = (str(model), threads, precision)
    if key not in _ROOFLINE:
        peaks = host_peaks().int8_gops if precision == "int8" else host_peaks().compute_gflops
        _ROOFLINE[key] = (graph_cost(model, pins).flops, peaks.one_core if threads == 1 else peaks.all_cores)
    flops, peak_gflops = _ROOFLINE[key]
    fraction = flops / (p50_ms * 1e6) / peak_gflops
    return f"{fraction:.1%}" + ("!" if fraction > 1 else "")  # "!": the cached peak is below what ran


_ROOFLINE: dict[tuple[str, int | None, str], tuple[int, float]] = {}


def delegation(outcome: Any, delegated_device: str) -> dict[str, Any] | None:
    """What a delegating engine (one whose metadata counts ``partitions``) put on its delegate:
    compute ops (data movement, precision "n/a", left out) on ``delegated_device`` and elsewhere,
    the partitions, and the TRANSPOSE ops the engine has beyond the ONNX model's."""
    partitions = getattr(outcome.meta, "partitions", None)
    if partitions is None:
        return None
    compute = [layer for layer in outcome.layers if layer.precision != "n/a"]
    taken = sum(1 for layer in compute if layer.device == delegated_device)
    layout = getattr(outcome.meta, "layout", {})
    return {
        "compute_ops": len(compute),
        "delegated_ops": taken,
        "delegated_share": taken / len(compute) if compute else 0.0,
        "partitions": partitions,
        "transposes_added": layout.get("engine_transposes", 0) - layout.get("onnx_transposes", 0),
        "builtin_op_types": sorted({layer.op_type for layer in compute if layer.device != delegated_device}),
    }


def select_by_class(
    registry: Any, engines: list[str], samples: dict[str, list[float]], errors: dict[str, str]
) -> dict[str, Any]:
    """Per device class of ``engines``: the choice by ``decide()`` among those that built (their
    ``samples``: per-call wall or per-round CPU, ``selection_samples``), without the pipeline's
    gates; an engine that did not build is a candidate that cannot be chosen, with its error."""
    import numpy as np

    spec = registry.selection
    if spec.objective not in QUANTILES:  # throughput: this benchmark times one call at a time
        spec = spec.model_copy(update={"objective": "p50"})
    classes: dict[str, list[str]] = {}
    for name in engines:
        device_class = registry.sku(name).device_class
        if device_class is not None:
            classes.setdefault(device_class, []).append(name)
    chosen = {}
    for device_class, members in classes.items():
        candidates, drawn = [], {}
        for name in members:
            s = registry.sku(name)
            common = {"sku": name, "backend": s.backend, "precision": s.precision}
            if name not in samples:
                candidates.append(
                    SelectionCandidate(
                        **common,
                        manifest_digest=None,
                        outcome="build failed",
                        eligible=False,
                        reason=errors.get(name, "not built"),
                    )
                )
                continue
            drawn[name] = samples[name]
            candidates.append(
                SelectionCandidate(
                    **common,
                    manifest_digest="",  # no manifest: built and timed here, no gates run
                    outcome="built (gates not run)",
                    eligible=True,
                    value=float(np.percentile(samples[name], QUANTILES[spec.objective] * 100)),
                    evidence="samples",
                    samples=len(samples[name]),
                )
            )
        chosen[device_class] = decide(device_class, candidates, drawn, spec)
    return chosen


def max_abs_diff(got: dict[str, Any], want: dict[str, Any]) -> float:
    """The largest absolute difference over the outputs both have."""
    import numpy as np

    return max(
        float(np.abs(np.asarray(got[k], np.float64) - np.asarray(want[k], np.float64)).max()) for k in want if k in got
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models", help=f"comma-separated, from {', '.join(MODELS)} (default: all; with --project, its models)"
    )
    ap.add_argument(
        "--project", type=Path, help="take the models from this project's params.yaml (entries and folders copied)"
    )
    ap.add_argument(
        "--skus",
        help=f"comma-separated SKUs of ./params.yaml (default: {', '.join(CPU_SKUS)}; "
        f"and {', '.join(VNNI_SKUS)} on a host with avx512_vnni)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SKU:JSON",
        help="a SKU of ./params.yaml with its options updated by the JSON object (repeatable)",
    )
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per engine and model")
    ap.add_argument("--threads", type=int, help="threads of every engine (default: each SKU's own setting)")
    ap.add_argument(
        "--objective",
        choices=OBJECTIVES,
        help="what the selection compares: per-round CPU ms per call or per-call wall ms "
        "(default: cpu under --threads 1, wall otherwise)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        help=f"interleaved rounds (default: {ROUNDS}; under --objective cpu, one sample per round, at least "
        "selection.min_samples, so the selection can separate engines)",
    )
    ap.add_argument(
        "--tuning",
        type=Path,
        default=TUNING,
        help="checked-in TVM databases, <sku>/<model>/ (default: %(default)s; a project's caches/ replays its own)",
    )
    ap.add_argument("--json", type=Path, help="write the p50s and speed-ups here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary project (its path is printed)")
    args = ap.parse_args()
    if args.models:
        models = [m for m in args.models.split(",") if m]
    elif args.project:
        import yaml

        models = list(yaml.safe_load((args.project / "params.yaml").read_text())["models"])
    else:
        models = list(MODELS)
    if args.skus:
        skus = [s for s in args.skus.split(",") if s]
    else:
        from pipeline.host.probe import cpu_features

        vnni = "avx512_vnni" in cpu_features()
        skus = list(CPU_SKUS) + (list(VNNI_SKUS) if vnni else [])
        if not vnni:
            print("x86-avx512-vnni: this host has no avx512_vnni: its SKUs are not timed", file=sys.stderr)
    variants: dict[str, tuple[str, dict[str, Any]]] = {}
    for text in args.variant:
        name, _, rest = text.partition("=")
        base, _, options = rest.partition(":")
        variants[name] = (base, json.loads(options))
    objective = args.objective or ("cpu" if args.threads == 1 else "wall")
    import yaml

    declared = yaml.safe_load(Path("params.yaml").read_text())["skus"]
    for sku in skus:  # a tuned TVM SKU is timed beside its untuned self
        if declared[sku]["backend"] == "tvm" and declared[sku].get("options", {}).get("trials", 0) > 0:
            variants.setdefault(f"{sku}{UNTUNED}", (sku, {"trials": 0}))

    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import numpy as np
    import onnxruntime as ort

    if args.threads:
        import iree.runtime

        # the local-task driver reads its worker count from process-wide flags, before its first device
        iree.runtime.flags.parse_flags(f"--task_topology_group_count={args.threads}")

    from pipeline.backends.litert import DELEGATED
    from pipeline.engine.build import build_engine
    from pipeline.project.artifacts import layout, load_arrays, model_run_plan, read_report
    from pipeline.project.config import load_registry
    from pipeline.project.data import LABELS, iter_batches, run_dataset
    from pipeline.results.reports import PrepareReport
    from pipeline.stages.calibrate import calibrate
    from pipeline.stages.data import make_data
    from pipeline.stages.prepare import prepare
    from pipeline.stages.reference import reference

    tmp = Path(tempfile.mkdtemp(prefix="skuforge-speedup-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        registry = load_registry(make_project(tmp, Path.cwd(), models, skus, variants, args.threads, args.project))
        # one CPU sample per round: as many rounds as the selection needs samples to separate engines
        rounds = args.rounds or (max(ROUNDS, registry.selection.min_samples) if objective == "cpu" else ROUNDS)
        out = layout(registry)
        engines = skus + list(variants)
        for model in models:
            prepare(registry, model)
            make_data(registry, model)
            reference(registry, model)
            if any(registry.sku(s).precision == "int8" for s in engines):
                calibrate(registry, model)
            prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
            in_idx, out_idx, batch = model_run_plan(registry, model, prep.signature)
            golden = load_arrays(out.split(model, "golden"), "data")
            golden.pop(LABELS, None)
            count = min(GOLDEN_SAMPLES, len(next(iter(golden.values()))))
            golden = {k: v[:count] for k, v in golden.items()}
            want = {k: v[:count] for k, v in load_arrays(out.reference_dir(model) / "golden.npz", "reference").items()}
            _, feeds = next(iter_batches(golden, in_idx, batch))
            source = registry.model_file(model)
            # FLOPs from the prepared model: its axes carry params.yaml's names, which the pins fix
            prepared, pins = out.prepared_model(model), registry.pins(model)
            calls: dict[str, Callable[[], Any]] = {}
            so = ort.SessionOptions()
            so.intra_op_num_threads = args.threads or 0
            default = ort.InferenceSession(str(source), so)  # defaults (but the thread count under --threads)
            names = [o.name for o in default.get_outputs()]
            calls[ORT_DEFAULTS] = lambda s=default, f=feeds: s.run(None, f)
            diffs = {
                ORT_DEFAULTS: max_abs_diff(
                    run_dataset(
                        lambda f, s=default, n=names: dict(zip(n, s.run(None, f), strict=True)),
                        golden,
                        in_idx,
                        out_idx,
                        batch,
                    ),
                    want,
                )
            }
            errors, build_s, runners, delegated, labels = {}, {}, [], {}, {}
            for sku in engines:
                spec = registry.sku(sku)
                policy: dict[str, Any] = {"tuning_trials": 0}  # untuned: TVM's default schedules
                if spec.backend == "tvm":
                    database = checked_in_database(sku, model, args.tuning)
                    tuned_sku = spec.options.get("trials", 0) > 0
                    labels[sku] = "untuned" if not tuned_sku or database else "untuned (no checked-in database)"
                    if database is not None and tuned_sku:
                        try:
                            trials = install_database(database, out.cache_dir(model, sku), sku, model, spec)
                        except DatabaseRefused as exc:
                            print(f"{model}/{sku}: tuning database refused: {exc}", file=sys.stderr)
                            labels[sku] = "untuned (database refused)"
                        else:
                            policy = {"cache_required": True}  # replays it whole, or fails on a task it lacks
                            labels[sku] = f"tuned ({trials} trials)"
                t0 = time.perf_counter()
                try:
                    built = build_engine(registry.pair(model, sku), out.engine_dir(model, sku), search=False, **policy)
                    runner = get_backend(spec.backend).load(out.engine_dir(model, sku), spec)
                except Exception as exc:  # a backend that cannot build this model: reported, not fatal
                    errors[sku] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    continue
                build_s[sku] = time.perf_counter() - t0
                runners.append(runner)
                found = delegation(built.outcome, DELEGATED)
                if found is not None:
                    delegated[sku] = found
                diffs[sku] = max_abs_diff(run_dataset(runner.infer, golden, in_idx, out_idx, batch), want)
                calls[sku] = lambda r=runner, f=feeds: r.infer(f)
            for name, diff in diffs.items():
                label = f"{labels[name]}; " if name in labels else ""
                errors[name] = f"{label}max|d| vs ref {diff:.3g} (n={count})"
            timings = measure(calls, args.seconds, rounds)
            samples, cpu_ms = timings.wall, timings.cpu_ms
            for runner in runners:
                runner.close()
            p50 = {k: statistics.median(v) for k, v in samples.items()}
            base = p50[ORT_DEFAULTS]
            shapes = " ".join(str(list(v.shape)) for v in feeds.values())
            print(f"\n== {model} {shapes}  (ORT defaults p50 {base:.3f} ms)")
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
                precision = "fp32" if name == ORT_DEFAULTS else registry.sku(name).precision
                roof = roofline_fraction(prepared, pins, p50[name], args.threads, precision)
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
                    "max_abs_diff": diffs[name],
                    **({"tuning": labels[name]} if name in labels else {}),
                }
            if delegated:
                print(
                    f"  {'delegate':28} {'compute ops':>11} {'delegated':>9} {'partitions':>10} {'+TRANSPOSE':>10}"
                    "  on built-in kernels"
                )
            for name, found in delegated.items():
                print(
                    f"  {name:28} {found['compute_ops']:11d} {found['delegated_share']:9.1%} {found['partitions']:10d} "
                    f"{found['transposes_added']:10d}  {', '.join(found['builtin_op_types']) or '-'}"
                )
                rows[name]["delegation"] = found
            chosen = select_by_class(registry, engines, selection_samples(timings, objective), errors)
            if chosen:
                quantile = "p99" if registry.selection.objective == "p99" else "p50"  # as select_by_class
                what = "CPU ms per call, one sample per round" if objective == "cpu" else "wall ms, per call"
                print(f"  selection by {objective} {quantile} ({what}; no gates run: among the engines that built)")
                print(
                    f"  {'class':18} {'selected':26} {'wall x':>7} {'cpu x':>7}  {'runner-up':26} "
                    "margin [interval]  decision"
                )
            for device_class, c in chosen.items():
                margin = "-"
                if c.margin is not None:
                    low_high = (
                        f"[{c.margin.interval[0]:.3g}, {c.margin.interval[1]:.3g}]" if c.margin.interval else "[-]"
                    )
                    margin = f"{c.margin.ratio:.3g}x {low_high}"
                wall = f"{base / p50[c.chosen]:6.2f}x" if c.chosen else f"{'-':>7}"
                cpu = f"{cpu_ms[ORT_DEFAULTS] / cpu_ms[c.chosen]:6.2f}x" if c.chosen else f"{'-':>7}"
                decision = {"separated": "separated", "tie": f"tie ({', '.join(c.tied)})"}.get(c.decision, c.decision)
                runner_up = c.runner_up or "-"
                print(f"  {device_class:18} {c.chosen or 'none':26} {wall} {cpu}  {runner_up:26} {margin}  {decision}")
                rows.setdefault(SELECTION_KEY, {})[device_class] = {
                    "selected": c.chosen,
                    "speedup": base / p50[c.chosen] if c.chosen else None,
                    "cpu_speedup": cpu_ms[ORT_DEFAULTS] / cpu_ms[c.chosen] if c.chosen else None,
                    "runner_up": c.runner_up,
                    "decision": c.decision,
                    "objective": objective,
                    "tied": c.tied,
                    "separated": c.margin.separated if c.margin else None,
                    "margin": c.margin.ratio if c.margin else None,
                    "margin_interval": c.margin.interval if c.margin else None,
                    "why": c.why,
                }
            results[model] = rows
        if all(r.get("roofline") in (None, "n/a") for rows in results.values() for r in rows.values()):
            print("\nroofline: n/a (pipeline/perf/cost.py is not in this tree)")
        else:
            print(
                "\nroofline: the model's FP32 FLOPs / p50 / this host's measured peak for the engine's precision "
                "(INT8 engines: the INT8 peak, u8 x s8 matmul; others: FP32) (pipeline.perf.cost, "
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
