"""Resource limits, checked before anything is allocated.

A registry whose inputs or generated sets would not fit is refused when it loads (pipeline/project/config/load.py),
and a user's .npy/.npz is refused from its zip directory and array headers before any data is
read or inflated (``check_array_file``): each is exit 2 naming the key or the file, not a
MemoryError. docs/registry.md#limits gives the reasoning for each value.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import IO, TYPE_CHECKING, NamedTuple

from pipeline.core.errors import InputError, MalformedFile

if TYPE_CHECKING:
    from zipfile import ZipInfo

GiB = 1 << 30
MiB = 1 << 20

# Element counts and offsets of a tensor fit a signed 32-bit integer: TensorRT's volumes and many
# CPU and GPU kernels index with int32.
MAX_TENSOR_ELEMENTS = 2**31 - 1
# One input tensor at its largest shape: its byte size fits an unsigned 32-bit integer, and the
# engine's own copies of it and its outputs still fit a 16 GiB CI runner.
MAX_TENSOR_BYTES = 4 * GiB
# One dataset split (every array of it, as stored): the data stage holds a split as loaded and as
# preprocessed (and, for golden, raw) at once, which stays within a 16 GiB runner.
MAX_DATASET_BYTES = 4 * GiB
# An .npz member may inflate at most this many times its compressed size once it is larger than
# ZIP_RATIO_GRACE_BYTES: real inputs deflate 2-20x (padding-heavy token ids up to ~100x); deflate's
# ceiling, ~1030x for a run of one byte, is what a zip bomb is made of.
MAX_ZIP_RATIO = 200
# A folder of raw files (pipeline/project/files.py): one file per sample, 1 KiB a name at most in the
# packed names array; labels.csv read whole. An image's pixels (width x height) before it is decoded:
# 64 Mi, a decompression bomb's tell (below Pillow's own warning level).
MAX_DATASET_FILES = 100_000
MAX_LABELS_CSV_BYTES = 64 * MiB
# A text label (labels.csv of a ctc_greedy model with an alphabet): the stored array holds every label at
# the longest one's width, 4 bytes a character. The boxes of one file (boxes.csv): dense text pages hold a
# few thousand, COCO images at most a few hundred.
MAX_TEXT_LABEL_CHARS = 1024
MAX_BOXES_PER_FILE = 10_000
MAX_IMAGE_PIXELS = 64 * MiB
ZIP_RATIO_GRACE_BYTES = 64 * MiB

# bytes per element of each dtype params.yaml accepts (pipeline.project.config.DType)
DTYPE_BYTES = {
    "float64": 8,
    "int64": 8,
    "float32": 4,
    "int32": 4,
    "float16": 2,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # what np.load takes for an .npz (the second: an empty one)
_SMALLER = "split the set into smaller files, or keep fewer samples in it"
_RESAVE = "re-save it with numpy.save / numpy.savez: numeric arrays, no objects or strings"


def human_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


def tensor_limit(itemsize: int) -> int:
    """The most elements one input tensor of ``itemsize``-byte elements may hold."""
    return min(MAX_TENSOR_ELEMENTS, MAX_TENSOR_BYTES // max(itemsize, 1))


def largest_within(size: Callable[[int], int], high: int, limit: int) -> int:
    """The largest value ``v`` in 0..``high`` with ``size(v) <= limit`` (``size`` grows with ``v``)."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if size(mid) <= limit else (low, mid - 1)
    return low


