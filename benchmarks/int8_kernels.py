"""INT8 on the CPU backends, side by side: does each INT8 engine run integer kernels, is it faster
than FP32, and do ONNX Runtime and OpenVINO compute the same numbers from the same QDQ graph.

Builds everything in a temporary project (nothing under build/ is read or written): the example
models (copied from examples/) and two synthetic ones where compute dominates (a conv net at 56x56
with 64-128 channels, and a 1024-wide MLP), each through the pipeline's own stages (prepare, data,
reference, calibrate, build_engine) for x86_ort_fp32, x86_ort_int8, x86_ov_fp32 and x86_ov_int8.
Run from the project root:

    python benchmarks/int8_kernels.py [--models digits_cnn,conv56] [--threads 1] [--seconds 1]
                                      [--onednn-max-isa AVX2]

Per model it prints:
  - latency (median of a bare loop on the engine's session / infer request, same thread count
    for every engine, interleaved rounds) and the INT8/FP32 ratio per backend;
  - the OpenVINO INT8 engine's compute layers (Convolution, FullyConnected, MatMul) as its build
    report gives them (the precision gate's input): how many run int8, with which kernels; and
    what the gate does not see (see "gate blind spots" below);
  - ORT INT8 vs OV INT8 outputs on the golden set: bitwise equal or not, whether both lie on the
    output's quantization grid (the QDQ graph ends in DequantizeLinear: scale * (q - zp)), their
    max abs errors against the FP32 reference and how many grid steps apart they are.

Gate blind spots (OpenVINO): the engine is the exported blob, and the runtime model of an
imported blob names only the layer itself in a fused Subgraph's originalLayersNames; so the
report cannot see the float ops fused into it. The script keeps the same build's compiled model
before export (by wrapping the backend's _compile) and lists (a) Subgraph layers reported int8
whose fused ops include float math (Add, Erf, Div, ...: the plugin computes them in f32 on
dequantized values) and (b) layers the fresh compile reports fp32 but the engine's report calls
n/a (only a QuantizeLinear name survived, so it looks like a quantization boundary).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SKUS = {"ort": ("x86_ort_fp32", "x86_ort_int8"), "ov": ("x86_ov_fp32", "x86_ov_int8")}
EXAMPLES = ("digits_cnn", "digits_transformer")
SYNTHETIC = ("conv56", "mlp1024")
# OpenVINO runtime layer types that do the multiply-accumulate work
COMPUTE = {"Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul", "Gemm", "RNNSeq", "RNNCell"}


def conv56(path: Path) -> None:
    """x[1,3,56,56] -> Conv3x3(64) -> Relu -> Conv3x3(64) -> Relu -> Conv3x3/2(128) -> Relu -> Conv3x3(128) -> Relu
    -> GlobalAveragePool -> Flatten -> Gemm(10) -> Softmax (about 0.3 GMAC)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    chans, nodes, init, prev, cin = [(64, 1), (64, 1), (128, 2), (128, 1)], [], [], "x", 3
    for i, (cout, stride) in enumerate(chans):
        w = rng.normal(0, (2.0 / (9 * cin)) ** 0.5, (cout, cin, 3, 3)).astype(np.float32)
        init += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(rng.normal(0, 0.05, cout).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node(
                "Conv",
                [prev, f"w{i}", f"b{i}"],
                [f"c{i}"],
                pads=[1, 1, 1, 1],
                strides=[stride, stride],
                name=f"conv{i}",
            ),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        prev, cin = f"r{i}", cout
    init += [
        numpy_helper.from_array(rng.normal(0, 0.2, (10, cin)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"),
    ]
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1, name="softmax"),
    ]
    _save(
        helper.make_graph(
            nodes,
            "conv56",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 56, 56])],
            [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])],
            init,
        ),
        path,
    )


