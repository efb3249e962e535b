"""Hostile or broken inputs as a user would feed them: datasets with NaN/Inf, strings, objects or the
wrong shape of value; models with external data, custom ops or opsets out of range.

Every case exits with a documented code, names the culprit (file, key, sample index / op, node),
shows no traceback, and the refusing stage leaves nothing behind.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import models
import numpy as np
import pytest
import yaml
from cli_helpers import assert_user_error, project, skuforge
from scipy.io import wavfile

REPO = Path(__file__).resolve().parents[2]
CONV = "models/conv"
X = (3, 8, 8)  # conv_bn_model's sample shape


def data_project(root: Path, files: dict[str, dict[str, np.ndarray] | np.ndarray], **datasets) -> Path:
    """The conv model with ``datasets`` (split -> source) and the dataset ``files`` in its dir."""
    spec = {**models.conv_bn_spec(), "datasets": datasets}
    params = project(root, spec)
    for name, arrays in files.items():
        target = root / CONV / name
        np.save(target, arrays) if isinstance(arrays, np.ndarray) else np.savez(target, **arrays)
    return params


def finite(n: int = 6) -> np.ndarray:
    return np.random.default_rng(0).uniform(size=(n, *X)).astype(np.float32)


def with_bad(value: float, at: int, n: int = 6) -> np.ndarray:
    x = finite(n)
    x[at, 1, 2, 3] = value
    return x


def refused_data(root: Path, code: int, *words: str) -> None:
    proc = skuforge("data", "--model", "m", cwd=root)
    assert_user_error(proc, code, *words)
    written = [p for p in (root / "build" / "m").rglob("*") if p.is_file()] if (root / "build" / "m").exists() else []
    assert written == [], written


# --- NaN / Inf ----------------------------------------------------------------------------------


def test_nan_in_golden_npz(tmp_path):
    data_project(tmp_path, {"golden.npz": {"x": with_bad(np.nan, 4)}}, golden={"path": "golden.npz"})
    refused_data(tmp_path, 2, "golden", "golden.npz", "'x'", "sample 4", "NaN", "allow_non_finite")


def test_inf_in_calibration_npz(tmp_path):
    data_project(tmp_path, {"cal.npz": {"x": with_bad(-np.inf, 2)}}, calibration={"path": "cal.npz"})
    proc = skuforge("data", "--model", "m", cwd=tmp_path)
    refused_data(tmp_path, 2, "calibration", "cal.npz", "'x'", "sample 2", "Inf")
    assert "allow_non_finite" not in proc.stderr  # calibration has no opt-in to offer


def test_nan_in_evaluation(tmp_path):
    data_project(
        tmp_path,
        {"eval.npz": {"x": with_bad(np.nan, 0), "labels": np.zeros(6, np.int64)}},
        evaluation={"path": "eval.npz"},
    )
    refused_data(tmp_path, 2, "evaluation", "eval.npz", "'x'", "sample 0")


def test_inf_after_preprocessing(tmp_path):
    """Finite raw values the affine transform overflows: caught on what the model would get."""
    spec = {**models.conv_bn_spec(), "datasets": {"golden": {"path": "g.npz"}}, "preprocess": {"x": {"scale": 1e38}}}
    project(tmp_path, spec)
    np.savez(tmp_path / CONV / "g.npz", x=with_bad(100.0, 3))
    refused_data(tmp_path, 2, "golden", "g.npz after preprocessing", "sample 3")


def test_inf_in_a_generated_set(tmp_path):
    """A range beyond float32 overflows when the generated set is cast to the input dtype."""
    spec = models.conv_bn_spec()
    spec["inputs"][0]["range"] = [-1e39, 1e39]
    project(tmp_path, spec)
    proc = skuforge("data", "--model", "m", cwd=tmp_path)
    refused_data(tmp_path, 2, "generated (seed 0", "'x'", "sample 0")
    assert "RuntimeWarning" not in proc.stderr


def test_non_finite_golden_allowed_with_the_opt_in(tmp_path):
    data_project(
        tmp_path, {"golden.npz": {"x": with_bad(np.nan, 4)}}, golden={"path": "golden.npz", "allow_non_finite": True}
    )
    proc = skuforge("data", "--model", "m", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    golden = np.load(tmp_path / "build/m/data/golden.npz")["x"]
    assert np.isnan(golden[4]).any() and np.isfinite(golden[:4]).all()


@pytest.mark.parametrize("split", ["calibration", "evaluation"])
def test_opt_in_refused_on_calibration_and_evaluation(tmp_path, split):
    data_project(
        tmp_path,
        {"d.npz": {"x": finite(), "labels": np.zeros(6, np.int64)}},
        **{split: {"path": "d.npz", "allow_non_finite": True}},
    )
    proc = skuforge("config", "validate", cwd=tmp_path)
    assert_user_error(proc, 2, "models.m.datasets", f"{split}.allow_non_finite", "golden and hard_tail")


# --- types and shapes ---------------------------------------------------------------------------


def test_string_input_array(tmp_path):
    data_project(tmp_path, {"golden.npz": {"x": np.full((2, *X), "cat")}}, golden={"path": "golden.npz"})
    refused_data(tmp_path, 2, "golden.npz", "'x'", "string", "float32")


def test_bytes_input_array(tmp_path):
    data_project(tmp_path, {"golden.npz": {"x": np.full((2, *X), b"\x00")}}, golden={"path": "golden.npz"})
    refused_data(tmp_path, 2, "golden.npz", "'x'", "bytes", "float32")


def test_string_labels(tmp_path):
    labels = np.array(["cat", "dog", "cat", "dog", "cat", "dog"])
    data_project(tmp_path, {"eval.npz": {"x": finite(), "labels": labels}}, evaluation={"path": "eval.npz"})
    refused_data(tmp_path, 2, "eval.npz", "'labels'", "string", "integer class indices")


def test_float_labels(tmp_path):
    data_project(
        tmp_path, {"eval.npz": {"x": finite(), "labels": np.linspace(0, 1, 6)}}, evaluation={"path": "eval.npz"}
    )
    refused_data(tmp_path, 2, "eval.npz", "'labels'", "float64", "integer class indices")


def test_zero_dimensional_npy(tmp_path):
    data_project(tmp_path, {"golden.npy": np.array(1.5, np.float32)}, golden={"path": "golden.npy"})
    refused_data(tmp_path, 2, "golden.npy", "'x'", "0-d array", "stacked on a first axis")


def test_object_array_is_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    data_project(
        tmp_path, {"golden.npz": {"x": np.array([_Boom(marker), 1], dtype=object)}}, golden={"path": "golden.npz"}
    )
    refused_data(tmp_path, 2, "golden.npz", "'x'", "object (pickled) array")
    assert not marker.exists()


class _Boom:
    """Unpickling this would create ``marker``: proves allow_pickle stays False."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_every_np_load_in_the_library_refuses_pickles():
    """Read the syntax trees: each np.load / numpy.load call passes allow_pickle=False."""
    import ast

    calls = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("np", "numpy")
            ):
                off = any(
                    k.arg == "allow_pickle" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in node.keywords
                )
                calls.append((f"{path.relative_to(REPO)}:{node.lineno}", off))
    assert calls and [where for where, off in calls if not off] == []


