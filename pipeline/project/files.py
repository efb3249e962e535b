"""A dataset that is a folder of raw files (images or WAV clips), and its packed form.

The folder is untrusted input: it must lie inside the project (symlinks followed), hold only files
of the input's kind (and an optional labels.csv, or for images boxes.csv), and fit the dataset
limits, all checked from the listing and file sizes before a byte is read. A file's name is used only
to open it from the listing and to name it in a message; the CSV files' names are matched against
the listing, never joined into a path. Each of their rows is checked, and a refusal names the file
and the row.

The data stage keeps the files' bytes beside the arrays it saves (``pack``/``unpack``: plain numeric
and fixed-width unicode arrays, loadable with allow_pickle=False), so that any later stage can run
another preprocessing (the device's) on exactly the same files.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.core.errors import InputError, MalformedFile
from pipeline.core.limits import (
    MAX_BOXES_PER_FILE,
    MAX_DATASET_BYTES,
    MAX_DATASET_FILES,
    MAX_LABELS_CSV_BYTES,
    MAX_TEXT_LABEL_CHARS,
    human_bytes,
)
from pipeline.core.paths import inside
from pipeline.project.data import LABEL_BOX_COUNTS, LABELS, LABELS_TEXT, MAX_CLASS_INDEX, Classes, box_arrays

if TYPE_CHECKING:
    import numpy as np

EXTENSIONS: dict[str, tuple[str, ...]] = {
    "image": (".png", ".jpg", ".jpeg", ".bmp"),
    "audio": (".wav",),
}
LABELS_CSV = "labels.csv"
BOXES_CSV = "boxes.csv"  # images only

# keys of the packed form (the labels under LABELS, the key every split's labels use)
BYTES, OFFSETS, NAMES = "file_bytes", "file_offsets", "file_names"

_LABEL_HEADER = ("file", "label")
_BOX_HEADERS = (("file", "x1", "y1", "x2", "y2"), ("file", "x1", "y1", "x2", "y2", "class"))


@dataclass(frozen=True)
class FilesDataset:
    """The files of one split, sorted by name, with their bytes and targets (labels.csv or boxes.csv)."""

    folder: Path
    names: list[str]
    blobs: list[bytes]
    # as the split's .npz stores them: LABELS (int64) or LABELS_TEXT (unicode), one per file, or the box
    # arrays (pipeline.project.data.BOX_KEYS); empty without labels.csv or boxes.csv
    targets: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def labels(self) -> np.ndarray | None:
        """The integer class indices (int64, one per file) of labels.csv; None without them."""
        return self.targets.get(LABELS)


def _list_folder(
    path: Path, where: str, decode: Literal["image", "audio"], hint_path: str
) -> tuple[list[os.DirEntry[str]], dict[str, os.DirEntry[str]]]:
    """The folder's files of ``decode``'s kind and its target CSVs; refused: other entries, too many
    files, names no CSV row can hold, no files, both kinds of targets."""
    exts = EXTENSIONS[decode]
    targets_csv = (LABELS_CSV, BOXES_CSV) if decode == "image" else (LABELS_CSV,)
    files: list[os.DirEntry[str]] = []
    other: list[str] = []
    csv_entries: dict[str, os.DirEntry[str]] = {}
    with os.scandir(path) as listing:
        for entry in listing:
            if entry.name.startswith("."):
                continue
            if entry.name in targets_csv:
                csv_entries[entry.name] = entry
            elif entry.name.lower().endswith(exts) and entry.is_file():
                files.append(entry)
            else:
                other.append(entry.name)
            if len(files) > MAX_DATASET_FILES:
                raise InputError(
                    f"{where}: {path} holds more than {MAX_DATASET_FILES} files",
                    hint="keep fewer samples in the folder (a held-out subset), or split it",
                )
    unnameable = sorted(e.name for e in files if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in e.name))
    if unnameable:
        raise InputError(
            f"{where}: {path} holds {decode} files whose names hold a line break or another control character: "
            f"{_some(unnameable)}; no row of {' or '.join(targets_csv)} can name them, and a message would "
            "show them garbled",
            hint="rename the files without control characters (letters, digits, spaces and punctuation are fine)",
        )
    if other:
        raise InputError(
            f"{where}: {path} holds entries that are not {decode} files ({', '.join(exts)}): {_some(sorted(other))}",
            hint=f"keep only {decode} files and {' or '.join(targets_csv)} in the folder (subfolders are not "
            "read); convert or remove the others",
        )
    if not files:
        raise InputError(
            f"{where}: {path} holds no {decode} files ({', '.join(exts)})",
            hint=f"add the samples to the folder, or {hint_path}",
        )
    if len(csv_entries) > 1:
        raise InputError(
            f"{where}: {path} holds both {LABELS_CSV} and {BOXES_CSV}",
            hint="a split has one kind of target: keep the one the model's task reads",
        )
    return files, csv_entries


def _read_blobs(files: list[os.DirEntry[str]], path: Path, where: str) -> list[bytes]:
    """Every file's bytes, stopping at MAX_DATASET_BYTES in all (a file may grow while it is read)."""
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
    return blobs


