"""A dataset that is a folder of raw files (images or WAV clips), and its packed form.

The folder is untrusted input: it must lie inside the project (symlinks followed), hold only files
of the input's kind (and an optional labels.csv), and fit the dataset limits, all checked from the
listing and file sizes before a byte is read. A file's name is used only to open it from the
listing and to name it in a message; labels.csv's names are matched against the listing, never
joined into a path.

The data stage keeps the files' bytes beside the arrays it saves (``pack``/``unpack``: plain numeric
and fixed-width unicode arrays, loadable with allow_pickle=False), so that any later stage can run
another preprocessing (the device's) on exactly the same files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.core.errors import InputError, MalformedFile
from pipeline.core.limits import MAX_DATASET_BYTES, MAX_DATASET_FILES, MAX_LABELS_CSV_BYTES, human_bytes
from pipeline.core.paths import inside
from pipeline.project.data import LABELS

if TYPE_CHECKING:
    import numpy as np

EXTENSIONS: dict[str, tuple[str, ...]] = {
    "image": (".png", ".jpg", ".jpeg", ".bmp"),
    "audio": (".wav",),
}
LABELS_CSV = "labels.csv"

# keys of the packed form (the labels under LABELS, the key every split's labels use)
BYTES, OFFSETS, NAMES = "file_bytes", "file_offsets", "file_names"


@dataclass(frozen=True)
class FilesDataset:
    """The files of one split, sorted by name, with their bytes and (from labels.csv) labels."""

    folder: Path
    names: list[str]
    blobs: list[bytes]
    labels: np.ndarray | None  # int64, one per file; None without labels.csv


def read_files_dataset(
    root: Path,
    model_dir: str,
    folder: str,
    split: str,
    decode: Literal["image", "audio"],
    take: int | None = None,
) -> FilesDataset:
    """The files of ``folder`` (relative to the model's dir under ``root``) whose extension suits
    ``decode``, sorted by name (code points), the first ``take`` when given, with labels.csv's labels.

    Refused with an InputError naming the split: a folder outside the project (or a file whose
    symlink leads out of it), no files, an entry with an unsupported extension or that is not a file
    (hidden entries, ``.name``, are skipped), more than MAX_DATASET_FILES files or MAX_DATASET_BYTES
    bytes, and a labels.csv that does not label every file exactly once with an integer >= 0.
    """
    where = f"dataset {split}"
    hint_path = f"fix models.<name>.datasets.{split}.files (a folder relative to the model's dir)"
    path = inside(root, model_dir, folder)
    if not path.is_dir():
        raise InputError(f"{where}: {path} is not a folder", hint=hint_path)
    exts = EXTENSIONS[decode]
    files: list[os.DirEntry[str]] = []
    other: list[str] = []
    labels_entry: os.DirEntry[str] | None = None
    with os.scandir(path) as listing:
        for entry in listing:
            if entry.name.startswith("."):
                continue
            if entry.name == LABELS_CSV:
                labels_entry = entry
            elif entry.name.lower().endswith(exts) and entry.is_file():
                files.append(entry)
            else:
                other.append(entry.name)
            if len(files) > MAX_DATASET_FILES:
                raise InputError(
                    f"{where}: {path} holds more than {MAX_DATASET_FILES} files",
                    hint="keep fewer samples in the folder (a held-out subset), or split it",
                )
    if other:
        shown = ", ".join(repr(n) for n in sorted(other)[:5]) + (
            f" and {len(other) - 5} more" if len(other) > 5 else ""
        )
        raise InputError(
            f"{where}: {path} holds entries that are not {decode} files ({', '.join(exts)}): {shown}",
            hint=f"keep only {decode} files and {LABELS_CSV} in the folder (subfolders are not read); "
            "convert or remove the others",
        )
    if not files:
        raise InputError(
            f"{where}: {path} holds no {decode} files ({', '.join(exts)})",
            hint=f"add the samples to the folder, or {hint_path}",
        )
    files.sort(key=lambda e: e.name)
    labels = None
    if labels_entry is not None:  # checked against every file, then cut to ``take`` with them
        inside(root, model_dir, folder, LABELS_CSV)
        labels = _read_labels(Path(labels_entry.path), [entry.name for entry in files], where)
    if take is not None:
        files = files[:take]
        labels = None if labels is None else labels[:take]
    for entry in files:  # a symlink made after validation must not lead out either
        inside(root, model_dir, folder, entry.name)
    total = sum(entry.stat().st_size for entry in files)
    if total > MAX_DATASET_BYTES:
        raise InputError(
            f"{where}: the {len(files)} files of {path} hold {human_bytes(total)}, above the limit of "
            f"{human_bytes(MAX_DATASET_BYTES)} per dataset; nothing was read",
            hint="keep fewer or smaller files in the folder",
        )
    names = [entry.name for entry in files]
    blobs: list[bytes] = []
    left = MAX_DATASET_BYTES
    for entry in files:
        try:
            with open(entry.path, "rb") as fh:
                blobs.append(fh.read(left + 1))  # a file grown since its size was read stops here
        except OSError as exc:
            raise InputError(
                f"{where}: {entry.name!r} in {path} cannot be read ({exc.strerror or exc})",
                hint="check that the file is readable (permissions, a broken link, the disk)",
            ) from exc
        left -= len(blobs[-1])
        if left < 0:
            raise InputError(
                f"{where}: the files of {path} grew past the limit of {human_bytes(MAX_DATASET_BYTES)} "
                f"per dataset while they were read (at {entry.name!r})",
                hint="let whatever writes to the folder finish, then run again",
            )
    return FilesDataset(folder=path, names=names, blobs=blobs, labels=labels)


def _read_labels(path: Path, names: list[str], where: str) -> np.ndarray:
    """One label per name from ``path`` (header ``file,label``), in ``names`` order."""
    import csv

    import numpy as np

    hint = f"{LABELS_CSV} has the header 'file,label' and one row per file: its name and an integer class index >= 0"
    if path.stat().st_size > MAX_LABELS_CSV_BYTES:
        raise InputError(f"{where}: {path} is larger than {human_bytes(MAX_LABELS_CSV_BYTES)}", hint=hint)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{where}: {path} cannot be read as UTF-8 text ({exc})", hint=hint) from exc
    rows = csv.reader(text.splitlines())
    header = next(rows, None)
    if header is None or [h.strip() for h in header] != ["file", "label"]:
        raise InputError(f"{where}: {path} row 1 is {header!r}, expected the header 'file,label'", hint=hint)
    index = {name: i for i, name in enumerate(names)}
    labels = np.full(len(names), -1, dtype=np.int64)
    seen: dict[str, int] = {}
    for number, row in enumerate(rows, start=2):
        if not row:
            continue
        if len(row) != 2:
            raise InputError(f"{where}: {path} row {number} has {len(row)} fields, expected 2: {row!r}", hint=hint)
        name, text_label = row[0], row[1].strip()
        if name in seen:
            raise InputError(
                f"{where}: {path} row {number} labels {name!r} again (first on row {seen[name]})", hint=hint
            )
        seen[name] = number
        if not (text_label.isascii() and text_label.isdigit()):
            raise InputError(
                f"{where}: {path} row {number}: label {text_label!r} of {name!r} is not an integer >= 0", hint=hint
            )
        label = int(text_label)
        if name not in index:
            raise InputError(
                f"{where}: {path} row {number} names {name!r}, which is not a file of the folder", hint=hint
            )
        labels[index[name]] = label
    missing = [n for n, label in zip(names, labels, strict=True) if label < 0]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise InputError(f"{where}: {path} has no label for {len(missing)} file(s): {shown}", hint=hint)
    return labels


def pack(blobs: Sequence[bytes], names: Sequence[str], labels: np.ndarray | None) -> dict[str, np.ndarray]:
    """The files as arrays for an .npz: their bytes concatenated (uint8), the offsets where each starts
    and the last ends (int64, len(files) + 1), their names (fixed-width unicode) and the labels."""
    import numpy as np

    if len(blobs) != len(names) or (labels is not None and len(labels) != len(names)):
        raise ValueError(f"{len(blobs)} files, {len(names)} names, {None if labels is None else len(labels)} labels")
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    width = max((len(n) for n in names), default=1) or 1
    out: dict[str, np.ndarray] = {
        BYTES: np.frombuffer(b"".join(blobs), dtype=np.uint8),
        OFFSETS: offsets,
        NAMES: np.array(list(names), dtype=f"<U{width}"),
    }
    if labels is not None:
        out[LABELS] = np.asarray(labels, dtype=np.int64)
    return out


def unpack(arrays: dict[str, np.ndarray]) -> tuple[list[bytes], list[str], np.ndarray | None]:
    """The files ``pack`` stored: (bytes, names, labels or None). MalformedFile when the arrays do not
    hold a packing (a key missing, a wrong dtype or shape, offsets out of order or past the bytes)."""
    import numpy as np

    missing = [k for k in (BYTES, OFFSETS, NAMES) if k not in arrays]
    if missing:
        raise MalformedFile(
            f"packed files: keys {missing} are missing (keys: {sorted(arrays)})",
            hint="re-run the data stage to rebuild the split",
        )
    data, offsets, names = arrays[BYTES], arrays[OFFSETS], arrays[NAMES]
    problem = None
    if data.ndim != 1 or data.dtype != np.uint8:
        problem = f"{BYTES} is {data.dtype} of shape {data.shape}, expected 1-d uint8"
    elif offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        problem = f"{OFFSETS} is {offsets.dtype} of shape {offsets.shape}, expected 1-d integers"
    elif names.ndim != 1 or names.dtype.kind != "U":
        problem = f"{NAMES} is {names.dtype} of shape {names.shape}, expected 1-d unicode"
    elif len(offsets) != len(names) + 1:
        problem = f"{len(offsets)} offsets for {len(names)} names, expected one more offset than names"
    elif offsets[0] != 0 or offsets[-1] != len(data) or bool((np.diff(offsets) < 0).any()):
        problem = f"{OFFSETS} must rise from 0 to the {len(data)} bytes held, never falling"
    labels = arrays.get(LABELS)
    if problem is None and labels is not None:
        if labels.ndim != 1 or labels.dtype.kind not in "iu" or len(labels) != len(names):
            problem = f"{LABELS} is {labels.dtype} of shape {labels.shape}, expected {len(names)} integers"
        elif len(labels) and int(labels.min()) < 0:
            problem = f"{LABELS} holds a negative label"
    if problem is not None:
        raise MalformedFile(f"packed files: {problem}", hint="re-run the data stage to rebuild the split")
    raw = data.tobytes()
    bounds = offsets.tolist()
    blobs = [raw[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return blobs, names.tolist(), labels