def test_complex_input(tmp_path):
    data_project(tmp_path, {"golden.npz": {"x": finite().astype(np.complex64)}}, golden={"path": "golden.npz"})
    refused_data(tmp_path, 2, "golden.npz", "'x'", "complex", "castable to float32")


def test_a_wav_cut_short_is_refused_naming_it(tmp_path):
    """scipy meets a WAV cut inside its fmt chunk with struct.error: that was an internal error (exit 70)."""
    steps = {"decode": "audio", "library": "scipy", "length": 4}
    spec = {**models.vector_spec("models/a"), "preprocess": {"x": steps}, "datasets": {"golden": {"files": "clips"}}}
    project(tmp_path, spec, builder=models.relu_model)
    buffer = io.BytesIO()
    wavfile.write(buffer, 16000, np.zeros(4, np.int16))
    (tmp_path / "models/a/clips").mkdir()
    (tmp_path / "models/a/clips/cut.wav").write_bytes(buffer.getvalue()[:30])
    refused_data(tmp_path, 2, "dataset golden", "clips: file 'cut.wav' is not a readable WAV file", "cut short")


# --- sizes: zip bombs, lying headers, shapes beyond the limits ----------------------------------


def test_zip_bomb_dataset_is_refused_unread(tmp_path, zip_bomb):
    data_project(tmp_path, {}, golden={"path": "bomb.npz"})
    shutil.copyfile(zip_bomb, tmp_path / CONV / "bomb.npz")
    refused_data(tmp_path, 2, "dataset golden", "bomb.npz member 'x.npy'", "1.00 GiB", "zip bomb", "numpy.savez")


