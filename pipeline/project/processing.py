"""Raw files to one model input, through the steps params.yaml declares (``FilePreprocessing``).

Every step runs in a real library, never re-derived by hand, so that the training side and the
device side can each be reproduced exactly and compared: Pillow or OpenCV decode, convert the colour
order and resize images; scipy.io.wavfile reads WAV clips; numpy does the layout, the per-channel
normalisation and the cast.

Order (PREPROCESSING_STEPS): decode, color, resize, layout, normalize, dtype.

- decode: in ``decode_library`` (default ``library``), each library's natural order: Pillow gives
  RGB, or "L" for a grayscale file (every other mode, palette and alpha included, is converted to
  RGB by Pillow); OpenCV's imdecode gives BGR. 8-bit values. When color and resize run in another
  library, the decoded image is handed over in that library's natural order (cv2.cvtColor swaps
  RGB and BGR; a 2-D gray array from Pillow both libraries take as it is). Audio: the WAV's own
  sample values (int16 stay -32768..32767: normalise to scale them), mono only (a multi-channel
  clip is refused, never silently averaged).
- color: the library's own converter (Image.convert, cv2.cvtColor); bgr from Pillow is its RGB with
  the channels reversed.
- resize: the library's own resize (Image.resize with Resampling.*, cv2.resize with INTER_*):
  Pillow filters when it downscales, OpenCV does not (INTER_AREA averages); keep_aspect scales to fit
  and pads centred with pad_value. Audio: ``length`` pads with zeros or trims at the end.
- layout: chw or hwc (a gray image gets its channel axis here).
- normalize: (x - mean) / std per channel, in float64.
- dtype: the model input's dtype (floats rounded and clipped to an integer dtype's range).

Every image's header is read by Pillow first, whichever library decodes it: larger than
MAX_IMAGE_PIXELS (a decompression bomb), more than 8 bits per channel, or a header Pillow cannot
read (PNG, JPEG and BMP it always can) is refused before any pixel is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.limits import MAX_IMAGE_PIXELS
from pipeline.project.config import PREPROCESSING_STEPS, FilePreprocessing, resize_problem

if TYPE_CHECKING:
    import numpy as np
    import PIL.Image

# Decompression bombs (MAX_IMAGE_PIXELS, pipeline/core/limits.py): a 64 Mpx image is 192 MiB as
# 8-bit RGB and 1.5 GiB once normalised to float64; a few lines of PNG can claim far more.

# the steps an image library runs (the rest run in numpy): decode in the decode library, the
# others in the transform library (``library``)
LIBRARY_STEPS: tuple[str, ...] = ("decode", "color", "resize")

_PILLOW_RESAMPLING = {
    "nearest": "NEAREST",
    "bilinear": "BILINEAR",
    "bicubic": "BICUBIC",
    "area": "BOX",  # Pillow's box filter: each output pixel the mean of the input pixels it covers
    "lanczos": "LANCZOS",
}
_OPENCV_INTER = {
    "nearest": "INTER_NEAREST",
    "bilinear": "INTER_LINEAR",
    "bicubic": "INTER_CUBIC",
    "area": "INTER_AREA",
    "lanczos": "INTER_LANCZOS4",
}
_GRAY_MODES = ("1", "LA", "La")  # Pillow modes whose natural 8-bit form is "L"; the rest become RGB
_IMAGE_HINT = "re-save the file as a PNG, JPEG or BMP (8-bit), or remove it from the dataset"


class Preprocessor:
    """One input's declared steps, ready to run: ``decode`` a file's bytes, ``transform`` one decoded
    sample to the model's layout and dtype, or call it on a batch of files. Settings are resolved once
    here, so a call does only the library work (the end-to-end benchmark times it)."""

    def __init__(self, steps: FilePreprocessing, dtype: str):
        import numpy as np

        self.steps = steps
        self.dtype = np.dtype(dtype)
        self._image = steps.decode == "image"
        self._mean: np.ndarray | None = None
        self._std: np.ndarray | None = None
        if steps.normalize is not None:
            shape: tuple[int, ...] = (-1,)
            if self._image:
                shape = (-1, 1, 1) if steps.layout == "chw" else (1, 1, -1)
            self._mean = np.asarray(steps.normalize.mean, dtype=np.float64).reshape(shape)
            self._std = np.asarray(steps.normalize.std, dtype=np.float64).reshape(shape)
        self._resample: Any = None
        # the decode library's natural order to the transform library's (only when they differ)
        self._handoff: int | None = None
        if self._image and steps.decoder != steps.library:
            import cv2

            self._handoff = cv2.COLOR_RGB2BGR if steps.library == "opencv" else cv2.COLOR_BGR2RGB
        if self._image and steps.library == "pillow":
            from PIL import Image

            if steps.resize is not None:
                self._resample = getattr(Image.Resampling, _PILLOW_RESAMPLING[steps.resize.interpolation])
        elif self._image:
            import cv2

            if steps.resize is not None:
                self._resample = getattr(cv2, _OPENCV_INTER[steps.resize.interpolation])
        self._round = self.dtype.kind in "iub"

    def decode(self, blob: bytes, name: str) -> np.ndarray:
        """A file's bytes decoded by the decode library, in the natural order of the library that
        transforms it: Pillow RGB (HxWx3) or L (HxW), OpenCV BGR (HxWx3); audio the WAV's samples
        (1-d). InputError naming the file when it does not decode."""
        if not self._image:
            return self._decode_wav(blob, name)
        if self.steps.decoder == "pillow":
            arr = self._decode_pillow(blob, name)
        else:
            _probe(blob, name, "opencv")  # OpenCV decodes only what Pillow's header check let through
            arr = self._decode_opencv(blob, name)
        if self._handoff is not None and arr.ndim == 3:
            import cv2

            arr = cv2.cvtColor(arr, self._handoff)
        return arr

    def transform(self, decoded: np.ndarray) -> np.ndarray:
        """One decoded sample through color, resize, layout, normalize and dtype: the model input's
        sample (no batch axis)."""
        if self._image:
            arr = (
                self._color_resize_pillow(decoded) if self.steps.library == "pillow" else self._color_resize_cv(decoded)
            )
            arr = self._layout(arr)
        else:
            arr = self._length(decoded)
        return self._normalize_cast(arr)

    def __call__(self, blobs: Sequence[bytes], names: Sequence[str]) -> np.ndarray:
        """The files' samples stacked on a first axis. InputError when their shapes differ (no resize
        or length declared and files of different sizes)."""
        import numpy as np

        samples = [self.transform(self.decode(blob, name)) for blob, name in zip(blobs, names, strict=True)]
        if not samples:
            return np.empty((0,), dtype=self.dtype)
        first = samples[0].shape
        for name, sample in zip(names, samples, strict=True):
            if sample.shape != first:
                what = "resize.size" if self._image else "length"
                raise InputError(
                    f"file {name!r} gives a sample of shape {list(sample.shape)}, {names[0]!r} one of "
                    f"{list(first)}: the files differ in size",
                    hint=f"declare preprocess.<input>.{what} so every file gives the model input's shape",
                )
        return np.stack(samples)

    # decode

    def _decode_pillow(self, blob: bytes, name: str) -> np.ndarray:
        import numpy as np
        from PIL import Image

        img = _probe(blob, name, "pillow")
        assert img is not None
        try:
            with img:
                img.load()
                if img.mode not in ("RGB", "L"):
                    img = img.convert("L" if img.mode in _GRAY_MODES else "RGB")
                return np.asarray(img)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise _undecodable(name, "Pillow", exc) from exc

    def _decode_opencv(self, blob: bytes, name: str) -> np.ndarray:
        import cv2
        import numpy as np

        try:
            arr = cv2.imdecode(np.frombuffer(blob, dtype=np.uint8), cv2.IMREAD_COLOR)
        except cv2.error as exc:
            raise _undecodable(name, "OpenCV", exc) from exc
        if arr is None:
            raise _undecodable(name, "OpenCV", "cv2.imdecode returned nothing (damaged, truncated or unknown format)")
        return arr

    def _decode_wav(self, blob: bytes, name: str) -> np.ndarray:
        import io
        import struct
        import warnings

        from scipy.io import wavfile

        hint = "re-save it as PCM or float WAV (or copy it again if it was cut short), or remove it from the dataset"
        problem = _wav_problem(blob)
        if problem is not None:
            raise InputError(f"file {name!r} is not a readable WAV file: {problem}", hint=hint)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", wavfile.WavFileWarning)  # unknown chunks (LIST, ...) are skipped
                rate, data = wavfile.read(io.BytesIO(blob))
        except (ValueError, OSError, EOFError, IndexError, struct.error) as exc:
            raise InputError(f"file {name!r} is not a readable WAV file (scipy.io.wavfile: {exc})", hint=hint) from exc
        want = self.steps.sample_rate
        if want is not None and rate != want:
            raise InputError(
                f"file {name!r} is sampled at {rate} Hz; the model takes {want} Hz (preprocess.<input>.sample_rate)",
                hint=f"resample the clip to {want} Hz before adding it (e.g. with sox or ffmpeg); "
                "clips are never resampled here",
            )
        if data.ndim == 2:
            if data.shape[1] != 1:
                raise InputError(
                    f"file {name!r} has {data.shape[1]} channels; the model takes one (mono)",
                    hint="mix the clip down to mono before adding it (e.g. sox in.wav -c 1 out.wav): "
                    "channels are never averaged here",
                )
            data = data[:, 0]
        return data

    # color and resize, in the declared library

    def _color_resize_pillow(self, arr: np.ndarray) -> np.ndarray:
        import numpy as np
        from PIL import Image

        img = Image.fromarray(arr)
        color = self.steps.color
        mode = "L" if color == "gray" else "RGB"
        if img.mode != mode:
            img = img.convert(mode)
        resize = self.steps.resize
        if resize is None:
            out = np.asarray(img)
        else:
            h, w = resize.size
            if resize.keep_aspect:
                fit_h, fit_w = _fit(img.height, img.width, h, w)
                out = _pad(np.asarray(img.resize((fit_w, fit_h), self._resample)), h, w, resize.pad_value)
            else:
                out = np.asarray(img.resize((w, h), self._resample))
        # the resize works per channel: reversing after it equals reversing before, with one copy less
        return out[..., ::-1] if color == "bgr" else out

    def _color_resize_cv(self, arr: np.ndarray) -> np.ndarray:
        import cv2

        color = self.steps.color
        if arr.ndim == 3:  # imdecode's BGR
            if color == "rgb":
                arr = cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
            elif color == "gray":
                arr = cv2.cvtColor(arr, cv2.COLOR_BGR2GRAY)
        elif color != "gray":  # a gray array handed to transform
            arr = cv2.cvtColor(arr, cv2.COLOR_GRAY2RGB if color == "rgb" else cv2.COLOR_GRAY2BGR)
        resize = self.steps.resize
        if resize is None:
            return arr
        h, w = resize.size
        if resize.keep_aspect:
            fit_h, fit_w = _fit(arr.shape[0], arr.shape[1], h, w)
            return _pad(cv2.resize(arr, (fit_w, fit_h), interpolation=self._resample), h, w, resize.pad_value)
        return cv2.resize(arr, (w, h), interpolation=self._resample)

    # the numpy steps

    def _layout(self, arr: np.ndarray) -> np.ndarray:
        if arr.ndim == 2:
            return arr[None] if self.steps.layout == "chw" else arr[..., None]
        return arr.transpose(2, 0, 1) if self.steps.layout == "chw" else arr

    def _length(self, arr: np.ndarray) -> np.ndarray:
        import numpy as np

        n = self.steps.length
        if n is None or len(arr) == n:
            return arr
        if len(arr) > n:
            return arr[:n]
        return np.pad(arr, (0, n - len(arr)))

    def _normalize_cast(self, arr: np.ndarray) -> np.ndarray:
        import numpy as np

        if self._mean is not None and self._std is not None:
            arr = (arr.astype(np.float64) - self._mean) / self._std
        if self._round and arr.dtype.kind == "f":
            if self.dtype.kind == "b":
                return arr != 0
            info = np.iinfo(self.dtype)
            arr = np.clip(np.rint(arr), info.min, info.max)
        return np.ascontiguousarray(arr, dtype=self.dtype)


def _wav_problem(blob: bytes) -> str | None:
    """What is wrong with a WAV file's chunks, read from their headers before scipy reads a sample: the
    file ends inside a chunk header, or a chunk up to the data (fmt, data, any before them) declares
    more bytes than the file holds after it (cut short, or a header that lies: scipy would read what is
    there and say nothing), or there is no data chunk. None when they hold, or for a file that is not
    RIFF/RIFX/RF64 WAVE at all (scipy says what it is)."""
    import struct

    form = blob[:4]
    if len(blob) < 12 or form not in (b"RIFF", b"RIFX", b"RF64") or blob[8:12] != b"WAVE":
        return None
    order = ">" if form == b"RIFX" else "<"
    data_size = None  # RF64: the data chunk's size is in ds64 (its own reads 0xFFFFFFFF)
    at = 12
    while at < len(blob):
        if at + 8 > len(blob):
            return f"the file ends inside a chunk header at byte {at} of {len(blob)} (cut short)"
        chunk = blob[at : at + 4]
        (size,) = struct.unpack(order + "I", blob[at + 4 : at + 8])
        if chunk == b"ds64" and size >= 16 and at + 24 <= len(blob):
            (data_size,) = struct.unpack("<Q", blob[at + 16 : at + 24])
        if chunk == b"data" and form == b"RF64" and data_size is not None:
            size = data_size
        left = len(blob) - at - 8
        if size > left:
            return (
                f"its {chunk.decode('latin-1')!r} chunk at byte {at} declares {size} bytes, but only {left} follow "
                "its header (the file is cut short, or its header claims more than it holds)"
            )
        if chunk == b"data":
            return None
        at += 8 + size + (size & 1)  # chunks are word-aligned
    return "it has no 'data' chunk (no samples)"


def _probe(blob: bytes, name: str, library: str) -> PIL.Image.Image | None:
    """The file opened by Pillow, header only (no pixel is decoded): refused when Pillow cannot read
    the header (PNG, JPEG and BMP it always can, so OpenCV never meets a format only it knows), above
    MAX_IMAGE_PIXELS or with more than 8 bits per channel. The open image for Pillow to decode; None
    for OpenCV (which then decodes the bytes itself)."""
    import io

    from PIL import Image

    try:
        img = Image.open(io.BytesIO(blob))
    except Image.DecompressionBombError as exc:
        raise _bomb(name, str(exc)) from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise _undecodable(
            name, "Pillow" if library == "pillow" else "OpenCV (its header read by Pillow first)", exc
        ) from exc
    width, height = img.size
    if width * height > MAX_IMAGE_PIXELS:
        img.close()
        raise _bomb(name, f"its header declares {width}x{height} = {width * height} pixels")
    if img.mode.startswith(("I", "F")):
        img.close()
        raise InputError(
            f"file {name!r} has {img.mode!r} pixels (16 or 32 bits per channel); images are read as 8-bit",
            hint="convert it to an 8-bit PNG, JPEG or BMP before adding it",
        )
    if library == "pillow":
        return img
    img.close()
    return None


def _bomb(name: str, detail: str) -> InputError:
    return InputError(
        f"file {name!r} is refused unread: {detail}, above the limit of {MAX_IMAGE_PIXELS} pixels "
        "(a decompression bomb, or an image far larger than any model input)",
        hint="downscale the image before adding it to the dataset",
    )


def _undecodable(name: str, library: str, exc: BaseException | str) -> InputError:
    detail = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return InputError(f"file {name!r} does not decode as an image in {library} ({detail})", hint=_IMAGE_HINT)


def _fit(height: int, width: int, h: int, w: int) -> tuple[int, int]:
    """The size (height, width) that fits inside (h, w) at the image's aspect ratio."""
    scale = min(h / height, w / width)
    return min(h, max(1, round(height * scale))), min(w, max(1, round(width * scale)))


