"""Benchmark fidelity: skuforge's runner against each stack's own tool, on the same engine file.

Target (issue 13): the bench stage's engine-only p50 (``runner.infer(feeds)`` timed by
``pipeline.perf.harness.time_calls``) within 5% of the stack's own measurement AND under 5 us per
call above it. The references, per backend:

    onnxruntime  a bare InferenceSession.run loop, session options as the engine loads them
    openvino     benchmark_app (sync API, the engine's compile config) and a bare InferRequest.infer loop
    iree         iree-benchmark-module (one call per repetition: a p50, not a mean), a bare invoke loop
                 and one that also copies the outputs to numpy (what returning them costs at least)
    tvm          the Relax VM's time_evaluator (one call per repeat) on a VM loaded as the runner loads it

The timers run interleaved, in rounds, in one process (the tools as subprocesses in their turn);
each p50 is the median of the per-round p50s. Run in the example project after `skuforge repro`:

    python benchmarks/fidelity.py [--project DIR] [--model M] [--sku S] [--rounds 7] [--seconds 0.5] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RATIO_TARGET = 1.05
OVERHEAD_TARGET_US = 5.0
CPU_BACKENDS = ("onnxruntime", "openvino", "iree", "tvm")
BIN = Path(sys.executable).parent


@dataclass
class Timer:
    """One way of timing the engine: ``measure(iterations, seconds)`` returns one round's p50 in ms."""

    name: str
    measure: Callable[[int, float], float]
    rounds_ms: list[float] = field(default_factory=list)

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.rounds_ms)


@dataclass
class Row:
    model: str
    sku: str
    reference: str
    skuforge_p50_us: float | None = None
    reference_p50_us: float | None = None
    ratio: float | None = None
    overhead_us: float | None = None
    verdict: str = "SKIP"
    note: str = ""


def python_timer(name: str, fn: Callable[[], object]) -> Timer:
    from pipeline.perf.harness import time_calls

    fn()
    return Timer(name, lambda n, s: statistics.median(time_calls(fn, n, s)))


# --- the references, per backend ---------------------------------------------------------------


def onnxruntime_refs(engine: Path, meta: dict, feeds: dict, work: Path, calls: int) -> list[Timer]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    levels = {
        "disable": "ORT_DISABLE_ALL",
        "basic": "ORT_ENABLE_BASIC",
        "extended": "ORT_ENABLE_EXTENDED",
        "all": "ORT_ENABLE_ALL",
    }
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, levels[meta["load_optimization_level"]])
    so.intra_op_num_threads = meta["intra_op_num_threads"]
    so.inter_op_num_threads = meta["inter_op_num_threads"]
    so.log_severity_level = 3
    if "CPUExecutionProvider" not in meta["providers"]:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    providers = meta["providers"]
    sess = ort.InferenceSession(
        str(engine / "model.onnx"),
        so,
        providers=providers,
        provider_options=[meta["provider_options"].get(p, {}) for p in providers],
    )
    names = [o.name for o in sess.get_outputs()]
    return [python_timer("ort InferenceSession.run", lambda: sess.run(names, feeds))]