def test_npy_header_claiming_a_trillion_elements_is_refused_unread(tmp_path):
    from numpy.lib import format as npy

    data_project(tmp_path, {}, golden={"path": "huge.npy"})
    with open(tmp_path / CONV / "huge.npy", "wb") as fh:
        npy.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": (10**12 // 192, 3, 8, 8)})
        fh.write(bytes(1024))
    refused_data(
        tmp_path,
        2,
        "dataset golden",
        "huge.npy declares a float32 array of shape (5208333333, 3, 8, 8)",
        "above the limit of 4.00 GiB per dataset",
    )


def test_legitimate_compressed_dataset_passes(tmp_path):
    data_project(tmp_path, {}, golden={"path": "golden.npz"})
    np.savez_compressed(tmp_path / CONV / "golden.npz", x=finite())
    proc = skuforge("data", "--model", "m", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "key, value, words",
    [
        (
            "skus",
            {"cpu": {"shapes": {"batch": 10**9}}},
            [
                "skus.cpu.shapes.batch: 1000000000",
                "192000000000 elements",
                "2147483647 elements",
                "lower it to at most 5592405",
            ],
        ),
        (
            "datasets",
            {"golden": {"generate": {"count": 10**8}}},
            ["models.m.datasets.golden.generate.count: 100000000", "71.53 GiB", "lower it to at most 5592405"],
        ),
    ],
)
def test_config_validate_refuses_sizes_beyond_the_limits(tmp_path, key, value, words):
    spec, skus = models.conv_bn_spec(), {"cpu": models.ort_sku("fp32")}
    if key == "skus":
        skus["cpu"].update(value["cpu"])
    else:
        spec["datasets"] = value
    project(tmp_path, spec, skus=skus)
    proc = skuforge("config", "validate", cwd=tmp_path)
    assert_user_error(proc, 2, *words)


# --- external data ------------------------------------------------------------------------------


def external_project(root: Path, location: str = "weights.bin") -> Path:
    return project(root, models.vector_spec("models/ext"), builder=lambda p: models.external_data_model(p, location))