def _pad(arr: np.ndarray, h: int, w: int, value: float) -> np.ndarray:
    """``arr`` centred on an (h, w) canvas of ``value`` (float64 when ``value`` is not a whole number)."""
    import numpy as np

    dtype = arr.dtype if float(value).is_integer() else np.float64
    canvas = np.full((h, w, *arr.shape[2:]), value, dtype=dtype)
    top, left = (h - arr.shape[0]) // 2, (w - arr.shape[1]) // 2
    canvas[top : top + arr.shape[0], left : left + arr.shape[1]] = arr
    return canvas


def library_versions(steps: FilePreprocessing) -> dict[str, str]:
    """The versions of the libraries that compute the values: the decode library, the transform
    library (both when they differ) and numpy."""
    import numpy as np

    versions = {"numpy": np.__version__}
    for library in dict.fromkeys((steps.decoder, steps.library)):
        if library == "pillow":
            import PIL

            versions["pillow"] = PIL.__version__
        elif library == "opencv":
            import cv2

            versions["opencv"] = cv2.__version__
        else:
            import scipy

            versions["scipy"] = scipy.__version__
    return versions


def step_library(steps: FilePreprocessing, step: str) -> str:
    """The library that runs ``step``: the decode library for decode (image or audio), ``library``
    for an image's color and resize; numpy for the rest (an audio clip's length too)."""
    if step == "decode":
        return steps.decoder
    if steps.decode == "image" and step in LIBRARY_STEPS:
        return steps.library
    return "numpy"