def openvino_refs(engine: Path, meta: dict, feeds: dict, work: Path, calls: int) -> list[Timer]:
    import numpy as np
    import openvino as ov

    blob = engine / meta["blob"]
    compiled = ov.Core().import_model(blob.read_bytes(), meta["device"], meta["config"])
    request = compiled.create_infer_request()
    for i, name in enumerate(meta["inputs"]):
        request.set_input_tensor(i, ov.Tensor(feeds[name], shared_memory=True))
    bare = python_timer("ov InferRequest.infer", request.infer)

    if blob.suffix != ".blob":  # benchmark_app imports a compiled model only from a .blob file
        (work / "model.blob").symlink_to(blob)
        blob = work / "model.blob"
    config = work / "ov_config.json"
    config.write_text(json.dumps({meta["device"]: meta["config"]}))
    for name in meta["inputs"]:
        np.save(work / f"{name}.npy", feeds[name])
    inputs = ",".join(f"{name}:{work / name}.npy" for name in meta["inputs"])
    hint = meta["config"].get("PERFORMANCE_HINT", "LATENCY").lower()

    def benchmark_app(n: int, seconds: float) -> float:
        cmd = [
            sys.executable,
            "-c",
            BENCHMARK_APP,
            "-m",
            str(blob),
            "-d",
            meta["device"],
            "-hint",
            hint,
            "-api",
            "sync",
            "-load_config",
            str(config),
            "-i",
            inputs,
            "-niter",
            str(max(n, calls)),
        ]
        out = run_tool(cmd)
        found = re.search(r"Median:\s+([\d.]+)\s*(us|ms)", out)
        if not found:
            raise RuntimeError(f"no 'Median:' in benchmark_app's output:\n{out[-2000:]}")
        value = float(found.group(1))
        return value / 1000 if found.group(2) == "us" else value

    # its Median is the request's own latency, timed in C++ around infer (no Python call in it)
    return [Timer("benchmark_app (sync)", benchmark_app), bare]


def iree_refs(engine: Path, meta: dict, feeds: dict, work: Path, calls: int) -> list[Timer]:
    import iree.runtime as rt
    import numpy as np
    from iree.runtime.array_interop import map_dtype_to_element_type

    vmfb = engine / "module.vmfb"
    config = rt.Config(meta["driver"])
    context = rt.SystemContext(config=config)
    module = rt.VmModule.copy_buffer(config.vm_instance, vmfb.read_bytes())
    context.add_vm_module(module)
    function = module.lookup_function(meta["entry"])
    args = rt.VmVariantList(len(meta["inputs"]))
    for sig in meta["inputs"]:
        arr = feeds[sig["name"]]
        args.push_ref(
            config.device.allocator.allocate_buffer_copy(
                memory_type=rt.MemoryType.DEVICE_LOCAL,
                allowed_usage=rt.BufferUsage.DEFAULT,
                device=config.device,
                buffer=arr,
                element_type=map_dtype_to_element_type(arr.dtype),
            )
        )
    n_out, vm_context = len(meta["outputs"]), context.vm_context

    def invoke() -> None:
        vm_context.invoke(function, args, rt.VmVariantList(n_out))

    bare = python_timer("iree vm_context.invoke", invoke)

    def invoke_and_read() -> None:
        # the least a caller that wants the outputs does more: each copied from its mapping into a
        # new array (the runner's way on the CPU drivers; the bare loop above never reads them)
        results = rt.VmVariantList(n_out)
        vm_context.invoke(function, args, results)
        for i in range(n_out):
            view = results.get_as_object(i, rt.HalBufferView)
            np.ndarray(view.shape, rt.HalElementType.map_to_dtype(view.element_type), view.map()).copy()

    read = python_timer("iree invoke + outputs to numpy", invoke_and_read)
    inputs = []
    for sig in meta["inputs"]:
        path = work / f"{sig['name']}.npy"
        np.save(path, feeds[sig["name"]])
        inputs.append(f"--input=@{path}")
    # the runner takes the runtime's default flags (topology included), as the tool does; flags set
    # for the Python runtime by environment are passed to the tool too
    extra = os.environ.get("IREE_PY_RUNTIME_FLAGS", "").split()

    def benchmark_module(n: int, seconds: float) -> float:
        # one call per repetition: each repetition's real_time is one call, so their median is a p50
        cmd = [
            str(BIN / "iree-benchmark-module"),
            f"--module={vmfb}",
            f"--device={meta['driver']}",
            f"--function={meta['entry']}",
            *inputs,
            *extra,
            "--benchmark_min_time=1x",
            f"--benchmark_repetitions={max(n, calls)}",
            "--benchmark_format=json",
        ]
        report = json.loads(run_tool(cmd, stdout_only=True))
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
        times = [
            b["real_time"] * scale[b["time_unit"]] for b in report["benchmarks"] if b.get("run_type") == "iteration"
        ]
        return statistics.median(times)

    return [Timer("iree-benchmark-module", benchmark_module), read, bare]


