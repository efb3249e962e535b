"""Apache TVM backend: default-schedule builds of two models (validated, benchmarked), the fused
primitive functions traced to their ONNX nodes, MetaSchedule tuning into the SKU's cache folder
and its replay, and the cache policy on a real tuning database: a stale database (another TVM
version: never trusted, left as it is, rebuilt by a refresh), a corrupted one (clear error, never
trusted) and fail-on-miss."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from tvm_helpers import tvm_or_skip

tvm_or_skip()

import models  # noqa: E402
from cli_helpers import assert_user_error, skuforge  # noqa: E402

from pipeline.backends import get_backend  # noqa: E402
from pipeline.backends.caches import INDEX, files_digest  # noqa: E402
from pipeline.backends.contract import ENGINE_META  # noqa: E402
from pipeline.backends.tvm import (  # noqa: E402
    DEFAULTS,
    RECORDS,
    WORKLOADS,
    TvmBackend,
    import_onnx,
    op_type_of,
    target_of,
)
from pipeline.cli import main as cli_main  # noqa: E402
from pipeline.core.errors import ConfigError, GateFailed, UnsupportedOp  # noqa: E402
from pipeline.core.paths import Layout  # noqa: E402
from pipeline.host.probe import cpu_features, host_arch  # noqa: E402
from pipeline.model.graph import pin_axes  # noqa: E402
from pipeline.ops.caches import refresh, status  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402
from pipeline.stages.bench import bench  # noqa: E402
from pipeline.stages.build import build  # noqa: E402
from pipeline.stages.data import make_data  # noqa: E402
from pipeline.stages.prepare import prepare  # noqa: E402
from pipeline.stages.reference import reference  # noqa: E402
from pipeline.stages.validate import validate  # noqa: E402

if host_arch() != "x86_64":
    pytest.skip("the TVM test SKUs target x86-64 hosts", allow_module_level=True)
if "avx2" not in cpu_features():
    pytest.skip("the TVM test SKUs compile for x86-64-v3: this CPU has no AVX2 to run them", allow_module_level=True)

# One xdist worker runs the module (ONE_WORKER in tests/conftest.py): the project below is built once and
# every tuning runs in that one process (the cache refresh too, in-process).


def tvm_sku(**options) -> dict:
    return {
        "backend": "tvm",
        "precision": "fp32",
        "target": {"arch": "x86_64", "device": "cpu", "os": "linux"},
        "runner_labels": ["self-hosted", "linux", "x64"],
        "shapes": {"batch": 1},
        "options": {"target_cpu": "x86-64-v3", "num_cores": 2, **options},
        "placement": {"allowed": ["cpu"]},
        "bench": dict(models.FAST_BENCH),
    }


# two trials: enough for MetaSchedule to write real records (the tasks left without one keep their
# recorded default), little enough for the suite: each trial is a candidate built in a new process
TUNED = {"trials": 2, "num_cores": 1}
SKUS = {"plain": tvm_sku(), "tuned": tvm_sku(**TUNED), "required": {**tvm_sku(**TUNED), "cache": {"require": True}}}
MODELS = ("conv", "multi")


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("tvm")
    models.conv_bn_model(root / "models/conv/model.onnx")
    models.multi_io_model(root / "models/multi/model.onnx")
    reg = load_registry(
        models.write_project(root, {"conv": models.conv_bn_spec(), "multi": models.multi_io_spec()}, SKUS)
    )
    r = SimpleNamespace(registry=reg, out=Layout(reg.root), build={}, validate={}, bench={})
    for m in MODELS:
        prepare(reg, m)
        make_data(reg, m)
        reference(reg, m)
        r.build[m, "plain"] = build(reg.pair(m, "plain"))
        r.validate[m, "plain"] = validate(reg.pair(m, "plain"))
        r.bench[m, "plain"] = bench(reg.pair(m, "plain"))
    r.first, r.database = tuned_once(tmp_path_factory, reg, r.out)
    r.replay = build(reg.pair("conv", "tuned"))  # the database the first build wrote, replayed
    return r


def tuned_once(tmp_path_factory, reg, out) -> tuple[dict, Path]:
    """The first tuned build (from scratch) and the database it wrote, made once per test session:
    pytest-xdist may run this module's tests on several workers, each with its own project, and
    tuning in all of them at once on a small runner multiplies minutes. The first worker tunes;
    the others copy its database into their project (and its build's cache record)."""
    base = tmp_path_factory.getbasetemp()  # under xdist, a worker's own folder in the session's
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tvm-tuned-conv"
    with open(shared.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "first.json").is_file():
            with pytest.MonkeyPatch.context() as mp:  # tuning asked for: without it the build takes default schedules
                mp.setenv("SKUFORGE_TUNE", "1")
                first = build(reg.pair("conv", "tuned")).cache.model_dump(mode="json")  # tunes: no database yet
            shutil.copytree(out.cache_dir("conv", "tuned"), shared / "database", dirs_exist_ok=True)
            (shared / "first.json").write_text(json.dumps(first))
    folder = out.cache_dir("conv", "tuned")
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(shared / "database", folder)
    return json.loads((shared / "first.json").read_text()), shared / "database"


@pytest.mark.parametrize("model", MODELS)
def test_default_schedule_engine_matches_the_reference(proj, model):
    rep, val = proj.build[model, "plain"], proj.validate[model, "plain"]
    assert val.passed, val.failures
    assert all(o.max_abs_error <= 1e-4 for o in val.outputs)
    assert [f.path for f in rep.engine_files] == ["model.so"] and rep.cache is None
    assert rep.placement == {"cpu": len(rep.layers)} and all(layer.kernel == "default" for layer in rep.layers)
    assert rep.versions["apache-tvm"] and not rep.hardware_specific
    assert rep.options["target"] == {"kind": "llvm", "mcpu": "x86-64-v3", "mtriple": "x86_64-linux-gnu", "num-cores": 2}
    b = proj.bench[model, "plain"]
    assert 0 < b.engine_only.p50_ms <= b.engine_only.p99_ms
    meta = json.loads((proj.out.engine_dir(model, "plain") / ENGINE_META).read_text())
    assert meta["format"] == "skuforge-tvm-relax/1" and meta["entry"] == "main" and meta["cache"] is None
    assert [i["name"] for i in meta["inputs"]] == {"conv": ["x"], "multi": ["x", "ids", "scale"]}[model]
    assert not (proj.out.cache_dir(model, "plain") / WORKLOADS).exists()  # trials 0: no database
    # but the folder DVC declares as the build's output exists (an empty index), or dvc fails the stage
    index = json.loads((proj.out.cache_dir(model, "plain") / INDEX).read_text())
    assert index == {"backend": "tvm", "files": []}


def test_fused_functions_name_their_onnx_nodes(proj):
    layers = {layer.name: layer for layer in proj.build["conv", "plain"].layers}
    conv = [layer for layer in layers.values() if layer.op_type == "conv2d"]
    assert len(conv) == 1 and conv[0].name.startswith("fused_") and {"conv", "relu"} <= set(conv[0].fused_from)
    assert any(layer.fused_from == ["softmax"] for layer in layers.values())
    matmul = [layer for layer in proj.build["multi", "plain"].layers if layer.op_type == "matmul"]
    assert matmul and {"matmul", "scale", "add"} <= set(matmul[0].fused_from)
    assert all(layer.precision == "fp32" for layer in conv + matmul)
    assert op_type_of("fused_conv2d1_add1_relu1") == "conv2d" and op_type_of("reshape2") == "reshape"


def test_tuning_writes_the_database_and_a_rebuild_replays_it(proj):
    first, again = proj.first, proj.replay
    assert first["state"] == "missing" and first["updated"] and first["misses"] >= 1
    folder = proj.out.cache_dir("conv", "tuned")
    index = json.loads((folder / INDEX).read_text())
    assert (
        index["backend"] == "tvm" and index["kind"] == "tuning-database" and index["trials"] >= 1 and index["tuned_at"]
    )
    assert index["key"] == TvmBackend().cache_key(proj.registry.sku("tuned"))
    # what this search cost: the next tuning's estimate reads its seconds per trial
    assert index["last_tuning"]["trials"] == index["trials"] and index["last_tuning"]["seconds"] > 0
    assert sorted(f["path"] for f in index["files"]) == sorted([WORKLOADS, RECORDS, DEFAULTS])
    assert first["sha256"] == files_digest(index["files"])
    # the replay: every task found (a record, or a recorded default), nothing tuned, nothing written
    assert (again.cache.state, again.cache.misses, again.cache.updated) == ("fresh", 0, False)
    assert again.cache.hits >= 3 and again.cache.hit_rate == 1.0 and again.options["untuned_tasks"] == 0
    assert any(layer.kernel == "tuned" for layer in again.layers)
    assert again.engine_sha256 and validate(proj.registry.pair("conv", "tuned")).passed


def _copy_cache(proj, sku: str) -> None:
    dst = proj.out.cache_dir("conv", sku)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(proj.database, dst)


def _set_index(folder, **changes) -> None:
    index = json.loads((folder / INDEX).read_text())
    index.update(changes)
    (folder / INDEX).write_text(json.dumps(index))


def test_a_database_of_another_tvm_version_is_stale_and_fails_a_required_build(proj):
    _copy_cache(proj, "required")
    folder = proj.out.cache_dir("conv", "required")
    key = json.loads((folder / INDEX).read_text())["key"]
    _set_index(folder, key={**key, "apache-tvm": "0.26.0"})
    row = next(r for r in status(proj.registry, ["required"], ["conv"]))
    assert row.state == "stale" and "apache-tvm: cache '0.26.0'" in row.reason
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(GateFailed, match="cache miss in caches/required/conv: the tuning-database .stale") as err:
        build(proj.registry.pair("conv", "required"))
    assert err.value.exit_code == 1 and "skuforge cache refresh --sku required --model conv" in err.value.hint
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing written


def test_a_stale_database_is_not_trusted_left_as_it_is_and_a_refresh_rebuilds_it(proj):
    _copy_cache(proj, "tuned")
    folder = proj.out.cache_dir("conv", "tuned")
    key = json.loads((folder / INDEX).read_text())["key"]
    _set_index(folder, key={**key, "apache-tvm": "0.26.0"})
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    rep = build(proj.registry.pair("conv", "tuned"))  # tuning not asked for: TVM's default schedules
    assert rep.cache.state == "stale" and rep.cache.hits == 0 and not rep.cache.updated
    assert rep.cache.unused() == "cache: stale — built without checked-in tuning"
    assert any("tuning-database caches/tuned/conv is stale" in w and "not used" in w for w in rep.warnings)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # the database is never removed
    refresh(proj.registry, "tuned", ["conv"], trials=1)
    assert json.loads((folder / INDEX).read_text())["key"] == key  # rewritten under this TVM's key
    assert next(r for r in status(proj.registry, ["tuned"], ["conv"])).state == "fresh"
    assert validate(proj.registry.pair("conv", "tuned")).passed


def test_a_corrupted_database_is_named_never_read_and_fails_a_required_build(proj):
    _copy_cache(proj, "required")
    folder = proj.out.cache_dir("conv", "required")
    # garbage whose sha256 the index agrees with: only reading the records can tell
    (folder / RECORDS).write_text("{not json\n")
    index = json.loads((folder / INDEX).read_text())
    from pipeline.core.io import sha256_file

    for rec in index["files"]:
        if rec["path"] == RECORDS:
            rec.update(sha256=sha256_file(folder / RECORDS), bytes=(folder / RECORDS).stat().st_size)
    (folder / INDEX).write_text(json.dumps(index))
    row = next(r for r in status(proj.registry, ["required"], ["conv"]))
    assert row.state == "corrupt" and row.reason == f"{RECORDS} line 1 is not JSON"
    with pytest.raises(GateFailed, match="corrupt"):
        build(proj.registry.pair("conv", "required"))
    proc = skuforge("cache", "status", "--sku", "required", "--fail-on", "corrupt", cwd=proj.registry.root)
    assert proc.returncode == 1 and "required/conv is corrupt" in proc.stderr
    # an edited file the index does not agree with
    _copy_cache(proj, "required")
    with (folder / WORKLOADS).open("a") as fh:
        fh.write('["x"]\n')
    row = next(r for r in status(proj.registry, ["required"], ["conv"]))
    assert row.state == "corrupt" and f"{WORKLOADS} differs from its sha256" in row.reason


def test_a_missing_database_fails_a_required_build_and_refresh_writes_it(proj, capsys):
    shutil.rmtree(proj.out.cache_dir("conv", "required"), ignore_errors=True)
    engine = proj.out.engine_dir("conv", "required")
    with pytest.raises(GateFailed, match="missing: no cache yet"):
        build(proj.registry.pair("conv", "required"))
    assert not engine.exists() and not (proj.out.cache_dir("conv", "required") / INDEX).exists()
    proc = skuforge(
        "cache", "status", "--sku", "required", "--model", "conv", "--fail-on", "not-fresh", cwd=proj.registry.root
    )
    assert proc.returncode == 1 and "missing" in proc.stdout
    capsys.readouterr()  # in this process, which has tuned already (see pytestmark)
    params = str(proj.registry.root / "params.yaml")
    code = cli_main(["--params", params, "cache", "refresh", "--sku", "required", "--model", "conv", "--trials", "1"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "refreshed caches/required/conv" in out.out
    rep = build(proj.registry.pair("conv", "required"))  # now it replays, so the required build passes
    assert rep.cache.state == "fresh" and rep.cache.misses == 0 and rep.cache.required


def test_config_refuses_what_the_backend_cannot_do(tmp_path):
    """(What TVM's capabilities leave out, INT8 say, is refused in tests/backends/test_contract.py.)"""
    root = tmp_path
    models.conv_bn_model(root / "models/conv/model.onnx")
    bad = {
        "profiled": {**tvm_sku(), "shapes": {}, "profiles": {"batch": {"min": 1, "opt": 1, "max": 4}}},
        "untuned_required": {**tvm_sku(), "cache": {"require": True}},
        "typo": tvm_sku(trails=3),
    }
    with pytest.raises(ConfigError) as err:
        load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, bad))
    text = str(err.value)
    assert "skus.profiled.profiles: the tvm backend compiles static shapes" in text
    assert "skus.untuned_required.cache.require: options.trials is 0" in text
    assert "trails" in text


def test_target_resolution_and_cache_key():
    backend = get_backend("tvm")
    spec = load_sku(tvm_sku(target_cpu="host"))
    target = target_of(backend.options(spec), "x86_64")
    assert target["mcpu"] == "x86-64" and all(f.startswith("+") for f in target.get("mattr", []))
    key = backend.cache_key(load_sku(tvm_sku()))
    assert set(key) == {"apache-tvm", "target"} and '"mcpu": "x86-64-v3"' in key["target"]
    assert backend.cache_key(load_sku(tvm_sku(num_cores=4))) != key  # the cores are part of what was tuned


def load_sku(data: dict):
    from pipeline.project.config import SkuSpec

    return SkuSpec.model_validate(data)


def test_a_required_build_on_the_cli_names_the_miss(proj):
    shutil.rmtree(proj.out.cache_dir("multi", "required"), ignore_errors=True)
    proc = skuforge("build", "--model", "multi", "--sku", "required", cwd=proj.registry.root)
    assert_user_error(proc, 1, "cache miss in caches/required/multi", "skuforge cache refresh")


def test_a_truncated_library_is_refused_before_it_is_mapped(tmp_path):
    """dlopen of a truncated library maps pages past the end of the file: the first touch is a
    SIGBUS that kills the process (measured with TVM 0.27). The ELF extents are checked first."""
    import numpy._core._multiarray_umath as compiled

    from pipeline.backends.tvm import elf_extent_problem

    whole = Path(compiled.__file__).read_bytes()
    good = tmp_path / "good.so"
    good.write_bytes(whole)
    assert elf_extent_problem(good) is None
    for keep in (len(whole) // 2, len(whole) - 4096, 100):
        cut = tmp_path / f"cut{keep}.so"
        cut.write_bytes(whole[:keep])
        problem = elf_extent_problem(cut)
        assert problem is not None and "past the file" in problem, (keep, problem)
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not a library" * 10)
    assert elf_extent_problem(junk) == "not an ELF shared library"


def test_a_model_new_to_a_tuned_sku_builds_with_default_schedules_and_says_so(proj):
    """Tuning is asked for (cache refresh, a trial budget, SKUFORGE_TUNE): a plain build of a model
    the database lacks takes TVM's default schedules in seconds instead of tuning for hours."""
    folder = proj.out.cache_dir("multi", "tuned")
    shutil.rmtree(folder, ignore_errors=True)
    rep = build(proj.registry.pair("multi", "tuned"))
    untuned = rep.options["untuned_tasks"]
    assert untuned >= 1 and rep.options["tuned_functions"] == 0
    assert all(layer.kernel == "default" for layer in rep.layers)
    assert rep.cache.state == "missing" and rep.cache.misses >= 1 and not (folder / RECORDS).exists()
    (warning,) = [w for w in rep.warnings if "tuning tasks have no schedule" in w]
    assert warning.startswith(f"{untuned} of {untuned} tuning tasks") and "caches/tuned/multi is missing" in warning
    assert "skuforge cache refresh --sku tuned --model multi" in warning
    assert "SKUFORGE_TUNE=1 skuforge build --model multi --sku tuned" in warning
    assert validate(proj.registry.pair("multi", "tuned")).passed


def _pinned(path: Path):
    import onnx

    return pin_axes(onnx.load(str(path)), {"batch": 1}, path)


def _probe(*shapes: tuple) -> dict:
    import numpy as np

    return {name: np.random.default_rng(0).normal(size=shape).astype(np.float32) for name, shape in shapes}


@pytest.fixture(scope="module")
def chain_project(tmp_path_factory):
    root = tmp_path_factory.mktemp("tvm-chain")
    models.shape_chain_model(root / "models/chain/model.onnx", opset=11)
    reg = load_registry(
        models.write_project(root, {"chain": models.conv_bn_spec("models/chain")}, {"plain": tvm_sku()})
    )
    prepare(reg, "chain")
    make_data(reg, "chain")
    reference(reg, "chain")
    return reg


def test_a_reshape_to_a_computed_shape_builds_from_the_graph_with_its_shapes_folded(chain_project):
    """Reshape(r, Concat(Gather(Shape(r), [0, 1]), [-1])) at opset 11, as Paddle exports it: TVM
    0.27's frontend refuses the new shape (a tensor, not a Relax shape); with the batch pinned the
    chain folds to a constant and the graph imports."""
    rep = build(chain_project.pair("chain", "plain"))
    record = rep.options["frontend_import"]
    assert record["refused"]["op"] == "Reshape" and record["refused"]["node"] == "reshape_seq"
    assert "new shape to be Shape" in record["refused"]["detail"]
    assert len(record["steps"]) == 1 and record["steps"][0].startswith("with its fixed shapes folded to constants")
    assert "folded 1 Gather" in record["steps"][0] and record["opset_conversion"] is None
    assert any("refused the model as exported (Reshape node 'reshape_seq'" in w for w in rep.warnings)
    assert validate(chain_project.pair("chain", "plain")).passed


def test_an_opset_10_resize_imports_after_the_opset_conversion(tmp_path):
    """Resize at opset 10 takes (X, scales); the frontend reads it with opset 18's inputs and fails.
    Converted to opset 18 (checked on the probe batch), it imports."""
    path = models.shape_chain_model(tmp_path / "m.onnx", opset=10, upsample=True)
    imported = import_onnx(_pinned(path), _probe(("x", (1, 3, 8, 8))))
    assert (imported.refused.op, imported.refused.node) == ("Resize", "upsample")
    assert imported.steps[-1] == "converted from opset 10 to 18" and imported.conversion.to_opset == 18
    assert imported.record()["opset_conversion"]["max_abs_error"] == 0.0
    assert imported.mod["main"] is not None and imported.node_of


def test_a_model_no_retry_imports_is_an_unsupported_op_naming_the_node(tmp_path):
    """A new shape read from an input is never a constant: every graph is refused, and the error
    (exit 3) names the op and node of the model as exported and lists what was tried."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"], name="reshape_to_input")],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    onnx.checker.check_model(model, full_check=True)
    probe = {"x": np.ones((1, 4, 8), np.float32), "s": np.array([4, 8], np.int64)}
    with pytest.raises(UnsupportedOp) as err:
        import_onnx(model, probe)
    e = err.value
    assert (e.exit_code, e.backend, e.op_type, e.node) == (3, "tvm", "Reshape", "reshape_to_input")
    assert "Tried the graph as exported: Reshape node 'reshape_to_input'" in e.message
    assert "the graph converted from opset 11 to 18: Reshape node 'reshape_to_input'" in e.message
    assert "another backend" in e.hint