def describe(steps: FilePreprocessing) -> dict[str, Any]:
    """Each step with its settings and the library that runs it, and the libraries' versions: what a
    manifest records so that a drift can be traced to a step and a library release."""
    settings = steps.steps()
    return {
        "steps": [{"step": s, "library": step_library(steps, s), "settings": settings[s]} for s in PREPROCESSING_STEPS],
        "versions": library_versions(steps),
    }


def differing_steps(reference: FilePreprocessing, device: FilePreprocessing) -> list[str]:
    """The steps (PREPROCESSING_STEPS order) whose settings differ between two declarations. Each
    step's settings carry the library that runs it (FilePreprocessing.steps): decode differs with
    the decode library, color and resize with the transform library (``library``; an image without
    resize has no resize to differ)."""
    ref, dev = reference.steps(), device.steps()
    return [s for s in PREPROCESSING_STEPS if ref[s] != dev[s]]


def with_step(reference: FilePreprocessing, device: FilePreprocessing, step: str) -> FilePreprocessing:
    """``reference`` with only ``step``'s settings taken from ``device``: the input a drift check
    compares with the reference's to attribute a drift to that one step.

    The rule for the libraries: each goes with the step it runs. The ``decode`` variant takes the
    device's decode library (and decode kind and sample rate) and keeps the reference's transform
    library, so it measures decoding alone (a PNG decodes to the same pixels in Pillow and OpenCV).
    The ``color`` and ``resize`` variants take the device's setting for that step and the device's
    transform library (``library``), keeping the reference's decode library. Color and resize share
    the transform library, so a swap of it is seen in both variants (the one whose operation the
    libraries do differently moves the input). Where the device's library cannot honour the
    reference's ``resize.antialias`` (the ``color`` variant keeps the reference's resize), the
    variant sets it to null (the library's own behaviour), which is what the swap means. A
    combination that is still not valid (e.g. a colour change that alters the channel count under
    a per-channel normalisation) is a ConfigError: that step cannot be isolated.
    """
    if step not in PREPROCESSING_STEPS:
        raise ValueError(f"unknown preprocessing step {step!r} (steps: {', '.join(PREPROCESSING_STEPS)})")
    merged = reference.model_dump()
    dev = device.model_dump()
    keys = {
        "decode": ("decode", "sample_rate"),
        "color": ("color", "library"),
        "resize": ("resize", "length", "library"),
        "layout": ("layout",),
        "normalize": ("normalize",),
        "dtype": (),
    }[step]
    for key in keys:
        merged[key] = dev[key]
    decoder = device.decoder if step == "decode" else reference.decoder
    merged["decode_library"] = None if decoder == merged["library"] else decoder
    if step == "color" and reference.resize is not None and resize_problem(device.library, reference.resize):
        merged["resize"] = {**merged["resize"], "antialias": None}
    try:
        return FilePreprocessing.model_validate(merged)
    except ValueError as exc:
        raise ConfigError(
            f"preprocessing step {step!r} cannot be isolated: the reference's steps with only the device's "
            f"{step} settings are not valid ({exc})",
            hint="compare the device's preprocessing as a whole for this step, or make the settings agree",
        ) from exc