def read_files_dataset(
    root: Path,
    model_dir: str,
    folder: str,
    split: str,
    decode: Literal["image", "audio"],
    take: int | None = None,
    *,
    alphabet: str | None = None,
    extent: tuple[int, int] | None = None,
    classes: Classes | None = None,
) -> FilesDataset:
    """The files of ``folder`` (relative to the model's dir under ``root``) whose extension suits
    ``decode``, sorted by name (code points), the first ``take`` when given, with their targets.

    Targets: labels.csv's integer class indices (below ``classes``' count when given), or its text when
    ``alphabet`` (a ctc_greedy model's) is given; for images, boxes.csv's boxes, which must lie inside
    ``extent`` (the model input's height and width) when given. Refused with an InputError naming the
    split: a folder outside the project (or a file whose symlink leads out of it), no files, an entry
    with an unsupported extension or that is not a file (hidden entries, ``.name``, are skipped), a
    name holding a line break or another control character (no CSV row could name it), more than
    MAX_DATASET_FILES files or MAX_DATASET_BYTES bytes, labels.csv and boxes.csv together, and a row of
    either that breaks its rules (named with its row).
    """
    where = f"dataset {split}"
    hint_path = f"fix models.<name>.datasets.{split}.files (a folder relative to the model's dir)"
    path = inside(root, model_dir, folder)
    if not path.is_dir():
        raise InputError(f"{where}: {path} is not a folder", hint=hint_path)
    files, csv_entries = _list_folder(path, where, decode, hint_path)
    files.sort(key=lambda e: e.name)
    targets: dict[str, np.ndarray] = {}
    for name, entry in csv_entries.items():  # checked against every file, then cut to ``take`` with them
        inside(root, model_dir, folder, name)
        listed = [e.name for e in files]
        if name == LABELS_CSV:
            targets = _read_labels(Path(entry.path), listed, where, alphabet, classes)
        else:
            targets = _read_boxes(Path(entry.path), listed, where, extent)
    if take is not None:
        files = files[:take]
        targets = _take(targets, take)
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
    blobs = _read_blobs(files, path, where)
    return FilesDataset(folder=path, names=names, blobs=blobs, targets=targets)


def _some(names: Sequence[str]) -> str:
    """Up to five names, quoted, and how many more."""
    return ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _shown(text: object, limit: int = 120) -> str:
    """``repr(text)``, cut to ``limit`` characters: a message quotes a hostile row, not all of it."""
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[: limit - 3]}..."


