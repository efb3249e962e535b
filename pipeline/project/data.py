"""Datasets: load a user's .npz/.npy or generate from the input spec, preprocess, batch and run.

A dataset is a dict of arrays keyed by input name, each with a leading sample axis: the sample
shape is the input shape without its batch axis, other dynamic axes at their pins. The targets
ride along when present: ``labels`` (int64 class indices), or from a files dataset ``labels_text``
(fixed-width unicode) or the boxes (``label_boxes``, ``label_box_classes``, ``label_box_counts``);
``targets`` gives them per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.errors import InputError, MalformedFile
from pipeline.core.limits import check_array_file
from pipeline.core.paths import inside
from pipeline.project.config import DatasetSource, ModelSpec

if TYPE_CHECKING:
    import numpy as np

    Arrays = dict[str, np.ndarray]

LABELS = "labels"
# a files dataset's other targets: text (labels.csv of a ctc_greedy model with an alphabet), and the boxes
# of boxes.csv, flat over the split with each sample's count (plain arrays: no pickle)
LABELS_TEXT = "labels_text"
LABEL_BOXES, LABEL_BOX_CLASSES, LABEL_BOX_COUNTS = "label_boxes", "label_box_classes", "label_box_counts"
BOX_KEYS = (LABEL_BOXES, LABEL_BOX_CLASSES, LABEL_BOX_COUNTS)
TARGET_KEYS = (LABELS, LABELS_TEXT, *BOX_KEYS)
FLAT_KEYS = (LABEL_BOXES, LABEL_BOX_CLASSES)  # not one row per sample
MAX_CLASS_INDEX = 2**31 - 1  # a class is an output position: it fits the int32 that kernels index with


@dataclass(frozen=True)
class BoxTargets:
    """Annotated boxes per sample: ``boxes[i]`` float32 [k, 4] (x1, y1, x2, y2 in the model input's
    pixel coordinates) and ``classes[i]`` int64 [k], k >= 0."""

    boxes: list[np.ndarray]
    classes: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.boxes)


def box_arrays(boxes: np.ndarray, classes: np.ndarray, counts: np.ndarray) -> Arrays:
    """The stored form of per-sample boxes: ``boxes`` [total, 4] and ``classes`` [total] grouped by
    sample in sample order, ``counts`` [samples]."""
    import numpy as np

    return {
        LABEL_BOXES: np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        LABEL_BOX_CLASSES: np.asarray(classes, dtype=np.int64).reshape(-1),
        LABEL_BOX_COUNTS: np.asarray(counts, dtype=np.int64).reshape(-1),
    }


def targets(arrays: Arrays) -> list[str] | BoxTargets | np.ndarray | None:
    """The targets of a split as stored (its .npz arrays), per sample: text labels as ``list[str]``,
    boxes as ``BoxTargets``, class indices as an int64 array; None for an unlabelled split.

    MalformedFile when the arrays do not hold one consistent kind of target (re-run the data stage)."""
    import numpy as np

    present = [k for k in (LABELS, LABELS_TEXT, LABEL_BOXES) if k in arrays]
    problem = None
    if len(present) > 1:
        problem = f"the split holds more than one kind of target: {present}"
    elif LABELS_TEXT in arrays:
        text = arrays[LABELS_TEXT]
        if text.ndim != 1 or text.dtype.kind != "U":
            problem = f"{LABELS_TEXT} is {text.dtype} of shape {text.shape}, expected 1-d unicode"
        else:
            return [str(t) for t in text.tolist()]
    elif any(k in arrays for k in BOX_KEYS):
        problem = _box_problem(arrays)
        if problem is None:
            counts = arrays[LABEL_BOX_COUNTS]
            bounds = np.cumsum(counts)[:-1].tolist()
            boxes = np.split(arrays[LABEL_BOXES].astype(np.float32), bounds)
            classes = np.split(arrays[LABEL_BOX_CLASSES].astype(np.int64), bounds)
            return BoxTargets(boxes=boxes, classes=classes)
    elif LABELS in arrays:
        labels = arrays[LABELS]
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            problem = f"{LABELS} is {labels.dtype} of shape {labels.shape}, expected 1-d integers"
        else:
            return labels.astype(np.int64)
    if problem is not None:
        raise MalformedFile(f"dataset targets: {problem}", hint="re-run the data stage to rebuild the split")
    return None


def _box_problem(arrays: Arrays) -> str | None:
    import numpy as np

    missing = [k for k in BOX_KEYS if k not in arrays]
    if missing:
        return f"boxes without {missing}"
    boxes, classes, counts = (arrays[k] for k in BOX_KEYS)
    if boxes.ndim != 2 or boxes.shape[1] != 4 or boxes.dtype.kind != "f":
        return f"{LABEL_BOXES} is {boxes.dtype} of shape {boxes.shape}, expected floats [total, 4]"
    if classes.shape != (len(boxes),) or classes.dtype.kind not in "iu":
        return f"{LABEL_BOX_CLASSES} is {classes.dtype} of shape {classes.shape}, expected {len(boxes)} integers"
    if counts.ndim != 1 or counts.dtype.kind not in "iu" or (len(counts) and int(counts.min()) < 0):
        return f"{LABEL_BOX_COUNTS} is {counts.dtype} of shape {counts.shape}, expected counts >= 0 per sample"
    if bool((counts > len(boxes)).any()) or int(counts.sum(dtype=np.int64)) != len(boxes):  # no wrap-around
        return f"{LABEL_BOX_COUNTS} add up to {int(counts.sum(dtype=np.int64))}, not the {len(boxes)} boxes held"
    return None


def sample_shape(spec: ModelSpec, name: str, pins: dict[str, int]) -> tuple[int, ...]:
    return spec.input(name).shape_at(pins, drop=spec.batch_axis)


def generate(spec: ModelSpec, pins: dict[str, int], source: DatasetSource) -> Arrays:
    """Seeded inputs inside each input's range. With ``edge_cases`` (count >= 4) the last samples
    are replaced: the range's low and high ends; for floats also a sample at up to 4x the range
    (outside it) and a zero sample (outside it where 0 is)."""
    import numpy as np

    gen = source.generate
    assert gen is not None
    rng = np.random.default_rng(gen.seed)
    out: dict[str, np.ndarray] = {}
    for inp in spec.inputs:
        shape = (gen.count, *sample_shape(spec, inp.name, pins))
        lo, hi = inp.value_range()
        if inp.dtype == "bool":
            arr = rng.integers(0, 2, size=shape).astype(bool)
        elif inp.dtype.startswith("float"):
            arr = rng.uniform(lo, hi, size=shape)
        else:
            arr = rng.integers(int(lo), int(hi) + 1, size=shape)
        if gen.edge_cases and gen.count >= 4 and inp.dtype != "bool":
            arr[-1] = lo
            arr[-2] = hi
            if inp.dtype.startswith("float"):
                span = max(abs(lo), abs(hi), 1.0)
                arr[-3] = rng.uniform(-4 * span, 4 * span, size=shape[1:])  # large magnitudes
                arr[-4] = 0.0
        with np.errstate(over="ignore"):  # a range beyond the dtype gives Inf: check_finite names it
            out[inp.name] = arr.astype(inp.dtype)
    return out


def load_file(spec: ModelSpec, root: Path, source: DatasetSource, split: str) -> Arrays:
    """The arrays of a .npz (keyed by input name) or .npy (single-input models), each checked to be
    a numeric array with a sample axis, labels integer class indices; ``take`` applied."""
    import numpy as np

    assert source.path is not None
    path = inside(root, spec.dir, source.path)  # a symlink made after validation must not lead out
    if not path.is_file():
        raise InputError(
            f"dataset {split}: {path} does not exist",
            hint=f"fix models.<name>.datasets.{split}.path (relative to the model's dir)",
        )
    # sizes come from the zip directory and the array headers: a bomb or a lying header is refused unread
    check_array_file(path, [*(i.name for i in spec.inputs), source.labels], context=f"dataset {split}: ")
    try:
        loaded = np.load(path, allow_pickle=False)
    except Exception as exc:  # zip, pickle and format errors all mean the same to the user
        raise _unreadable(split, path, None, exc) from exc
    files: dict[str, np.ndarray | None]  # None: read from the .npz on access
    if isinstance(loaded, np.ndarray):
        if len(spec.inputs) != 1:
            raise InputError(
                f"dataset {split}: {path} is one .npy array but the model has {len(spec.inputs)} inputs",
                hint="use an .npz keyed by input name",
            )
        files = {spec.inputs[0].name: loaded}
    else:
        files = dict.fromkeys(loaded.files)
    missing = [i.name for i in spec.inputs if i.name not in files]
    if missing:
        raise InputError(
            f"dataset {split}: {path} has no arrays for inputs {missing} (keys: {sorted(files)})",
            hint="key the .npz by the model's input names",
        )

    def read(key: str) -> np.ndarray:
        try:  # an .npz reads each array on access: an object array fails here, by key
            held = files[key]
            return held if held is not None else loaded[key]
        except Exception as exc:
            raise _unreadable(split, path, key, exc) from exc

    out = {i.name: _numeric(read(i.name), i.dtype, split, path, i.name) for i in spec.inputs}
    if source.labels in files:
        out[LABELS] = _labels(read(source.labels), split, path, source.labels)
    if source.take is not None:
        out = {k: v[: source.take] for k, v in out.items()}
    return out


def _unreadable(split: str, path: Path, key: str | None, exc: Exception) -> InputError:
    where = f"{path} key {key!r}" if key else str(path)
    pickled = "allow_pickle" in str(exc)
    detail = (
        "holds an object (pickled) array, which is never loaded"
        if pickled
        else f"is not a readable .npy/.npz ({type(exc).__name__}: {exc})"
    )
    return InputError(
        f"dataset {split}: {where} {detail}",
        hint="re-save it with numpy.save / numpy.savez: numeric arrays, no objects or strings",
    )


def _numeric(arr: np.ndarray, dtype: str, split: str, path: Path, key: str) -> np.ndarray:
    """A real numeric array with a sample axis (the cast to ``dtype`` comes with preprocessing)."""
    if arr.ndim == 0:
        raise InputError(
            f"dataset {split}: {path} key {key!r} is a 0-d array (a single {arr.dtype} value), "
            f"expected samples of {dtype} stacked on a first axis",
            hint="save an array of shape (samples, *sample_shape), e.g. value[None] for one sample",
        )
    if arr.dtype.kind not in "biuf":
        raise InputError(
            f"dataset {split}: {path} key {key!r} holds {_kind(arr)} values, expected numbers castable to {dtype}",
            hint=f"convert it before saving, e.g. numpy.asarray(values, dtype='{dtype}')",
        )
    return arr


def _labels(arr: np.ndarray, split: str, path: Path, key: str) -> np.ndarray:
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        got = f"{_kind(arr)} values of shape {arr.shape}" if arr.dtype.kind not in "iu" else f"shape {arr.shape}"
        raise InputError(
            f"dataset {split}: {path} key {key!r} holds {got}, expected integer class indices, one per sample",
            hint="save the labels as a 1-d integer array (e.g. labels.astype('int64')); "
            "map class names to their output index first",
        )
    if len(arr) and int(arr.min()) < 0:
        raise InputError(
            f"dataset {split}: {path} key {key!r} has a negative class index at sample {int(arr.argmin())}",
            hint="class indices are output positions, 0 and up",
        )
    if len(arr) and int(arr.max()) > MAX_CLASS_INDEX:  # compared as Python ints: uint64 never wraps to negative
        raise InputError(
            f"dataset {split}: {path} key {key!r} holds {int(arr.max())} at sample {int(arr.argmax())}, above "
            f"{MAX_CLASS_INDEX}, the largest class index",
            hint="class indices are output positions, 0 and up: map class ids to their output index first",
        )
    return arr.astype("int64")


def _kind(arr: np.ndarray) -> str:
    names = {
        "U": "string",
        "S": "bytes",
        "O": "object",
        "c": "complex",
        "V": "structured/void",
        "M": "datetime",
        "m": "timedelta",
        "b": "bool",
    }
    return f"{names.get(arr.dtype.kind, arr.dtype.kind)} ({arr.dtype})" if arr.dtype.kind in names else str(arr.dtype)


def check_finite(arrays: Arrays, split: str, origin: str, allow: bool = False) -> None:
    """Refuse NaN/Inf inputs: name the source, the key and the first sample holding one.

    ``allow`` (datasets.<split>.allow_non_finite) lets a golden or hard-tail set test a model
    that handles them; calibration and evaluation never hold them (config refuses the flag).
    """
    import numpy as np

    if allow:
        return
    for key, arr in arrays.items():
        if key in TARGET_KEYS or arr.dtype.kind not in "fc" or arr.size == 0:
            continue
        bad = ~np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)
        if bad.any():
            first = int(np.argmax(bad))
            sample = arr[first]
            what = "NaN" if np.isnan(sample).any() else "Inf"
            optin = (
                ""
                if split in ("calibration", "evaluation")
                else f", or set datasets.{split}.allow_non_finite: true if the model is meant to handle them"
            )
            raise InputError(
                f"dataset {split}: {origin} key {key!r} has NaN/Inf values in {int(bad.sum())} of "
                f"{len(arr)} samples (first: sample {first}, {what})",
                hint=f"drop or fix those samples{optin}",
            )


def check_range(spec: ModelSpec, arrays: Arrays, split: str, origin: str) -> None:
    """Refuse values outside an input's declared ``range`` (model-input space, after preprocessing):
    calibration ranges taken over them would not be the ones the model was declared for."""
    import numpy as np

    for inp in spec.inputs:
        if inp.range is None or inp.dtype == "bool" or inp.name not in arrays or arrays[inp.name].size == 0:
            continue
        lo, hi = inp.range
        arr = arrays[inp.name]
        with np.errstate(over="ignore"):  # compared in the input's dtype: float32(0.3) is inside [0, 0.3]
            low_end, high_end = np.asarray(lo).astype(arr.dtype), np.asarray(hi).astype(arr.dtype)
        outside = int(((arr < low_end) | (arr > high_end)).sum())
        if outside:
            low, high = min(lo, float(arr.min())), max(hi, float(arr.max()))
            index = spec.inputs.index(inp)
            raise InputError(
                f"dataset {split}: {origin} key {inp.name!r} has {outside} of {arr.size} values outside "
                f"the declared range [{lo!r}, {hi!r}] (min {float(arr.min())!r}, max {float(arr.max())!r})",
                hint=f"widen models.<name>.inputs[{index}].range to [{low!r}, {high!r}] if the model is meant "
                f"for such inputs, or fix the data (calibration ranges are taken over this set)",
            )


def check_dataset(spec: ModelSpec, arrays: Arrays, pins: dict[str, int], split: str, raw: bool) -> int:
    """Check sample shapes and counts against the spec; return the sample count."""
    import numpy as np

    counts = {k: len(v) for k, v in arrays.items() if k not in FLAT_KEYS}
    if len(set(counts.values())) > 1:
        raise InputError(
            f"dataset {split}: arrays have different sample counts {counts}",
            hint="give every array the same first dimension",
        )
    n = next(iter(counts.values()))
    if n == 0:
        raise InputError(f"dataset {split} is empty", hint="give at least one sample (or use 'generate')")
    for inp in spec.inputs:
        want = sample_shape(spec, inp.name, pins)
        got = tuple(arrays[inp.name].shape[1:])
        if got != want:
            raise InputError(
                f"dataset {split}: input {inp.name!r} samples have shape {got}, the spec needs {want}",
                hint="samples are stacked on a first axis; the batch axis is left out of each sample",
            )
        if not raw and not np.can_cast(arrays[inp.name].dtype, inp.dtype, casting="same_kind"):
            raise InputError(
                f"dataset {split}: input {inp.name!r} is {arrays[inp.name].dtype}, the model takes {inp.dtype}",
                hint="save it with the model's dtype",
            )
    return n


@dataclass(frozen=True)
class Classes:
    """The classes a top1_accuracy metric reads: its output and the output's size per sample."""

    output: str
    count: int

    def describe(self) -> str:
        return f"output {self.output!r} has {self.count} classes (0..{self.count - 1})"

    def hint(self) -> str:
        return (
            "a label is the position of its class in the metric's output: fix the label, or point "
            "models.<name>.metric.output at the output that scores the classes"
        )


