"""The backend contract, checked the same way for every backend (docs/backends.md, "Adding a backend").

One engine per backend, built once per module from a tiny model with three inputs of three dtypes
(one a scalar) and two outputs of two dtypes: it runs like the reference runtime; its runner refuses
a wrong input name, dtype or shape; a damaged engine and an engine of another version or format are
refused; engine.json round-trips through ``write_meta``/``read_meta``. Without an engine: a missing SDK
is exit 3 with the backend's install hint, an op the backend lacks is ``UnsupportedOp`` naming the op,
the node and the backend, and the SKU checks refuse what ``capabilities`` does not declare.

A backend this host cannot build or run (TensorRT without an NVIDIA GPU) skips what needs an engine,
with the reason; the rest runs everywhere. What is specific to a stack stays in its own test module.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import models
import numpy as np
import pytest

from pipeline.backends import (
    backend_class,
    get_backend,
    known_backends,
    register_backend,
    registered_backend,
    unregister_backend,
)
from pipeline.backends.contract import ENGINE_META, BuildContext, EngineMeta
from pipeline.backends.reference import reference_runner
from pipeline.core.errors import ConfigError, EnvironmentProblem, InputError, UnsupportedOp
from pipeline.core.io import sha256_file
from pipeline.core.paths import Layout
from pipeline.engine.build import build_engine
from pipeline.engine.hostcheck import host_problems
from pipeline.project.config import SkuSpec, load_registry, parse_registry
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare

MODEL = "multi"  # x float32 [batch,6], ids int64 [batch,3], scale float32 []  ->  y float32, cls int64
PRECISIONS = ("fp32", "fp16", "int8")
DEVICES = ("cpu", "gpu", "npu")


@dataclass(frozen=True)
class Unsupported:
    """A model with an op the backend cannot compile: the builder, its params.yaml entry, the op, the node."""

    build: Callable[[Path], Path]
    spec: Callable[[str], dict]
    op: str
    node: str


@dataclass(frozen=True)
class Stack:
    backend: str
    sku: dict  # an fp32 SKU of this backend (for this host's CPU where the backend builds for CPUs)
    sdk: tuple[str, ...]  # the modules whose import failing means the SDK is missing
    unsupported: Unsupported | None = None
    no_unsupported: str = ""  # why there is no UnsupportedOp case

    def __str__(self) -> str:
        return self.backend


def _gpu(sku: dict) -> dict:
    return {**sku, "target": {**sku["target"], "device": "gpu"}}


DET = Unsupported(models.det_model, models.det_spec, "Det", "determinant")
# Adding a backend: one entry here.
STACKS = [
    Stack(
        "onnxruntime",
        models.CPU_SKUS["ort_fp32"],
        ("onnxruntime",),
        Unsupported(models.int16_relu_model, models.int16_relu_spec, "Relu", "relu_int16"),
    ),
    Stack("openvino", models.CPU_SKUS["ov_fp32"], ("openvino",), DET),
    Stack(
        "iree",
        models.CPU_SKUS["iree_fp32"],
        ("iree.compiler", "iree.runtime"),
        Unsupported(models.dft_model, models.dft_spec, "DFT", "spectrum"),
    ),
    Stack(
        "tvm",
        models.cpu_sku("tvm", "fp32", {"num_cores": 2}),  # target_cpu host: the CPU this engine runs on
        ("tvm",),
        Unsupported(partial(models.rnn_model, cell="LSTM"), partial(models.rnn_spec, cell="LSTM"), "LSTM", "lstm"),
    ),
    # builds and runs only on a host with TensorRT and an NVIDIA GPU (not checked where none is: Det is
    # unsupported in onnx-tensorrt's operator table)
    Stack("tensorrt", _gpu(models.cpu_sku("tensorrt", "fp32", {})), ("tensorrt",), DET),
    # the runtime is the SDK; a build also needs the converter environment (onnx2tf, TensorFlow), which
    # environment_problems("build") names like a missing SDK. Det becomes TensorFlow's MatrixDeterminant,
    # which has no LiteRT built-in kernel (only a Flex op)
    Stack("litert", models.cpu_sku("litert", "fp32", {"delegate": "xnnpack"}), ("ai_edge_litert",), DET),
]


def test_every_backend_is_in_the_suite():
    assert sorted(s.backend for s in STACKS) == list(known_backends())


def test_a_backend_registered_at_run_time_is_known_inside_the_block_only():
    ort = "pipeline.backends.onnxruntime:OnnxRuntimeBackend"
    with registered_backend("ort_again", ort):
        assert "ort_again" in known_backends() and backend_class("ort_again") is backend_class("onnxruntime")
        register_backend("ort_again", ort)  # the same target again: nothing changes
        with pytest.raises(ValueError, match="'ort_again' is already registered"):
            register_backend("ort_again", "pipeline.backends.tvm:TvmBackend")
    assert "ort_again" not in known_backends()
    with registered_backend("tvm", None):
        assert "tvm" not in known_backends()
        with pytest.raises(ConfigError, match="unknown backend 'tvm'"):
            backend_class("tvm")
    assert "tvm" in known_backends()
    for bad in ("pipeline.backends.tvm", "pipeline.backends.tvm:", ":TvmBackend"):
        with pytest.raises(ValueError, match="is not 'package.module:Class'"):
            register_backend("x", bad)
    register_backend("x", ort)
    assert unregister_backend("x") == ort and "x" not in known_backends()
    with pytest.raises(ConfigError, match="unknown backend 'x'"):
        unregister_backend("x")


# --- the project: one model prepared, one SKU per backend, the unsupported-op models ---------------


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("contract")
    specs = {MODEL: models.multi_io_spec(f"models/{MODEL}")}
    models.multi_io_model(root / specs[MODEL]["dir"] / "model.onnx")
    for s in STACKS:
        if s.unsupported is not None:
            name = f"unsupported_{s.backend}"
            specs[name] = s.unsupported.spec(f"models/{name}")
            s.unsupported.build(root / specs[name]["dir"] / "model.onnx")
    reg = load_registry(models.write_project(root, specs, {s.backend: s.sku for s in STACKS}))
    prepare(reg, MODEL)
    make_data(reg, MODEL)
    return SimpleNamespace(registry=reg, out=Layout(reg.root))


@pytest.fixture(scope="module", params=STACKS, ids=str)
def stack(request) -> Stack:
    return request.param


def _can(project, stack: Stack, purpose: str) -> None:
    problems = host_problems(project.registry, stack.backend, purpose)
    if problems:
        pytest.skip(f"this host cannot {purpose} {stack.backend} engines: {'; '.join(problems)}")


@pytest.fixture(scope="module")
def engine(project, stack) -> Path:
    """The backend's engine of MODEL, built once per module (skips where this host cannot build it)."""
    _can(project, stack, "build")
    path = project.out.engine_dir(MODEL, stack.backend)
    build_engine(project.registry.pair(MODEL, stack.backend), path)
    return path