def _csv_rows(path: Path, headers: Iterable[tuple[str, ...]], where: str, hint: str) -> Iterator[tuple[int, list[str]]]:
    """The rows after the header of the CSV file ``path`` (UTF-8, at most MAX_LABELS_CSV_BYTES), each
    with its number (the header is row 1), blank rows skipped. The header must be one of ``headers``
    and every row as wide as it; an InputError names the file and the row otherwise."""
    import csv
    import io

    if path.stat().st_size > MAX_LABELS_CSV_BYTES:
        raise InputError(f"{where}: {path} is larger than {human_bytes(MAX_LABELS_CSV_BYTES)}", hint=hint)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{where}: {path} cannot be read as UTF-8 text ({exc})", hint=hint) from exc
    reader = csv.reader(io.StringIO(text, newline=""))  # a quoted field may hold a line break
    number = 0  # the row read last
    try:
        header = next(reader, None)
        number = 1
        allowed = [list(h) for h in headers]
        if header is None or [h.strip() for h in header] not in allowed:
            expected = " or ".join(f"'{','.join(h)}'" for h in allowed)
            raise InputError(f"{where}: {path} row 1 is {_shown(header)}, expected the header {expected}", hint=hint)
        for number, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise InputError(
                    f"{where}: {path} row {number} has {len(row)} fields, expected {len(header)}: {_shown(row)}",
                    hint=hint,
                )
            yield number, row
    except csv.Error as exc:  # a field past csv's size limit, a stray quote in strict mode
        raise InputError(f"{where}: {path} row {number + 1} is not valid CSV ({exc})", hint=hint) from exc


def _class_index(text: str, what: str, hint: str, classes: Classes | None = None) -> int:
    """``text`` as a class index, 0..MAX_CLASS_INDEX (below ``classes``' count when given); ``what`` names
    it (file, row, field) in the refusal."""
    if not (text.isascii() and text.isdigit()):
        raise InputError(f"{what} is not an integer >= 0", hint=hint)
    if len(text) > len(str(MAX_CLASS_INDEX)) or int(text) > MAX_CLASS_INDEX:  # int() of 5000 digits raises
        raise InputError(f"{what} is above {MAX_CLASS_INDEX}, the largest class index", hint=hint)
    if classes is not None and int(text) >= classes.count:
        raise InputError(f"{what} is not a class of the model: the metric's {classes.describe()}", hint=classes.hint())
    return int(text)


def _read_labels(
    path: Path, names: list[str], where: str, alphabet: str | None, classes: Classes | None = None
) -> dict[str, np.ndarray]:
    """One label per name from ``path`` (header ``file,label``), in ``names`` order: class indices
    (below ``classes``' count when given) under LABELS, or with an ``alphabet`` text under LABELS_TEXT."""
    import numpy as np

    if alphabet is None:
        hint = (
            f"{LABELS_CSV} has the header 'file,label' and one row per file: its name and an integer class index >= 0"
        )
    else:
        hint = (
            f"{LABELS_CSV} has the header 'file,label' and one row per file: its name and its text, in the "
            f"characters of models.<name>.postprocess.alphabet (at most {MAX_TEXT_LABEL_CHARS}; quote a text "
            "holding a comma)"
        )
    index = {name: i for i, name in enumerate(names)}
    labels: list[int | str | None] = [None] * len(names)
    seen: dict[str, int] = {}
    for number, row in _csv_rows(path, [_LABEL_HEADER], where, hint):
        name = row[0]
        if name in seen:
            raise InputError(
                f"{where}: {path} row {number} labels {_shown(name)} again (first on row {seen[name]})", hint=hint
            )
        seen[name] = number
        what = f"{where}: {path} row {number}: label {_shown(row[1])} of {_shown(name)}"
        label = (
            _class_index(row[1].strip(), what, hint, classes)
            if alphabet is None
            else _text(row[1], alphabet, what, hint)
        )
        if name not in index:
            raise InputError(
                f"{where}: {path} row {number} names {_shown(name)}, which is not a file of the folder", hint=hint
            )
        labels[index[name]] = label
    missing = [n for n, label in zip(names, labels, strict=True) if label is None]
    if missing:
        raise InputError(f"{where}: {path} has no label for {len(missing)} file(s): {_some(missing)}", hint=hint)
    if alphabet is None:
        return {LABELS: np.asarray(labels, dtype=np.int64)}
    width = max((len(t) for t in labels if isinstance(t, str)), default=1) or 1
    return {LABELS_TEXT: np.asarray(labels, dtype=f"<U{width}")}