def check_classes(arrays: Arrays, classes: Classes, split: str, origin: str, key: str) -> None:
    """Refuse an integer label past the metric output's classes: its top-1 could never be right."""
    labels = arrays.get(LABELS)
    if labels is None or not len(labels) or int(labels.max()) < classes.count:
        return
    first = int((labels >= classes.count).argmax())
    raise InputError(
        f"dataset {split}: {origin} key {key!r} holds the label {int(labels[first])} at sample {first}, but the "
        f"metric's {classes.describe()}",
        hint=classes.hint(),
    )


def _lossless(source: np.dtype, target: np.dtype) -> bool:
    """Whether every value of ``source`` casts to ``target`` unchanged; a float narrowed to a smaller
    float counts as lossless (it rounds as floats do, and an overflow to Inf is check_finite's)."""
    import numpy as np

    if source == target or (source.kind == "f" and target.kind == "f"):
        return True
    if source.kind in "biu" and target.kind == "f":  # integers up to 2**(mantissa + 1) are exact
        bits = 1 if source.kind == "b" else np.iinfo(source).bits - (source.kind == "i")
        return bits <= np.finfo(target).nmant + 1
    return source.kind in "biu" and target.kind in "biu" and bool(np.can_cast(source, target, "safe"))


def check_cast(spec: ModelSpec, raw: Arrays, inputs: Arrays, split: str, origin: str) -> None:
    """Refuse a cast by ``preprocess`` that changes a value: an integer the input's float dtype cannot
    hold exactly (float32: beyond 2**24), a fraction or an out-of-range value for an integer input,
    anything but 0 and 1 for a bool one. ``inputs`` are ``raw`` preprocessed."""
    import numpy as np

    for index, inp in enumerate(spec.inputs):
        source, cast = raw[inp.name], inputs[inp.name]
        where = origin
        affine = spec.affine(inp.name)
        if affine is not None and cast.dtype.kind != "f":  # the cast follows the transform: check its result
            with np.errstate(over="ignore", invalid="ignore"):
                source = source.astype("float64") * affine.scale + affine.offset
            where = f"{origin} after preprocessing"
        if source.size == 0 or _lossless(source.dtype, cast.dtype):
            continue
        with np.errstate(over="ignore", invalid="ignore"):
            changed = (cast.astype(source.dtype) != source).reshape(-1)
        if not changed.any():
            continue
        first = int(changed.argmax())
        value, became = source.reshape(-1)[first].item(), cast.reshape(-1)[first].item()
        sample = first // (source.size // len(source))
        raise InputError(
            f"dataset {split}: {where} key {inp.name!r} holds {value!r} at sample {sample}, "
            f"which {cast.dtype} cannot hold exactly: the cast to the input's dtype would make it {became!r} "
            f"({int(changed.sum())} of {source.size} values would change)",
            hint=f"save values {cast.dtype} holds exactly ({_holds(cast.dtype)}), or declare "
            f"models.<name>.inputs[{index}].dtype as the model takes it (a dataset of the declared dtype is kept "
            "as it is); only a cast that changes no value passes",
        )