def tvm_refs(engine: Path, meta: dict, feeds: dict, work: Path, calls: int) -> list[Timer]:
    import tvm
    from tvm import relax

    from pipeline.backends.tvm import runtime_threads

    runtime_threads(meta["num_threads"])  # already set by the runner's load: the pool is per process
    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(engine / meta["library"])), dev)
    args = [tvm.runtime.tensor(feeds[sig["name"]], dev) for sig in meta["inputs"]]

    def time_evaluator(n: int, seconds: float) -> float:
        result = vm.time_evaluator(meta["entry"], dev, number=1, repeat=max(n, calls))(*args)
        return statistics.median(result.results) * 1000

    return [Timer("tvm time_evaluator", time_evaluator)]


# benchmark_app as .venv/bin/benchmark_app runs it, but for two bugs that stop it loading a .blob
# (OpenVINO 2026.4): -ip/-op/-iop default to None, not "", so it refuses every blob as one "given a
# precision"; and it passes Core.import_model the path, which takes only bytes. Its measuring loop
# (sync API, the request's own latency) is untouched.
BENCHMARK_APP = """
import sys
import openvino
from openvino.tools.benchmark import main as app
import_model = openvino.Core.import_model
def import_path(self, model, *args, **kwargs):
    if isinstance(model, str):
        with open(model, "rb") as f:
            model = f.read()
    return import_model(self, model, *args, **kwargs)
openvino.Core.import_model = import_path
parser_of = app.parse_args
def parse_args():
    parser = parser_of()
    parser.set_defaults(input_precision="", output_precision="", input_output_precision="")
    return parser
app.parse_args = parse_args
sys.argv[0] = "benchmark_app"
sys.exit(app.main())
"""

REFERENCES: dict[str, Callable[..., list[Timer]]] = {
    "onnxruntime": onnxruntime_refs,
    "openvino": openvino_refs,
    "iree": iree_refs,
    "tvm": tvm_refs,
}


def run_tool(cmd: list[str], stdout_only: bool = False) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return proc.stdout if stdout_only else proc.stdout + proc.stderr


# --- one (model, SKU) ------------------------------------------------------------------------------


def feeds_for(registry: Any, model: str, sku: str) -> dict[str, Any]:
    """The bench stage's engine-only feeds: the first golden batch at the SKU's batch."""
    from pipeline.project.artifacts import batch_indices, layout, load_arrays, read_report
    from pipeline.project.data import LABELS, iter_batches
    from pipeline.results.reports import PrepareReport

    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    batch = registry.pins(model, sku).get(registry.model(model).batch_axis or "", 1)
    in_idx, _ = batch_indices(registry.model(model), prep.signature)
    golden = load_arrays(out.split(model, "golden"), "data")
    golden.pop(LABELS, None)
    return next(iter_batches(golden, in_idx, batch))[1]