def _text(text: str, alphabet: str, what: str, hint: str) -> str:
    """``text`` as a label of a model that reads ``alphabet``: its characters only, taken as they are."""
    if len(text) > MAX_TEXT_LABEL_CHARS:
        raise InputError(f"{what} has {len(text)} characters, above the limit of {MAX_TEXT_LABEL_CHARS}", hint=hint)
    outside = next((i for i, c in enumerate(text) if c not in alphabet), None)
    if outside is not None:
        raise InputError(
            f"{what} holds {text[outside]!r} (character {outside + 1}), which is not in the model's alphabet",
            hint=hint,
        )
    return text


def _read_boxes(path: Path, names: list[str], where: str, extent: tuple[int, int] | None) -> dict[str, np.ndarray]:
    """The boxes of ``path`` (header ``file,x1,y1,x2,y2`` and optionally ``,class``: zero or more rows
    per file) grouped by file in ``names`` order, as the split's .npz stores them."""
    import numpy as np

    hint = (
        f"{BOXES_CSV} has the header 'file,x1,y1,x2,y2' (or 'file,x1,y1,x2,y2,class') and one row per box: "
        "the file's name, the box's corners in the model input's pixel coordinates (x1 < x2, y1 < y2) "
        "and its class index (0 when there is no class column); a file without rows has no boxes"
    )
    index = {name: i for i, name in enumerate(names)}
    per_file = [0] * len(names)
    rows, files, classes, corners = array("q"), array("q"), array("q"), array("d")
    for number, row in _csv_rows(path, _BOX_HEADERS, where, hint):
        name = row[0]
        at = f"{where}: {path} row {number}"
        if name not in index:
            raise InputError(f"{at} names {_shown(name)}, which is not a file of the folder", hint=hint)
        i = index[name]
        per_file[i] += 1
        if per_file[i] > MAX_BOXES_PER_FILE:
            raise InputError(f"{at}: {_shown(name)} has more than {MAX_BOXES_PER_FILE} boxes", hint=hint)
        try:
            corners.extend(float(v) for v in row[1:5])
        except ValueError as exc:
            raise InputError(
                f"{at}: the box {_shown(row[1:5])} of {_shown(name)} is not four numbers", hint=hint
            ) from exc
        what = f"{at}: class {_shown(row[5])} of {_shown(name)}" if len(row) > 5 else ""
        classes.append(_class_index(row[5].strip(), what, hint) if len(row) > 5 else 0)
        rows.append(number)
        files.append(i)
    with np.errstate(over="ignore"):  # past float32: Inf, refused below
        boxes = np.asarray(corners, dtype=np.float64).reshape(-1, 4).astype(np.float32)
    x1, y1, x2, y2 = boxes.T
    problems = [
        (~np.isfinite(boxes).all(axis=1), "holds a value that is not a finite number (in float32)"),
        ((x2 <= x1) | (y2 <= y1), "is empty or reversed: x1 < x2 and y1 < y2 are needed"),
    ]
    if extent is not None:
        height, width = extent
        problems.append(
            (
                (x1 < 0) | (y1 < 0) | (x2 > width) | (y2 > height),
                f"leaves the model input's {width}x{height} pixels (0 <= x1 < x2 <= {width}, 0 <= y1 < y2 <= {height})",
            )
        )
    flagged = [int(np.argmax(bad)) for bad, _ in problems if bad.any()]
    if flagged:  # the first row with any problem, named with its first problem
        first = min(flagged)
        reason = next(why for bad, why in problems if bad[first])
        raise InputError(
            f"{where}: {path} row {rows[first]}: the box {boxes[first].tolist()} of "
            f"{_shown(names[files[first]])} {reason}",
            hint=hint,
        )
    order = np.argsort(np.asarray(files, dtype=np.int64), kind="stable")
    return box_arrays(boxes[order], np.asarray(classes, dtype=np.int64)[order], np.asarray(per_file))


def _take(targets: dict[str, np.ndarray], take: int) -> dict[str, np.ndarray]:
    """The targets of the first ``take`` files."""
    if LABEL_BOX_COUNTS not in targets:
        return {k: v[:take] for k, v in targets.items()}
    counts = targets[LABEL_BOX_COUNTS][:take]
    total = int(counts.sum())
    return {k: counts if k == LABEL_BOX_COUNTS else v[:total] for k, v in targets.items()}


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