def _holds(dtype: np.dtype) -> str:
    import numpy as np

    if dtype.kind == "f":
        return f"integers up to 2**{np.finfo(dtype).nmant + 1}"
    if dtype.kind == "b":
        return "0 and 1"
    info = np.iinfo(dtype)
    return f"whole numbers from {info.min} to {info.max}"


def preprocess(spec: ModelSpec, raw: Arrays) -> Arrays:
    """Raw samples to model inputs: the declared affine transform, then the input dtype.

    An overflow to Inf is left for ``check_finite`` to name, not warned about here."""
    import numpy as np

    out = {}
    for inp in spec.inputs:
        arr = raw[inp.name]
        affine = spec.affine(inp.name)
        with np.errstate(over="ignore", invalid="ignore"):
            if affine is not None:
                arr = arr.astype("float64") * affine.scale + affine.offset
            out[inp.name] = arr.astype(inp.dtype)
    if LABELS in raw:
        out[LABELS] = raw[LABELS]
    return out


def iter_batches(arrays: Arrays, input_batch_index: dict[str, int | None], batch: int) -> Iterator[tuple[int, Arrays]]:
    """Yield (real sample count, feeds) in batches of ``batch``; the last is padded by repetition.

    Inputs without the batch axis force one sample per call (the batch axis, if any, is filled
    with copies of that sample).
    """
    import numpy as np

    names = list(input_batch_index)
    n = len(arrays[names[0]])
    step = batch if all(i is not None for i in input_batch_index.values()) else 1
    for start in range(0, n, step):
        real = min(step, n - start)
        idx = list(range(start, start + real)) + [start + real - 1] * (batch - real)
        yield (
            real,
            {
                name: np.asarray(arrays[name][start]) if bi is None else np.moveaxis(arrays[name][idx], 0, bi)
                for name, bi in input_batch_index.items()
            },
        )