def mlp1024(path: Path) -> None:
    """x[1,1024] -> 4 x (MatMul 1024x1024 -> Add -> Relu) -> MatMul 1024x10 -> y (4.2 M weights)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, init, prev = [], [], "x"
    for i in range(4):
        init += [
            numpy_helper.from_array(rng.normal(0, (2.0 / 1024) ** 0.5, (1024, 1024)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(rng.normal(0, 0.05, 1024).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"fc{i}"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"bias{i}"),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        prev = f"r{i}"
    init.append(numpy_helper.from_array(rng.normal(0, 0.05, (1024, 10)).astype(np.float32), "w_out"))
    nodes.append(helper.make_node("MatMul", [prev, "w_out"], ["y"], name="fc_out"))
    _save(
        helper.make_graph(
            nodes,
            "mlp1024",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1024])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
            init,
        ),
        path,
    )


def _save(graph: Any, path: Path) -> None:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="skuforge-bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


SYNTHETIC_SPECS = {
    "conv56": (
        conv56,
        {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 56, 56], "range": [-1.0, 1.0]}]},
    ),
    "mlp1024": (
        mlp1024,
        {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 1024], "range": [-1.0, 1.0]}]},
    ),
}


def make_project(root: Path, source: Path, models: list[str], threads: int) -> Path:
    """A project in ``root``: the example models copied from ``source``, the synthetic ones written,
    the four x86 CPU SKUs of ``source/params.yaml`` with the thread count pinned."""
    import yaml

    params = yaml.safe_load((source / "params.yaml").read_text())
    out = {"defaults": params["defaults"], "examples": {}, "models": {}, "skus": {}}
    for name in models:
        if name in EXAMPLES:
            spec = dict(params["models"][name])
            shutil.copytree(source / spec["dir"], root / "models" / name)
            spec["dir"] = f"models/{name}"
        else:
            write, extra = SYNTHETIC_SPECS[name]
            write(root / "models" / name / "model.onnx")
            spec = {
                "dir": f"models/{name}",
                "source": "model.onnx",
                "pins": {"batch": 1},
                **extra,
                "datasets": {
                    "golden": {"generate": {"count": 32, "seed": 1}},
                    "calibration": {"generate": {"count": 64, "seed": 2}},
                },
            }
        out["models"][name] = spec
    for backend, skus in SKUS.items():
        for sku in skus:
            spec = dict(params["skus"][sku])
            key = "intra_op_num_threads" if backend == "ort" else "inference_num_threads"
            spec["options"] = {**spec.get("options", {}), key: threads}
            spec["bench"] = {}
            out["skus"][sku] = spec
    (root / "params.yaml").write_text(yaml.safe_dump(out, sort_keys=False))
    return root / "params.yaml"


def bare_call(runner: Any, feeds: dict[str, Any]) -> Any:
    """The engine's own call without skuforge's input checks and output copies."""
    if hasattr(runner, "session"):  # ONNX Runtime
        session = runner.session
        return lambda: session.run(None, feeds)
    import openvino as ov

    request = runner.compiled.create_infer_request()
    for i, sig in enumerate(runner.inputs):
        request.set_input_tensor(i, ov.Tensor(feeds[sig.name], shared_memory=True))
    return request.infer


def measure(calls: dict[str, Any], seconds: float, rounds: int = 7) -> dict[str, float]:
    """Median latency (ms) per call: interleaved rounds, each about ``seconds / rounds`` per engine."""
    samples: dict[str, list[float]] = {k: [] for k in calls}
    for call in calls.values():
        for _ in range(20):  # warm-up
            call()
    for _ in range(rounds):
        for name, call in calls.items():
            n, t0 = 0, time.perf_counter()
            while True:
                call()
                n += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds / rounds and n >= 5:
                    break
            samples[name].append(elapsed / n * 1000)
    return {k: statistics.median(v) for k, v in samples.items()}


def output_grid(engine_model: Path, output: str) -> tuple[float, int] | None:
    """(scale, zero point) of the DequantizeLinear that makes ``output`` in the ORT INT8 engine."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(engine_model), load_external_data=False).graph
    init = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    node = next((n for n in graph.node if output in n.output), None)
    if node is None or node.op_type != "DequantizeLinear" or init.get(node.input[1], [0]).size != 1:
        return None
    zp = int(init[node.input[2]]) if len(node.input) > 2 and node.input[2] in init else 0
    return float(init[node.input[1]]), zp


def on_grid(values: Any, grid: tuple[float, int] | None) -> str:
    import numpy as np

    if grid is None:
        return "n/a (output not made by a per-tensor DequantizeLinear)"
    scale, zp = grid
    q = np.round(values.astype(np.float64) / scale) + zp
    exact = np.array_equal(values, ((q - zp).astype(np.float32) * np.float32(scale)).astype(np.float32))
    return "yes" if exact else f"no (max {np.abs(values / scale - np.round(values / scale)).max():.3g} steps off)"