@pytest.fixture
def runnable(project, stack, engine) -> Path:
    """The engine, where this host can also run it."""
    _can(project, stack, "run")
    return engine


@pytest.fixture
def engine_copy(runnable, tmp_path) -> Path:
    """This test's own copy of the engine, to damage."""
    return Path(shutil.copytree(runnable, tmp_path / "engine"))


def _load(project, stack: Stack, path: Path):
    return get_backend(stack.backend).load(path, project.registry.sku(stack.backend))


def _feeds(runner, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs in the model's declared ranges (the ids index an embedding of 11 rows)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for sig in runner.inputs:
        shape = [d if isinstance(d, int) else 1 for d in sig.shape]
        if np.dtype(sig.dtype).kind == "f":
            feeds[sig.name] = rng.uniform(0.5, 1.5, shape).astype(sig.dtype)
        else:
            feeds[sig.name] = rng.integers(0, 11, shape).astype(sig.dtype)
    return feeds


def _edit_meta(path: Path, **changes) -> None:
    meta = json.loads((path / ENGINE_META).read_text())
    meta.update(changes)
    (path / ENGINE_META).write_text(json.dumps(meta))


# --- build, load, infer -----------------------------------------------------------------------------


def test_the_engine_computes_what_the_reference_runtime_does(project, stack, runnable):
    tol = project.registry.tolerance(MODEL, stack.backend).for_kind("regression")  # fp32: atol 1e-4, rtol 1e-3
    reference = reference_runner(project.out.prepared_model(MODEL))
    with _load(project, stack, runnable) as runner:
        assert [(s.name, s.dtype, s.shape) for s in runner.inputs] == [
            ("x", "float32", [1, 6]),
            ("ids", "int64", [1, 3]),
            ("scale", "float32", []),
        ]
        assert runner.output_names == ["y", "cls"] and runner.engine_sha256
        for seed in range(3):
            feeds = _feeds(runner, seed)
            got, want = runner.infer(feeds), reference.infer(feeds)
            assert list(got) == ["y", "cls"]
            assert got["y"].dtype == np.float32 and got["y"].shape == want["y"].shape
            np.testing.assert_allclose(got["y"], want["y"], atol=tol.atol, rtol=tol.rtol)
            assert got["cls"].dtype == np.int64 and np.array_equal(got["cls"], want["cls"])


@pytest.mark.parametrize(
    "wrong, message",
    [
        ("name", r"engine input 'x' was not given \(given: \['ids', 'scale', 'x_renamed'\]\)"),
        ("dtype", r"engine input 'ids' must be int64, got int32"),
        ("shape", r"engine input 'x' must have shape \[1, 6\], got \[2, 6\]"),
        ("rank", r"engine input 'scale' must have shape \[\], got \[1\]"),
    ],
    ids=["name", "dtype", "shape", "rank"],
)
def test_the_runner_refuses_a_wrong_input(project, stack, runnable, wrong, message):
    with _load(project, stack, runnable) as runner:
        feeds = _feeds(runner)
        if wrong == "name":
            feeds["x_renamed"] = feeds.pop("x")
        elif wrong == "dtype":
            feeds["ids"] = feeds["ids"].astype(np.int32)
        elif wrong == "shape":
            feeds["x"] = np.concatenate([feeds["x"], feeds["x"]])
        else:
            feeds["scale"] = feeds["scale"].reshape(1)
        with pytest.raises(InputError, match=message):
            runner.infer(feeds)
        assert runner.infer(_feeds(runner))["y"].shape == (1, 4)  # still usable


def _at_offset(feeds: dict[str, np.ndarray], offset: int) -> dict[str, np.ndarray]:
    """Copies of ``feeds`` whose data starts ``offset`` bytes past a 64-byte boundary (0: aligned as a
    runtime may import it in place; 8: not, as a slice of a batch often is)."""
    out = {}
    for name, arr in feeds.items():
        raw = np.zeros(arr.nbytes + 128, np.uint8)
        start = (-raw.ctypes.data % 64) + offset
        out[name] = raw[start : start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
        out[name][...] = arr
        assert out[name].ctypes.data % 64 == offset
    return out


@pytest.mark.parametrize("offset", [0, 8], ids=["aligned", "unaligned"])
def test_successive_calls_return_their_own_outputs_and_read_the_inputs_given(project, stack, runnable, offset):
    """A runner may keep its request, bound inputs and buffers from call to call (the bench loop's
    overhead) but never at a caller's cost: the outputs of one call survive the next (validate keeps
    every sample's), and a feed is read as it is at each call, whether it is a new array or the same
    one written in place (the bound array of the last call)."""
    tol = project.registry.tolerance(MODEL, stack.backend).for_kind("regression")
    reference = reference_runner(project.out.prepared_model(MODEL))

    def check(got: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> None:
        want = reference.infer({k: v.copy() for k, v in feeds.items()})
        np.testing.assert_allclose(got["y"], want["y"], atol=tol.atol, rtol=tol.rtol)
        assert np.array_equal(got["cls"], want["cls"])

    with _load(project, stack, runnable) as runner:
        a, b = _at_offset(_feeds(runner, 0), offset), _at_offset(_feeds(runner, 1), offset)
        first = runner.infer(a)
        kept = {k: v.copy() for k, v in first.items()}
        second = runner.infer(b)  # new arrays
        check(first, a)
        check(second, b)
        assert not np.allclose(first["y"], second["y"]), "the two feeds should give different outputs"
        for name in first:
            assert not np.shares_memory(first[name], second[name]), f"output {name!r} reuses the last call's memory"
            assert np.array_equal(first[name], kept[name]), f"output {name!r} of a call changed at the next one"
        third = runner.infer(a)  # the first arrays again, as they were
        check(third, a)
        for name, arr in b.items():  # the arrays of the second call, written in place
            arr[...] = a[name]
        check(runner.infer(b), a)
        a["x"] *= 2.0
        a["scale"][...] = 0.25
        check(runner.infer(a), a)
        check(third, {k: v.copy() for k, v in _at_offset(_feeds(runner, 0), offset).items()})  # kept


# --- engines that must not load ---------------------------------------------------------------------


def test_a_damaged_engine_is_refused(project, stack, engine_copy):
    files = [rec["path"] for rec in json.loads((engine_copy / ENGINE_META).read_text())["files"]]
    assert files, "engine.json records no engine files"
    target = engine_copy / files[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped
    target.write_bytes(bytes(data))
    with pytest.raises(InputError) as info:
        _load(project, stack, engine_copy)
    assert f"engine file {target} is missing, truncated or altered" in info.value.message
    assert "rebuild" in info.value.hint


def test_a_damaged_engine_engine_json_vouches_for_is_refused_by_the_runtime(project, stack, engine_copy):
    """Garbage in place of the engine file, its hash re-recorded: only the runtime can tell. (A truncated
    library is not tried: TVM maps it and dies of SIGBUS before it can refuse it.)"""
    meta = json.loads((engine_copy / ENGINE_META).read_text())
    for rec in meta["files"]:
        path = engine_copy / rec["path"]
        path.write_bytes(bytes(range(256)) * 64)
        rec.update(sha256=sha256_file(path), bytes=path.stat().st_size)
    _edit_meta(engine_copy, files=meta["files"])
    with pytest.raises(InputError) as info, _load(project, stack, engine_copy) as runner:
        runner.infer(_feeds(runner))
    assert str(engine_copy) in info.value.message


def test_an_engine_of_another_version_is_refused(project, stack, engine_copy):
    backend = get_backend(stack.backend)
    assert backend.runtime_keys, "a backend names the versions an engine must be loaded with (runtime_keys)"
    meta = json.loads((engine_copy / ENGINE_META).read_text())
    key = backend.runtime_keys[0]
    _edit_meta(engine_copy, versions={**meta["versions"], key: "0.0.1"})
    if meta["portable"]:  # standard ops only: any runtime of the backend loads it, by design
        with _load(project, stack, engine_copy):
            pass
        _edit_meta(engine_copy, portable=False)
    with pytest.raises(InputError) as info:
        _load(project, stack, engine_copy)
    assert "0.0.1" in info.value.message and backend.versions()[key] in info.value.message  # built, and here
    assert "rebuild" in info.value.hint


def test_an_engine_of_another_format_is_refused(project, stack, engine_copy):
    _edit_meta(engine_copy, format="skuforge-other/1")
    with pytest.raises(InputError) as info:
        _load(project, stack, engine_copy)
    expected = backend_class(stack.backend).engine_format
    assert f"holds a 'skuforge-other/1' engine, expected {expected!r}" in info.value.message
    assert "rebuild" in info.value.hint


# --- engine.json ------------------------------------------------------------------------------------


def test_engine_metadata_round_trips(project, stack, engine, tmp_path):
    backend = get_backend(stack.backend)
    meta = backend.read_meta(engine)
    assert type(meta) is backend.Meta and issubclass(backend.Meta, EngineMeta)
    assert (meta.format, meta.backend, meta.model, meta.sku) == (
        backend.engine_format,
        stack.backend,
        MODEL,
        stack.backend,
    )
    assert meta.versions == backend.versions()
    again = Path(shutil.copytree(engine, tmp_path / "engine"))
    (again / ENGINE_META).unlink()
    files = [rec["path"] for rec in meta.files]
    records = backend.write_meta(again, files, meta, model=meta.model, sku=meta.sku, keep_precise=meta.keep_precise)
    assert [r.to_json() for r in records] == meta.files
    assert backend.read_meta(again) == meta
    assert json.loads((again / ENGINE_META).read_text()) == json.loads((engine / ENGINE_META).read_text())


def test_engine_metadata_of_another_shape_is_refused(project, stack, engine, tmp_path):
    backend = get_backend(stack.backend)
    copy = Path(shutil.copytree(engine, tmp_path / "engine"))
    _edit_meta(copy, surprise=1)
    with pytest.raises(InputError, match=rf"does not describe a {stack.backend} engine this skuforge loads: surprise"):
        backend.read_meta(copy)
    own = [n for n, f in backend.Meta.model_fields.items() if f.is_required() and n not in EngineMeta.model_fields]
    if not own:
        return
    meta = json.loads((engine / ENGINE_META).read_text())
    del meta[own[0]]
    (copy / ENGINE_META).write_text(json.dumps(meta))
    with pytest.raises(InputError, match=rf"engine this skuforge loads: {own[0]}: Field required"):
        backend.read_meta(copy)


# --- a missing SDK ----------------------------------------------------------------------------------


def _forget_probes(backend: str) -> None:
    """Clear what the backend's module remembers about this host (a cached "no device" or "installed")."""
    module = sys.modules[backend_class(backend).__module__]
    for value in vars(module).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


@pytest.fixture
def sdk_missing(stack) -> Iterator[None]:
    """The backend's SDK cannot be imported (sys.modules[name] = None makes ``import name`` fail)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in stack.sdk:
            mp.setitem(sys.modules, name, None)
        _forget_probes(stack.backend)
        yield
    _forget_probes(stack.backend)


def test_without_the_sdk_the_backend_still_imports_and_checks_skus(stack):
    """`skuforge --help` and the config checks work on a host without the SDK (a fresh interpreter)."""
    code = (
        "import sys\n"
        f"for name in {list(stack.sdk)!r}: sys.modules[name] = None\n"
        "from pipeline.backends import backend_class\n"
        "from pipeline.project.config import SkuSpec\n"
        f"cls = backend_class({stack.backend!r})\n"
        f"print(cls.check_sku(SkuSpec.model_validate({stack.sku!r})))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2]
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_missing_sdk_refuses_the_build_with_the_install_hint(project, stack, sdk_missing, tmp_path):
    backend = get_backend(stack.backend)
    assert any("not installed" in p for p in backend.environment_problems(project.registry.sku(stack.backend), "build"))
    with pytest.raises(EnvironmentProblem) as info:
        build_engine(project.registry.pair(MODEL, stack.backend), tmp_path / "engine")
    err = info.value
    assert err.exit_code == 3 and "not installed" in err.message and err.hint == backend.install_hint
    assert not (tmp_path / "engine").exists()


def test_a_missing_sdk_refuses_loading_with_the_install_hint(project, stack, runnable, sdk_missing):
    with pytest.raises(EnvironmentProblem) as info:
        _load(project, stack, runnable)
    err = info.value
    assert err.exit_code == 3 and "not installed" in err.message
    assert "pip install" in err.hint and backend_class(stack.backend).capabilities.runtime_package in err.hint


# --- an op the backend lacks ------------------------------------------------------------------------


def test_an_unsupported_op_names_the_op_the_node_and_the_backend(project, stack, tmp_path):
    if stack.unsupported is None:
        pytest.skip(stack.no_unsupported)
    _can(project, stack, "build")
    reg, model, case = project.registry, f"unsupported_{stack.backend}", stack.unsupported
    ctx = BuildContext(
        model=model,
        sku=stack.backend,
        spec=reg.model(model),
        sku_spec=reg.sku(stack.backend),
        prepared=reg.model_file(model),
        pins=reg.pins(model, stack.backend),
        profiles={},
        engine_dir=tmp_path / "engine",
        calibration_table=None,
        probe_inputs={},
        cache_dir=tmp_path / "cache",
    )
    ctx.engine_dir.mkdir()
    with pytest.raises(UnsupportedOp) as info:
        get_backend(stack.backend).build(ctx)
    err = info.value
    assert (err.backend, err.op_type, err.node, err.exit_code) == (stack.backend, case.op, case.node, 3)
    assert f"{stack.backend} cannot compile op {case.op!r} (node {case.node!r})" in err.message


# --- capabilities against the SKU checks (no SDK needed) --------------------------------------------


def _sku(stack: Stack, **changes) -> dict:
    sku = json.loads(json.dumps(stack.sku))
    for key, value in changes.items():
        if key == "device":
            sku["target"]["device"] = value
        else:
            sku[key] = value
    return sku


def _registry(stack: Stack, sku: dict, **model) -> object:
    spec = {**models.multi_io_spec(), **model}
    return parse_registry({"defaults": {}, "examples": {}, "models": {MODEL: spec}, "skus": {"s": sku}})


def test_the_sku_checks_refuse_exactly_what_capabilities_rule_out(stack):
    cls = backend_class(stack.backend)
    caps = cls.capabilities
    assert cls.check_sku(SkuSpec.model_validate(stack.sku)) == []
    for precision in PRECISIONS:
        problems = cls.check_sku(SkuSpec.model_validate(_sku(stack, precision=precision)))
        refused = f"precision: {precision} is not supported by the {stack.backend} backend; supported: "
        refused += ", ".join(caps.precisions)
        assert (refused in problems) == (precision not in caps.precisions), (precision, problems)
        if precision not in caps.precisions:  # and the registry says so, naming the SKU
            with pytest.raises(ConfigError, match=f"skus.s.{refused}"):
                _registry(stack, _sku(stack, precision=precision))
    for device in DEVICES:
        problems = cls.check_sku(SkuSpec.model_validate(_sku(stack, device=device)))
        refused = f"target.device: {device} is not a device the {stack.backend} backend builds for"
        assert any(p.startswith(refused) for p in problems) == (device not in caps.devices), (device, problems)
    problems = cls.check_sku(SkuSpec.model_validate(_sku(stack, cache={"require": True})))
    no_cache = f"cache.require: the {stack.backend} backend keeps no cache; remove it"
    assert (no_cache in problems) == (caps.cache is None), problems


def test_the_registry_refuses_per_node_precision_unless_declared(stack):
    caps = backend_class(stack.backend).capabilities
    lower = next((p for p in ("int8", "fp16") if p in caps.precisions), "fp16")
    sku = _sku(stack, precision=lower)
    keep = {"higher_precision": {"s": ["matmul"]}}
    refusal = (
        f"models.{MODEL}.higher_precision.s: the {stack.backend} backend cannot keep single nodes in higher precision"
    )
    if caps.per_node_precision:
        assert _registry(stack, sku, **keep).higher_precision(MODEL, "s") == ["matmul"]
    else:
        with pytest.raises(ConfigError) as info:
            _registry(stack, sku, **keep)
        assert refusal in info.value.message
