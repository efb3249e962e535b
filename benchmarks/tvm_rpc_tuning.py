"""Tuning through TVM's RPC tracker against tuning on this host, on the tiny CNN of the tests.

    python benchmarks/tvm_rpc_tuning.py [--trials 10] [--rounds 200]

Starts a real tracker and two rpc_server processes on loopback (TVM's tracker needs tornado), then
for the model's tuning tasks:
- tuning time: the same trial budget measured by the two servers (RPCRunner, one session per
  candidate) and on this host (LocalRunner), and the ratio (the RPC overhead: sessions, uploads);
- engine latency (the Relax VM on this host, median of ``--rounds`` calls): untuned (TVM's default
  schedules), tuned through the tracker, tuned locally, and the ratios.
The "devices" are this host, so the figures show the bench's overhead, not a device's speed.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import models  # noqa: E402
from rpc_bench import free_port, start  # noqa: E402

from pipeline.backends.tvm import (  # noqa: E402
    TvmOptions,
    compile_module,
    extract_tasks,
    import_onnx,
    lower,
    open_database,
    target_of,
    tune_run,
)
from pipeline.backends.tvm.rpc import RpcOptions, registered, rpc_runner, wait_for_key  # noqa: E402
from pipeline.model.graph import pin_axes  # noqa: E402

KEY = "bench"


def _latency(mod, target, database, rounds: int, folder: Path, inputs: dict) -> float:
    """Median microseconds of one call of the engine on this host."""
    import numpy as np
    import tvm
    from tvm import relax

    path = folder / f"engine-{time.monotonic_ns()}.so"
    compile_module(mod, target, database, 3).export_library(str(path))
    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), dev)
    rng = np.random.default_rng(0)
    x = [tvm.runtime.tensor(rng.standard_normal(shape).astype(np.float32), dev) for shape in inputs.values()]
    for _ in range(10):
        vm["main"](*x)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        vm["main"](*x)
        times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument(
        "--onnx",
        type=Path,
        help="a float-input ONNX model with batch 1 or a batch axis (e.g. an example's "
        "build/digits_cnn/prepared/model.onnx); default: the tests' tiny CNN",
    )
    args = parser.parse_args()
    import onnx
    import tvm

    os.environ.setdefault("TVM_NUM_THREADS", "1")
    port = free_port()
    procs = [start("tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1))]
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                registered("127.0.0.1", port)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for _ in range(2):
            p = free_port()
            procs.append(
                start(
                    "tvm.exec.rpc_server",
                    *("--tracker", f"127.0.0.1:{port}", "--key", KEY, "--host", "127.0.0.1"),
                    *("--port", str(p), "--port-end", str(p + 1)),
                )
            )
        wait_for_key("127.0.0.1", port, KEY, 60)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            if args.onnx:
                model = pin_axes(onnx.load(str(args.onnx)), {"batch": 1}, folder)
            else:
                model = onnx.load(str(models.conv_bn_model(folder / "conv.onnx", batch=1)))
            inputs = {i.name: [d.dim_value or 1 for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
            print(f"model {args.onnx or 'tiny CNN (tests/models.py)'}: inputs {inputs}")
            imported = import_onnx(model, {})
            target = tvm.target.Target(target_of(TvmOptions(target_cpu="x86-64-v3", num_cores=1), "x86_64"))
            mod, _ = lower(imported.mod, target, imported.node_of)
            tasks = extract_tasks(mod, target)
            import tvm.s_tir.tensor_intrin  # noqa: F401 - what the first tuning imports (~60 s): not timed

            per_task = max(1, args.trials // len(tasks))
            runs = {}
            for name, runner in (
                ("tracker", rpc_runner(RpcOptions(key=KEY), "127.0.0.1", port)),
                ("local", None),
            ):
                work = folder / name
                work.mkdir()
                runs[name] = (tune_run(tasks, target, work, args.trials, per_task, runner=runner), open_database(work))
            untuned = _latency(mod, target, None, args.rounds, folder, inputs)
            latency = {name: _latency(mod, target, db, args.rounds, folder, inputs) for name, (_, db) in runs.items()}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(
        f"{args.onnx or 'tiny CNN'}, {len(tasks)} tasks, {args.trials} trials ({per_task} a task), two loopback servers"
    )
    for name, (run, _) in runs.items():
        print(
            f"  tune {name:8s}: {run.seconds:7.1f} s, {run.measured} measured, {run.failed} failed, "
            f"{run.trials} records; engine {latency[name]:8.1f} us"
        )
    print(f"  untuned engine  : {untuned:8.1f} us")
    t, loc = runs["tracker"][0].seconds, runs["local"][0].seconds
    print(f"  tuning time tracker/local: {t / loc:.2f}x")
    print(f"  latency tuned(tracker)/untuned: {latency['tracker'] / untuned:.2f}x")
    print(f"  latency tuned(local)/untuned:   {latency['local'] / untuned:.2f}x")
    print(f"  latency tracker/local:          {latency['tracker'] / latency['local']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
