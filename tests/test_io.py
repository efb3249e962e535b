"""Atomic writes and content hashes."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from pipeline.core import io as pio
from pipeline.core.io import (
    atomic_dir,
    atomic_savez,
    atomic_write_bytes,
    atomic_write_json,
    read_json,
    sha256_arrays,
    sha256_bytes,
    sha256_file,
    to_json,
)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


class Boom(Exception):
    pass


# --- files --------------------------------------------------------------------------------------


def test_atomic_write_bytes_writes_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "sub" / "engine.bin"
    assert atomic_write_bytes(path, b"abc") == path
    assert path.read_bytes() == b"abc"
    assert os.listdir(path.parent) == ["engine.bin"]
    atomic_write_bytes(path, b"replaced")
    assert path.read_bytes() == b"replaced" and os.listdir(path.parent) == ["engine.bin"]


def test_atomic_write_bytes_has_normal_permissions(tmp_path):
    path = atomic_write_bytes(tmp_path / "f.json", b"{}")
    assert mode(path) == 0o666 & ~current_umask()
    assert mode(path) != 0o600  # not mkstemp's private mode
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    assert mode(path) == mode(plain)


def test_failed_rename_keeps_the_old_content_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    path.write_bytes(b"old")

    def fail(src, dst):
        raise Boom("disk full")

    monkeypatch.setattr(pio.os, "replace", fail)
    with pytest.raises(Boom):
        atomic_write_bytes(path, b"new content")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_failed_write_keeps_the_old_content_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "cache.bin"
    path.write_bytes(b"old")

    def fail(fd):
        raise Boom("I/O error")

    monkeypatch.setattr(pio.os, "fsync", fail)
    with pytest.raises(Boom):
        atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["cache.bin"]


def test_interrupted_write_cleans_up(tmp_path, monkeypatch):
    """KeyboardInterrupt is not an Exception; the temp file still goes."""

    def interrupt(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(pio.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(tmp_path / "x", b"data")
    assert os.listdir(tmp_path) == []


def test_atomic_write_json_is_canonical(tmp_path):
    path = atomic_write_json(tmp_path / "r.json", {"b": 1, "a": {"d": [1, 2], "c": "é"}})
    text = path.read_text(encoding="utf-8")
    assert text == '{\n  "a": {\n    "c": "é",\n    "d": [\n      1,\n      2\n    ]\n  },\n  "b": 1\n}\n'
    assert read_json(path) == {"a": {"c": "é", "d": [1, 2]}, "b": 1}
    assert to_json({"a": 1, "b": 2}) == to_json({"b": 2, "a": 1})


def test_atomic_write_json_refuses_nan_and_keeps_the_old_file(tmp_path):
    path = atomic_write_json(tmp_path / "r.json", {"ok": 1})
    with pytest.raises(ValueError):
        atomic_write_json(path, {"bad": float("nan")})
    assert read_json(path) == {"ok": 1} and os.listdir(tmp_path) == ["r.json"]


def test_atomic_savez_is_deterministic_and_loadable(tmp_path):
    arrays = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.array([1, 2], np.int64)}
    a = atomic_savez(tmp_path / "a.npz", **arrays)
    b = atomic_savez(tmp_path / "b.npz", **arrays)
    assert a.read_bytes() == b.read_bytes()
    with np.load(a) as data:
        np.testing.assert_array_equal(data["x"], arrays["x"])
        assert data["ids"].dtype == np.int64


# --- directories --------------------------------------------------------------------------------


def test_atomic_dir_creates_a_new_directory(tmp_path):
    target = tmp_path / "engine"
    with atomic_dir(target) as staging:
        assert staging != target and staging.parent == tmp_path
        (staging / "model.onnx").write_bytes(b"m")
        assert not target.exists()
    assert (target / "model.onnx").read_bytes() == b"m"
    assert os.listdir(tmp_path) == ["engine"]
    assert mode(target) == 0o777 & ~current_umask()


def test_atomic_dir_replaces_only_on_success(tmp_path):
    target = tmp_path / "engine"
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    with atomic_dir(target) as staging:
        (staging / "new.bin").write_bytes(b"new")
        assert (target / "old.bin").exists()  # the old engine stays usable while the new one is built
    assert os.listdir(target) == ["new.bin"]
    assert os.listdir(tmp_path) == ["engine"]


def test_atomic_dir_keeps_the_old_directory_on_failure(tmp_path):
    target = tmp_path / "engine"
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    with pytest.raises(Boom), atomic_dir(target) as staging:
        (staging / "half.bin").write_bytes(b"half")
        raise Boom("compiler crashed")
    assert os.listdir(target) == ["old.bin"] and (target / "old.bin").read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["engine"]


def test_atomic_dir_keeps_the_old_directory_when_the_swap_fails(tmp_path, monkeypatch):
    target = tmp_path / "engine"
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    real_replace = os.replace

    def replace(src, dst):
        if str(src).endswith(".tmp"):  # the staging directory's rename into place
            raise Boom("rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(pio.os, "replace", replace)
    with pytest.raises(Boom), atomic_dir(target) as staging:
        (staging / "new.bin").write_bytes(b"new")
    monkeypatch.undo()
    assert (target / "old.bin").read_bytes() == b"old"


def test_atomic_dir_failure_without_an_old_directory_leaves_nothing(tmp_path):
    with pytest.raises(Boom), atomic_dir(tmp_path / "engine"):
        raise Boom
    assert os.listdir(tmp_path) == []


# --- hashes -------------------------------------------------------------------------------------


def test_sha256_file_and_bytes_agree(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (3 << 20))  # more than one read chunk
    assert sha256_file(path) == sha256_bytes(b"x" * (3 << 20))


def test_sha256_arrays_depends_on_content_not_order_or_layout():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    base = sha256_arrays({"x": x, "y": np.ones(2)})
    assert sha256_arrays({"y": np.ones(2), "x": x}) == base
    assert sha256_arrays({"x": np.asfortranarray(x), "y": np.ones(2)}) == base
    assert sha256_arrays({"x": x.astype(np.float64), "y": np.ones(2)}) != base
    assert sha256_arrays({"x": x.reshape(4, 3), "y": np.ones(2)}) != base
    assert sha256_arrays({"z": x, "y": np.ones(2)}) != base


@pytest.mark.parametrize(
    "text, line",
    [
        ("a: 1\n<<<<<<< HEAD\nb: 2\n=======\nb: 3\n>>>>>>> topic\n", 2),
        ("a: 1\n||||||| merged common ancestors\n", 2),  # diff3's base marker
        ("a: 1\n=======\n", 2),
        ("a: 1\r\n>>>>>>> 1a2b3c4 (a commit)\r\n", 2),
        ("a: 1\n  <<<<<<< HEAD\n", None),  # indented: not git's
        ("a: 1\n<<<<<<<< eight\n==========\n", None),  # not seven
        ("description: '<<<<<<< is how git marks a conflict'\n", None),
    ],
)
def test_merge_conflict_markers(text, line):
    found = pio.merge_conflict("dvc.lock", text)
    if line is None:
        assert found is None
    else:
        assert found is not None and found.startswith(f"dvc.lock has an unresolved git merge conflict: line {line} ")