def test_external_data_is_part_of_the_source_hash(tmp_path):
    external_project(tmp_path)
    first = skuforge("prepare", "--model", "m", "--json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    weights = tmp_path / "models/ext/weights.bin"
    data = bytearray(weights.read_bytes())
    data[:4] = np.float32(3.0).tobytes()  # W[0, 0]
    weights.write_bytes(bytes(data))
    second = skuforge("prepare", "--model", "m", "--json", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    a, b = (json.loads(p.stdout) for p in (first, second))
    assert a["source_sha256"] != b["source_sha256"]
    assert a["prepared_sha256"] != b["prepared_sha256"]  # the weights were read, not just hashed


def test_external_data_file_missing(tmp_path):
    external_project(tmp_path)
    (tmp_path / "models/ext/weights.bin").unlink()
    proc = skuforge("prepare", "--model", "m", cwd=tmp_path)
    assert_user_error(proc, 2, "weights.bin", "does not exist", "tensor 'W'")
    assert not (tmp_path / "build").exists()


def test_external_data_location_escaping_the_model_dir(tmp_path):
    external_project(tmp_path)
    path = tmp_path / "models/ext/model.onnx"
    models.set_external_location(path, "../../../etc/passwd")
    proc = skuforge("prepare", "--model", "m", cwd=tmp_path)
    assert_user_error(proc, 2, "'../../../etc/passwd'", "outside the model's folder", "tensor 'W'")
    assert not (tmp_path / "build").exists()


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "DVC_ROOT")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["DVC_NO_ANALYTICS"] = "1"
    exe = str(Path(sys.executable).with_name(args[0])) if args[0] == "dvc" else args[0]
    proc = subprocess.run([exe, *args[1:]], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_changed_external_data_makes_dvc_rerun_prepare(tmp_path):
    _dvc(tmp_path, "git", "init", "-q")
    shutil.copyfile(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    _dvc(tmp_path, "dvc", "init", "-q")
    external_project(tmp_path)
    _dvc(tmp_path, "dvc", "repro", "reference@m")
    assert "up to date" in _dvc(tmp_path, "dvc", "status", "prepare@m", "reference@m").stdout
    weights = tmp_path / "models/ext/weights.bin"
    weights.write_bytes(weights.read_bytes()[::-1])
    status = yaml.safe_load(_dvc(tmp_path, "dvc", "status", "--json", "prepare@m", "reference@m").stdout)
    for stage in ("prepare@m", "reference@m"):
        assert {"changed deps": {"models/ext": "modified"}} in status.get(stage, []), status


# --- ops and opsets -----------------------------------------------------------------------------


def test_custom_op_domain(tmp_path):
    project(
        tmp_path,
        models.vector_spec("models/custom"),
        builder=lambda p: models.relu_model(p, custom_domain="com.example"),
    )
    proc = skuforge("prepare", "--model", "m", cwd=tmp_path)
    assert_user_error(proc, 2, "'MyOp'", "'com.example'", "node 'my_op'", "custom op library")
    assert "skuforge prepare" not in proc.stderr


def test_opset_too_old_hint_works_when_followed(tmp_path):
    import onnx

    newest = onnx.defs.onnx_opset_version()
    project(tmp_path, models.vector_spec("models/old"), builder=lambda p: models.relu_model(p, opset=3))
    proc = skuforge("prepare", "--model", "m", cwd=tmp_path)
    assert_user_error(
        proc, 2, "opset 3", f"7 to {newest}", "onnx.version_converter.convert_version", "re-export at opset 17"
    )
    assert "skuforge prepare" not in proc.stderr
    path = tmp_path / "models/old/model.onnx"
    onnx.save(onnx.version_converter.convert_version(onnx.load(str(path)), 17), str(path))  # what the hint says
    again = skuforge("prepare", "--model", "m", cwd=tmp_path)
    assert again.returncode == 0, again.stderr


def test_opset_too_new(tmp_path):
    import onnx

    newest = onnx.defs.onnx_opset_version()
    project(tmp_path, models.vector_spec("models/new"), builder=lambda p: models.relu_model(p, opset=newest + 2))
    proc = skuforge("prepare", "--model", "m", cwd=tmp_path)
    assert_user_error(proc, 2, f"opset {newest + 2}", f"7 to {newest}", f"re-export at opset {newest}")
    assert "skuforge prepare" not in proc.stderr


def test_no_hint_sends_the_user_back_to_prepare():
    """A hint naming `skuforge prepare` from a failure of prepare (or after it passed) goes in a circle."""
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "pipeline").rglob("*.py")
        if "`skuforge prepare`" in p.read_text() or "run skuforge prepare" in p.read_text()
    ]
    assert offenders == []


# --- IREE ---------------------------------------------------------------------------------------

# iree-compile's stderr, verbatim, with its output on a full device (-o /dev/full), and with a
# statistics dump there
ENOSPC_OUTPUT = (
    "error opening input file: No space left on device\n"
    "LLVM ERROR: IO failure on output stream: No space left on device\n"
)
ENOSPC_DUMP = "LLVM ERROR: IO failure on output stream: No space left on device\n"


@pytest.mark.parametrize("stderr", [ENOSPC_OUTPUT, ENOSPC_DUMP])
def test_iree_disk_full_is_a_storage_problem(tmp_path, stderr):
    from pipeline.backends.iree import compile_error
    from pipeline.core.errors import EnvironmentProblem, UnsupportedOp

    engine = tmp_path / "build/m/sku/engine"
    cmd = ["iree-compile", "input.mlir", "--iree-hal-target-device=local", "-o", str(engine / "model.vmfb")]
    err = compile_error(1, stderr, {"relu": "Relu"}, cmd, tmp_path / "scratch")
    assert type(err) is EnvironmentProblem and err.exit_code == 3
    assert str(engine) in err.message and str(tmp_path / "scratch") in err.message
    assert "No space left on device" in err.message
    assert "extra_flags" not in str(err) and "free space" in err.hint
    # LLVM can also abort with a stack dump on it: still disk space, not an op the compiler cannot handle
    crashed = compile_error(-6, stderr + "Stack dump:\n0.\tProgram arguments: iree-compile", {}, cmd, None)
    assert not isinstance(crashed, UnsupportedOp) and "disk space" in crashed.message


@pytest.mark.skipif(
    shutil.which("iree-compile", path=str(Path(sys.executable).parent)) is None,
    reason="iree-base-compiler is not installed",
)
def test_iree_real_compiler_disk_full_text(tmp_path):
    """The real compiler writing to a full device (/dev/full): its stderr classifies as a storage problem."""
    from pipeline.backends.iree import compile_error
    from pipeline.core.errors import EnvironmentProblem

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this host")
    (tmp_path / "input.mlir").write_text(
        "func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n"
        "  %0 = arith.addf %a, %a : tensor<4xf32>\n  return %0 : tensor<4xf32>\n}\n"
    )
    cmd = [
        str(Path(sys.executable).with_name("iree-compile")),
        "input.mlir",
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=generic",
        "-o",
        "/dev/full",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    err = compile_error(proc.returncode, proc.stderr, {}, cmd, tmp_path)
    assert type(err) is EnvironmentProblem and "disk space" in err.message, proc.stderr