def run_dataset(
    infer: Callable[[Arrays], Arrays],
    arrays: Arrays,
    input_batch_index: dict[str, int | None],
    output_batch_index: dict[str, int | None],
    batch: int,
    progress: Callable[[str, float], None] | None = None,
    label: str = "",
) -> Arrays:
    """Run every sample through ``infer``; outputs come back with a leading sample axis."""
    import numpy as np

    if batch > 1 and all(i is not None for i in input_batch_index.values()):
        unbatched = [o for o, i in output_batch_index.items() if i is None]
        if unbatched:
            raise InputError(
                f"outputs {unbatched} have no batch axis, so batched samples cannot be split apart",
                hint="run at batch 1: set models.<name>.pins.<batch axis>: 1 (and the SKU's shapes)",
            )
    n = len(next(iter(arrays.values())))
    results: dict[str, list[np.ndarray]] = {}
    done = 0
    for i, (real, feeds) in enumerate(iter_batches(arrays, input_batch_index, batch)):
        for name, value in infer(feeds).items():
            bo = output_batch_index.get(name)
            value = np.asarray(value)
            results.setdefault(name, []).append(np.moveaxis(value, bo, 0)[:real] if bo is not None else value[None])
        done += real
        if progress is not None and i % 16 == 0:
            progress(label, done / n)
    return {k: np.concatenate(v) for k, v in results.items()}
