"""The engine worker run under emulation (``pipeline.backends.emulated``): an aarch64 Python under
QEMU user-mode emulation, with the SKU's runtime from PyPI's aarch64 wheels, loads one engine and
runs it on the arrays it is sent. It imports nothing of skuforge's (its environment has only numpy
and the runtimes) and only the runtime's own calls run here: the skuforge runner around it (input
checks, quantisation of int8 inputs, output layouts) runs on the host, as for a native engine.

Messages are a 4-byte big-endian length and a JSON document, on stdin (requests) and stdout
(replies); arrays travel in .npz files the host names (QEMU user mode shares the host's files),
read with ``allow_pickle=False``.

- ``{"load": {"runtime": "onnxruntime", "model", "providers", "level", "intra", "inter"}}`` or
  ``{"load": {"runtime": "litert", "model", "delegate", "num_threads"}}`` -> ``{"ready", "versions",
  "machine", "inputs", "outputs"}`` (ONNX Runtime: name, type, shape per tensor).
- ``{"run": {"inputs": npz, "outputs": npz, "names": [...]}}`` (ONNX Runtime: feeds by input name,
  outputs by name; LiteRT: keys are tensor indices as text) -> ``{"done"}``.
- Any failure -> ``{"error": "<the exception's first line>", "kind": "<its class>"}``; EOF ends it.
"""

from __future__ import annotations

import json
import os
import platform
import struct
import sys
from typing import Any

import numpy as np


def _send(message: dict) -> None:
    body = json.dumps(message).encode()
    os.write(1, struct.pack(">I", len(body)) + body)


def _receive() -> dict | None:
    def exactly(n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = os.read(0, n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    head = exactly(4)
    body = exactly(struct.unpack(">I", head)[0]) if head else None
    return json.loads(body) if body is not None else None


class _Ort:
    def __init__(self, spec: dict) -> None:
        import onnxruntime as ort

        levels = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }
        so = ort.SessionOptions()
        so.graph_optimization_level = levels[spec["level"]]
        so.intra_op_num_threads = int(spec.get("intra", 0))
        so.inter_op_num_threads = int(spec.get("inter", 0))
        so.log_severity_level = 3
        self.session = ort.InferenceSession(spec["model"], so, providers=spec["providers"])
        self.versions = {"onnxruntime": ort.__version__}

    def describe(self) -> dict:
        def sig(t: Any) -> dict:
            return {"name": t.name, "type": t.type, "shape": [d if isinstance(d, int) else None for d in t.shape]}

        return {
            "inputs": [sig(t) for t in self.session.get_inputs()],
            "outputs": [sig(t) for t in self.session.get_outputs()],
            "providers": self.session.get_providers(),
        }

    def run(self, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        return dict(zip(names, self.session.run(names, feeds), strict=True))


class _LiteRt:
    def __init__(self, spec: dict) -> None:
        from importlib.metadata import version

        from ai_edge_litert import interpreter as lite

        resolver = (
            lite.OpResolverType.AUTO
            if spec["delegate"] == "xnnpack"
            else lite.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        )
        self.interp = lite.Interpreter(
            model_path=spec["model"], num_threads=int(spec["num_threads"]), experimental_op_resolver_type=resolver
        )
        self.interp.allocate_tensors()
        self.versions = {"ai-edge-litert": version("ai-edge-litert")}

    def describe(self) -> dict:
        return {}

    def run(self, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        for key, arr in feeds.items():
            self.interp.set_tensor(int(key), arr)
        self.interp.invoke()
        return {name: np.array(self.interp.get_tensor(int(name))) for name in names}


def main() -> int:
    engine: _Ort | _LiteRt | None = None
    while True:
        request = _receive()
        if request is None:
            return 0
        try:
            if "load" in request:
                spec = request["load"]
                engine = _Ort(spec) if spec["runtime"] == "onnxruntime" else _LiteRt(spec)
                reply = {"ready": True, "versions": engine.versions, "machine": platform.machine()}
                reply.update(engine.describe())
                _send(reply)
            elif "run" in request and engine is not None:
                run = request["run"]
                with np.load(run["inputs"], allow_pickle=False) as data:
                    feeds = {k: data[k] for k in data.files}
                outputs: dict[str, Any] = engine.run(feeds, list(run["names"]))
                with open(run["outputs"], "wb") as f:
                    np.savez(f, **outputs)
                _send({"done": True})
            else:
                _send({"error": f"unexpected request {sorted(request)}", "kind": "ValueError"})
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the host, which decides
            lines = str(exc).strip().splitlines()
            _send({"error": lines[0] if lines else type(exc).__name__, "kind": type(exc).__name__})


if __name__ == "__main__":
    sys.exit(main())