def check_array_file(path: str | os.PathLike, keys: Collection[str] | None = None, context: str = "") -> None:
    """Refuse a .npy/.npz whose arrays would not fit MAX_DATASET_BYTES, before anything is read.

    An .npz's zip directory is checked for every member (declared inflated size, inflation ratio)
    before any member is opened; then the .npy header of each member read as ``keys`` (all when
    None) is parsed: its shape and dtype give the bytes loading it would allocate, which must add
    up to no more than the budget and match the bytes the member holds. Raises InputError (exit 2)
    naming the file and member, prefixed by ``context``; MalformedFile when a header disagrees
    with its data. A file that is neither an .npy nor an .npz is left for np.load to refuse.
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
            fh.seek(0)
            if magic.startswith(_ZIP_MAGIC):
                _check_npz(fh, path, keys, context)
            elif magic == b"\x93NUMPY":
                where = f"{context}{path}"
                header = _header(fh, where)
                if header.nbytes is not None:
                    _over_budget(where, header)
                    _agrees(where, header, os.fstat(fh.fileno()).st_size - fh.tell())
    except OSError as exc:
        raise InputError(
            f"{context}{path} cannot be read ({exc.strerror or exc})",
            hint="check that the file is readable (permissions, a broken link, the disk)",
        ) from exc


def _check_npz(fh: IO[bytes], path: Path, keys: Collection[str] | None, context: str) -> None:
    import zipfile

    try:
        archive = zipfile.ZipFile(fh)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise MalformedFile(
            f"{context}{path} is not a readable .npz ({type(exc).__name__}: {exc})", hint=_RESAVE
        ) from exc
    with archive:
        members = archive.infolist()
        for info in members:  # the directory alone: nothing is inflated yet
            _check_member(info, f"{context}{path} member {info.filename!r}")
        total, sizes = 0, []
        for info in members:
            if keys is not None and info.filename.removesuffix(".npy") not in keys:
                continue
            where = f"{context}{path} member {info.filename!r}"
            try:
                with archive.open(info) as member:
                    header = _header(member, where)
                    offset = member.tell()
            except InputError:
                raise
            except Exception as exc:  # zipfile and zlib errors (encrypted, unknown method, damaged) mean the same
                raise MalformedFile(
                    f"{where} is not a readable .npy ({type(exc).__name__}: {exc})", hint=_RESAVE
                ) from exc
            if header.nbytes is None:  # an object array: np.load refuses it (allow_pickle=False) before reading it
                continue
            _over_budget(where, header)
            _agrees(where, header, info.file_size - offset)
            total += header.nbytes
            sizes.append(f"{info.filename!r} {human_bytes(header.nbytes)}")
    if total > MAX_DATASET_BYTES:
        raise InputError(
            f"{context}{path} holds {human_bytes(total)} of array data ({', '.join(sizes)}), above the "
            f"limit of {human_bytes(MAX_DATASET_BYTES)} per dataset; no array data was read",
            hint=_SMALLER,
        )


def _check_member(info: ZipInfo, where: str) -> None:
    """An .npz member's declared inflated size and inflation ratio (zip directory only)."""
    ratio = info.file_size / max(info.compress_size, 1)
    if info.file_size > ZIP_RATIO_GRACE_BYTES and ratio > MAX_ZIP_RATIO:
        raise InputError(
            f"{where} would inflate {ratio:.0f}-fold ({human_bytes(info.compress_size)} to "
            f"{human_bytes(info.file_size)}), above the {MAX_ZIP_RATIO}x allowed for members over "
            f"{human_bytes(ZIP_RATIO_GRACE_BYTES)}: it looks like a zip bomb and was not inflated",
            hint="if the data is genuine, save it uncompressed (numpy.savez, not numpy.savez_compressed)",
        )
    if info.file_size > MAX_DATASET_BYTES:
        raise InputError(
            f"{where} inflates to {human_bytes(info.file_size)} (from {human_bytes(info.compress_size)} "
            f"in the file), above the limit of {human_bytes(MAX_DATASET_BYTES)} per dataset; "
            "nothing was inflated",
            hint=_SMALLER,
        )


class _Header(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    nbytes: int | None  # None for an object array


def _header(fh: IO[bytes], where: str) -> _Header:
    """The .npy header at ``fh``; ``fh`` is left at the start of the data."""
    from numpy.lib import format as npy

    try:
        version = npy.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = npy.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, _, dtype = npy.read_array_header_2_0(fh)
        else:
            raise ValueError(f"format version {version[0]}.{version[1]} is not one numpy writes for numeric arrays")
    except (ValueError, EOFError, OSError) as exc:
        raise MalformedFile(f"{where} is not a readable .npy: its header is damaged ({exc})", hint=_RESAVE) from exc
    if any(d < 0 for d in shape):
        raise MalformedFile(f"{where} is malformed: its header declares the negative shape {shape}", hint=_RESAVE)
    elements = 1
    for d in shape:
        elements *= int(d)
    return _Header(tuple(shape), str(dtype), None if dtype.hasobject else elements * dtype.itemsize)


def _over_budget(where: str, header: _Header) -> None:
    assert header.nbytes is not None
    if header.nbytes > MAX_DATASET_BYTES:
        raise InputError(
            f"{where} declares a {header.dtype} array of shape {header.shape}: "
            f"{human_bytes(header.nbytes)}, above the limit of {human_bytes(MAX_DATASET_BYTES)} "
            "per dataset; no array data was read",
            hint=_SMALLER,
        )


def _agrees(where: str, header: _Header, held: int) -> None:
    if header.nbytes != held:
        raise MalformedFile(
            f"{where} is malformed: its header declares a {header.dtype} array of shape {header.shape} "
            f"({header.nbytes} bytes of data) but it holds {held} bytes after the header "
            "(truncated or altered)",
            hint=_RESAVE,
        )