def measure(
    registry: Any, model: str, sku: str, rounds: int, iterations: int, seconds: float, aa: bool = False
) -> list[Row]:
    """The rows of one (model, SKU); ``aa``: also the last reference against a second copy of itself,
    timed in the same rounds (the noise floor of this machine at the time)."""
    from pipeline.backends import get_backend
    from pipeline.core.errors import SkuforgeError
    from pipeline.project.artifacts import layout

    spec = registry.sku(sku)
    if spec.target.arch != platform.machine():
        return [Row(model, sku, "-", note=f"needs {spec.target.arch}, this host is {platform.machine()}")]
    engine = layout(registry).engine_dir(model, sku)
    if not (engine / "engine.json").is_file():
        return [Row(model, sku, "-", note=f"no engine at {engine} (run `skuforge repro` first)")]
    try:
        runner = get_backend(spec.backend).load(engine, spec)
    except SkuforgeError as exc:
        return [Row(model, sku, "-", note=f"cannot load here: {exc}")]
    meta = json.loads((engine / "engine.json").read_text())
    with runner, tempfile.TemporaryDirectory(prefix="skuforge-fidelity-") as tmp:
        feeds = feeds_for(registry, model, sku)
        ours = python_timer("skuforge runner.infer", lambda: runner.infer(feeds))
        # a first short round sizes the tools' runs to about the same time as a loop's round
        warm_ms = ours.measure(min(iterations, 200), 0.0)
        calls = max(iterations, math.ceil(seconds / (warm_ms / 1000)))
        refs = REFERENCES[spec.backend](engine, meta, feeds, Path(tmp), calls)
        twin = [Timer(f"A/A {refs[-1].name} (noise)", refs[-1].measure)] if aa else []
        timers = [ours, *refs, *twin]
        for r in range(rounds):
            for timer in timers[r % len(timers) :] + timers[: r % len(timers)]:  # rotate: no timer always first
                timer.rounds_ms.append(timer.measure(iterations, seconds))
    rows = []
    for ref in refs:
        ratio = ours.p50_ms / ref.p50_ms
        over = (ours.p50_ms - ref.p50_ms) * 1000
        rows.append(
            Row(
                model,
                sku,
                ref.name,
                ours.p50_ms * 1000,
                ref.p50_ms * 1000,
                ratio,
                over,
                "PASS" if ratio <= RATIO_TARGET and over < OVERHEAD_TARGET_US else "FAIL",
                note=f"rounds: ours {fmt(ours.rounds_ms)}; ref {fmt(ref.rounds_ms)}",
            )
        )
    for copy in twin:
        ref = refs[-1]
        rows.append(
            Row(
                model,
                sku,
                copy.name,
                copy.p50_ms * 1000,
                ref.p50_ms * 1000,
                copy.p50_ms / ref.p50_ms,
                (copy.p50_ms - ref.p50_ms) * 1000,
                "noise",
                note=f"rounds: {fmt(copy.rounds_ms)}",
            )
        )
    return rows


def fmt(values_ms: list[float]) -> str:
    return " ".join(f"{v * 1000:.1f}" for v in values_ms)


def cpu_skus(registry: Any) -> list[str]:
    out = []
    for name, spec in registry.skus.items():
        local = spec.backend != "iree" or spec.options.get("target_device", "local") == "local"
        if spec.backend in CPU_BACKENDS and spec.target.device == "cpu" and local:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, default=Path.cwd(), help="the project root (params.yaml); default: here")
    ap.add_argument("--model", action="append", help="only this model (repeatable)")
    ap.add_argument("--sku", action="append", help="only this SKU (repeatable; default: every CPU SKU)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iterations", type=int, default=2000, help="calls per round at least")
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per round at least")
    ap.add_argument("--aa", action="store_true", help="also time the last reference twice: the noise floor")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)

    from pipeline.project.config import load_registry

    os.chdir(args.project)  # paths in params.yaml are relative to the project
    registry = load_registry(args.project / "params.yaml")
    models = args.model or list(registry.models)
    skus = args.sku or cpu_skus(registry)
    rows: list[Row] = []
    for model in models:
        for sku in skus:
            print(f"[{model}/{sku}] measuring", file=sys.stderr, flush=True)
            rows += measure(registry, model, sku, args.rounds, args.iterations, args.seconds, args.aa)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(render(rows))
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


def render(rows: list[Row]) -> str:
    head = (
        f"{'model':<19} {'sku':<18} {'reference':<36} {'skuforge_us':>11} {'ref_us':>9} {'ratio':>6} "
        f"{'over_us':>8}  verdict"
    )
    lines = [head]
    for r in rows:
        if r.skuforge_p50_us is None:
            lines.append(f"{r.model:<19} {r.sku:<18} {'-':<36} {'-':>11} {'-':>9} {'-':>6} {'-':>8}  SKIP  {r.note}")
            continue
        lines.append(
            f"{r.model:<19} {r.sku:<18} {r.reference:<36} {r.skuforge_p50_us:>11.1f} {r.reference_p50_us:>9.1f} "
            f"{r.ratio:>6.3f} {r.overhead_us:>+8.1f}  {r.verdict}"
        )
    lines.append(
        f"target: ratio <= {RATIO_TARGET} and overhead < {OVERHEAD_TARGET_US} us per call; "
        f"p50 = median of per-round p50s"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
