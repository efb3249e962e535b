"""Resource limits: .npy/.npz sizes read from zip directories and array headers, refused unread."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npy

from pipeline.core import limits
from pipeline.core.errors import InputError, MalformedFile
from pipeline.core.limits import (
    DTYPE_BYTES,
    check_array_file,
    human_bytes,
    largest_within,
    tensor_limit,
)
from pipeline.project.config import DTYPES


def header_only(fh, shape: tuple[int, ...], dtype: str = "<f4", data: bytes = b"") -> None:
    """An .npy header declaring ``shape`` followed by ``data`` (not what the header declares)."""
    npy.write_array_header_1_0(fh, {"descr": dtype, "fortran_order": False, "shape": shape})
    fh.write(data)


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The zip members opened (to inflate, or to write) during the test."""
    names: list[str] = []
    real = zipfile.ZipFile.open

    def spy(self, name, *args, **kwargs):
        names.append(name.filename if isinstance(name, zipfile.ZipInfo) else name)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    return names


def refused(path: Path, cls: type[InputError] = InputError, **kwargs) -> str:
    with pytest.raises(cls) as info:
        check_array_file(path, **kwargs)
    assert info.value.exit_code == 2 and info.value.hint
    return info.value.message


def test_dtype_bytes_match_numpy():
    assert set(DTYPE_BYTES) == set(DTYPES)
    assert all(np.dtype(d).itemsize == n for d, n in DTYPE_BYTES.items())


def test_tensor_limit_is_the_tighter_of_elements_and_bytes():
    assert tensor_limit(1) == tensor_limit(2) == 2**31 - 1
    assert tensor_limit(4) == 2**30 and tensor_limit(8) == 2**29


def test_largest_within_handles_an_axis_used_twice():
    assert largest_within(lambda v: v * v * 3, 1000, 300) == 10
    assert largest_within(lambda v: v * 500, 1000, 300) == 0


def test_human_bytes():
    assert [human_bytes(n) for n in (12, 4096, 5 << 20, 4 << 30, 3 << 40)] == [
        "12 bytes",
        "4.00 KiB",
        "5.00 MiB",
        "4.00 GiB",
        "3.00 TiB",
    ]


# --- legitimate files pass ----------------------------------------------------------------------


def test_legitimate_files_pass(tmp_path, opened):
    x = np.random.default_rng(0).uniform(size=(6, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "fortran.npy", np.asfortranarray(x))
    np.savez(tmp_path / "plain.npz", x=x, labels=np.arange(6))
    np.savez_compressed(tmp_path / "packed.npz", x=x, labels=np.arange(6))
    np.savez_compressed(tmp_path / "zeros.npz", x=np.zeros((1 << 20,), np.uint8))  # 1000-fold, but only 1 MiB
    np.savez(tmp_path / "empty.npz")
    opened.clear()  # savez writes through ZipFile.open too
    for name in ("x.npy", "fortran.npy", "plain.npz", "packed.npz", "zeros.npz", "empty.npz"):
        check_array_file(tmp_path / name)
    assert opened == ["x.npy", "labels.npy", "x.npy", "labels.npy", "x.npy"]


def test_a_file_neither_npy_nor_npz_is_left_to_np_load(tmp_path):
    (tmp_path / "pickle.npy").write_bytes(b"\x80\x04not an array")
    check_array_file(tmp_path / "pickle.npy")


def test_an_unreadable_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="cannot be read"):
        check_array_file(tmp_path)  # a folder


# --- zip bombs ----------------------------------------------------------------------------------


def test_zip_bomb_is_refused_from_the_directory(zip_bomb, opened):
    message = refused(zip_bomb, context="dataset golden: ")
    assert message.startswith(f"dataset golden: {zip_bomb} member 'x.npy' would inflate ")
    assert "zip bomb" in message and "1.00 GiB" in message and "200x" in message
    assert opened == []  # not even its header was inflated


def test_a_member_inflating_beyond_the_budget_is_refused_from_the_directory(tmp_path, opened, monkeypatch):
    np.savez(tmp_path / "big.npz", x=np.zeros(3 << 20, np.uint8))
    opened.clear()
    monkeypatch.setattr(limits, "MAX_DATASET_BYTES", 1 << 20)
    message = refused(tmp_path / "big.npz")
    assert "member 'x.npy' inflates to 3.00 MiB (from 3.00 MiB in the file), above the limit of 1.00 MiB" in message
    assert opened == []


def test_members_together_above_the_budget(tmp_path, monkeypatch):
    np.savez(tmp_path / "two.npz", x=np.zeros(100, np.float64), labels=np.zeros(100, np.int64))
    monkeypatch.setattr(limits, "MAX_DATASET_BYTES", 1000)
    message = refused(tmp_path / "two.npz")
    assert "holds 1.56 KiB of array data ('x.npy' 800 bytes, 'labels.npy' 800 bytes)" in message
    check_array_file(tmp_path / "two.npz", keys=["x"])  # only what is read counts


# --- headers that lie ---------------------------------------------------------------------------


def test_npy_header_claiming_a_trillion_elements_is_refused_unread(tmp_path):
    with open(tmp_path / "huge.npy", "wb") as fh:
        header_only(fh, (10**12,), data=bytes(64))
    message = refused(tmp_path / "huge.npy")
    assert "declares a float32 array of shape (1000000000000,): 3.64 TiB" in message
    assert "above the limit of 4.00 GiB per dataset" in message


def test_npz_member_header_claiming_a_trillion_elements(tmp_path):
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as archive, archive.open("x.npy", "w") as member:
        header_only(member, (10**6, 10**6), "<i8", bytes(64))
    message = refused(tmp_path / "huge.npz")
    assert "member 'x.npy' declares a int64 array of shape (1000000, 1000000)" in message


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_header_disagreeing_with_the_data_is_malformed(tmp_path, suffix):
    path = tmp_path / f"short{suffix}"
    if suffix == ".npy":
        with open(path, "wb") as fh:
            header_only(fh, (100,), data=bytes(64))
    else:
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive, archive.open("x.npy", "w") as member:
            header_only(member, (100,), data=bytes(401))
    message = refused(path, MalformedFile)
    assert "header declares a float32 array of shape (100,) (400 bytes of data) but it holds" in message


def test_member_that_is_not_an_npy_is_malformed(tmp_path):
    with zipfile.ZipFile(tmp_path / "text.npz", "w") as archive:
        archive.writestr("x.npy", "just text")
    assert "member 'x.npy' is not a readable .npy" in refused(tmp_path / "text.npz", MalformedFile)


def test_object_array_header_is_left_to_np_load(tmp_path):
    np.savez(tmp_path / "objects.npz", x=np.array([object(), 1], dtype=object))
    check_array_file(tmp_path / "objects.npz")  # allow_pickle=False refuses it when loaded, by key