class CaptureCompile:
    """While active, keeps what the OpenVINO backend's build compiles: the ONNX graph it reads
    (the QDQ graph for INT8) and the freshly compiled model, before export and re-import."""

    def __enter__(self) -> CaptureCompile:  # noqa: PYI034
        from pipeline.backends import openvino as ovb

        self._module, self._read, self._compile = ovb, ovb._read_model, ovb._compile
        self.onnx_model, self.compiled = None, None

        def read(path: Path, onnx_model: Any) -> Any:
            self.onnx_model = onnx_model
            return self._read(path, onnx_model)

        def compile_(model: Any, device: str, config: dict[str, str]) -> Any:
            self.compiled = self._compile(model, device, config)
            return self.compiled

        ovb._read_model, ovb._compile = read, compile_
        return self

    def __exit__(self, *exc: object) -> None:
        self._module._read_model, self._module._compile = self._read, self._compile


def gate_blind_spots(capture: CaptureCompile, engine_layers: list[Any]) -> tuple[list[str], list[str]]:
    """What the engine's report (the precision gate's input) says against the fresh compile of the
    same build (see the module docstring)."""
    from pipeline.backends.openvino import onnx_op_types, runtime_layers

    onnx_types = onnx_op_types(capture.onnx_model)
    fresh = {layer.name: layer for layer in runtime_layers(capture.compiled, {}, onnx_types)[0]}
    hidden_float, hidden_fp32 = [], []
    for layer in engine_layers:
        full = fresh.get(layer.name)
        if full is None:
            continue
        float_ops = sorted(
            {onnx_types[n] for n in full.fused_from if n in onnx_types} - {"QuantizeLinear", "DequantizeLinear"}
        )
        if layer.op_type == "Subgraph" and layer.precision == "int8" and float_ops:
            hidden_float.append(f"{layer.name} [{'+'.join(float_ops)}]")
        if full.precision == "fp32" and layer.precision != "fp32":
            hidden_fp32.append(f"{layer.name} (reported {layer.precision}, fused {'+'.join(float_ops) or '?'})")
    return hidden_float, hidden_fp32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--models",
        default=",".join(EXAMPLES + SYNTHETIC),
        help=f"comma-separated, from {', '.join(EXAMPLES + SYNTHETIC)}",
    )
    ap.add_argument("--threads", type=int, default=1, help="threads of every engine (ORT intra-op, OV inference)")
    ap.add_argument("--seconds", type=float, default=1.0, help="timed seconds per engine and model")
    ap.add_argument(
        "--onednn-max-isa",
        metavar="ISA",
        help="cap OpenVINO's oneDNN kernels (ONEDNN_MAX_CPU_ISA: AVX2, AVX2_VNNI, AVX512_CORE, "
        "AVX512_CORE_VNNI): an AVX2 or non-VNNI target on this host; ONNX Runtime ignores it",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary project (its path is printed)")
    args = ap.parse_args()
    if args.onednn_max_isa:
        if "openvino" in sys.modules:
            sys.exit("--onednn-max-isa must be set before openvino is imported")
        os.environ["ONEDNN_MAX_CPU_ISA"] = args.onednn_max_isa
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in EXAMPLES + SYNTHETIC]
    if unknown:
        sys.exit(f"unknown models {unknown}; known: {', '.join(EXAMPLES + SYNTHETIC)}")

    import logging
    import warnings

    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's "consider pre-processing" lines
    warnings.filterwarnings("ignore")
    import numpy as np

    from pipeline.backends import get_backend
    from pipeline.engine.build import build_engine
    from pipeline.project.artifacts import layout, load_arrays
    from pipeline.project.config import load_registry
    from pipeline.stages.calibrate import calibrate
    from pipeline.stages.data import make_data
    from pipeline.stages.prepare import prepare
    from pipeline.stages.reference import reference

    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.is_file() else set()
    vnni = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    print(
        f"CPU: avx2 {'avx2' in flags}, avx512f {'avx512f' in flags}, int8 dot-product instructions: "
        f"{', '.join(vnni) or 'none (no VNNI: int8 has less edge over fp32)'}; {args.threads} thread(s) per engine"
        + (f"; OpenVINO capped at {args.onednn_max_isa}" if args.onednn_max_isa else "")
    )

    tmp = Path(tempfile.mkdtemp(prefix="skuforge-int8-"))
    try:
        registry = load_registry(make_project(tmp, Path.cwd(), models, args.threads))
        out = layout(registry)
        for model in models:
            prepare(registry, model)
            make_data(registry, model)
            reference(registry, model)
            calibrate(registry, model)
            golden = load_arrays(out.split(model, "golden"), "data")
            golden.pop("labels", None)
            expected = load_arrays(out.reference_dir(model) / "golden.npz", "reference")
            n = len(next(iter(golden.values())))
            runners, results, layers = {}, {}, {}
            for skus in SKUS.values():
                for sku in skus:
                    spec = registry.sku(sku)
                    capture = CaptureCompile()
                    with capture if sku == SKUS["ov"][1] else contextlib.nullcontext():
                        built = build_engine(registry.pair(model, sku), out.engine_dir(model, sku))
                    if sku == SKUS["ov"][1]:
                        blind = gate_blind_spots(capture, built.outcome.layers)
                    layers[sku] = built.outcome.layers
                    runners[sku] = get_backend(spec.backend).load(out.engine_dir(model, sku), spec)
                    outs = [runners[sku].infer({k: v[i : i + 1] for k, v in golden.items()}) for i in range(n)]
                    results[sku] = {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}
            first = {k: v[:1] for k, v in golden.items()}
            latency = measure({sku: bare_call(r, first) for sku, r in runners.items()}, args.seconds)
            for r in runners.values():
                r.close()

            print(f"\n== {model}")
            for backend, (fp32, int8) in SKUS.items():
                print(
                    f"  {backend:3} latency fp32 {latency[fp32]:8.3f} ms  int8 {latency[int8]:8.3f} ms  "
                    f"int8/fp32 {latency[int8] / latency[fp32]:.2f}"
                )
            ov_layers = [layer for layer in layers[SKUS["ov"][1]] if layer.op_type in COMPUTE]
            in_int8 = [layer for layer in ov_layers if layer.precision == "int8"]
            kernels = collections.Counter(f"{layer.op_type}:{layer.kernel}" for layer in ov_layers)
            print(
                f"  ov int8 compute layers in int8: {len(in_int8)}/{len(ov_layers)}  "
                + ", ".join(f"{k} x{c}" for k, c in sorted(kernels.items()))
            )
            hidden_float, hidden_fp32 = blind
            if hidden_float:
                print(
                    f"  gate blind spot: {len(hidden_float)} Subgraph layers reported int8 compute float ops on "
                    f"dequantized values: {', '.join(hidden_float[:4])}{' ...' if len(hidden_float) > 4 else ''}"
                )
            if hidden_fp32:
                print(
                    f"  gate blind spot: {len(hidden_fp32)} fp32 layers of the fresh compile are not fp32 "
                    f"in the engine's report (fused names lost on export/import): "
                    f"{', '.join(hidden_fp32[:3])}{' ...' if len(hidden_fp32) > 3 else ''}"
                )
            engine_model = out.engine_dir(model, SKUS["ort"][1]) / "model.onnx"
            for name, want in expected.items():
                a, b = results[SKUS["ort"][1]][name], results[SKUS["ov"][1]][name]
                grid = output_grid(engine_model, name)
                err_a, err_b = np.abs(a - want), np.abs(b - want)
                steps = ""
                if grid is not None:
                    d = np.abs(np.round(a / grid[0]) - np.round(b / grid[0]))
                    steps = f", grid steps apart: max {int(d.max())}, {int((d > 0).sum())}/{d.size} elements differ"
                print(
                    f"  output {name}: ort int8 vs ov int8 bitwise equal {np.array_equal(a, b)} "
                    f"({int((a == b).sum())}/{a.size} elements equal{steps})"
                )
                print(
                    f"    on the quantization grid{f' (scale {grid[0]:.6g}, zp {grid[1]})' if grid else ''}: "
                    f"ort {on_grid(a, grid)}, ov {on_grid(b, grid)}"
                )
                same_spot = np.argmax(err_a) == np.argmax(err_b)
                print(
                    f"    max abs error vs fp32 reference: ort {float(err_a.max())!r}  ov {float(err_b.max())!r}"
                    f"  (same element: {bool(same_spot)}; fp32 engines: "
                    f"ort {float(np.abs(results[SKUS['ort'][0]][name] - want).max()):.3g}"
                    f", ov {float(np.abs(results[SKUS['ov'][0]][name] - want).max()):.3g})"
                )
    finally:
        if args.keep:
            print(f"\nproject kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
