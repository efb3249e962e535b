"""Declared preprocessing from raw files (real Pillow, OpenCV, scipy) and the files dataset."""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy.io import wavfile

from pipeline.core.errors import ConfigError, InputError, MalformedFile
from pipeline.core.limits import MAX_IMAGE_PIXELS
from pipeline.project.config import DevicePreprocessing, FilePreprocessing, device_preprocessing
from pipeline.project.files import LABELS, pack, read_files_dataset, unpack
from pipeline.project.processing import (
    Preprocessor,
    describe,
    differing_steps,
    library_versions,
    with_step,
)

LIBS = ("pillow", "opencv")


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def wav(data: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    wavfile.write(buf, rate, data)
    return buf.getvalue()


def steps(**kw) -> FilePreprocessing:
    return FilePreprocessing.model_validate({"decode": "image", **kw})


def run(blob: bytes, dtype: str = "float64", name: str = "x.png", **kw) -> np.ndarray:
    return Preprocessor(steps(**kw), dtype)([blob], [name])[0]


@pytest.fixture(scope="module")
def noise() -> np.ndarray:
    """High-frequency content: where an antialiasing filter and point sampling part ways."""
    return np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)


# decode and colour


@pytest.mark.parametrize("library", LIBS)
def test_decode_is_the_png_exactly_in_rgb_and_reversed_in_bgr(noise, library):
    blob = png(noise)
    rgb = run(blob, "uint8", library=library, layout="hwc")
    bgr = run(blob, "uint8", library=library, layout="hwc", color="bgr")
    np.testing.assert_array_equal(rgb, noise)
    np.testing.assert_array_equal(bgr, noise[..., ::-1])


def test_natural_order_of_each_library(noise):
    blob = png(noise)
    np.testing.assert_array_equal(Preprocessor(steps(library="pillow"), "uint8").decode(blob, "a.png"), noise)
    np.testing.assert_array_equal(
        Preprocessor(steps(library="opencv"), "uint8").decode(blob, "a.png"), noise[..., ::-1]
    )


def test_gray_conversions_agree_within_rounding(noise):
    blob = png(noise)
    pil = run(blob, "int64", library="pillow", color="gray", layout="hwc")
    cv = run(blob, "int64", library="opencv", color="gray", layout="hwc")
    assert pil.shape == cv.shape == (64, 96, 1)
    luma = noise.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    assert np.abs(pil[..., 0] - luma).max() <= 1
    assert np.abs(cv[..., 0] - luma).max() <= 1
    assert np.abs(pil - cv).max() <= 1


@pytest.mark.parametrize("library", LIBS)
def test_a_grayscale_file_becomes_rgb_or_stays_gray(library):
    gray = np.arange(48, dtype=np.uint8).reshape(6, 8) * 5
    blob = png(gray)
    np.testing.assert_array_equal(run(blob, "uint8", library=library, color="gray", layout="hwc")[..., 0], gray)
    rgb = run(blob, "uint8", library=library, layout="chw")
    assert rgb.shape == (3, 6, 8)
    for c in range(3):
        np.testing.assert_array_equal(rgb[c], gray)


# resize


def test_bilinear_downscale_pillow_filters_and_opencv_samples(noise):
    blob = png(noise)
    size = {"size": (16, 24)}
    pil = run(blob, library="pillow", resize={**size, "interpolation": "bilinear"}, layout="hwc")
    cv = run(blob, library="opencv", resize={**size, "interpolation": "bilinear"}, layout="hwc")
    block = noise.reshape(16, 4, 24, 4, 3).mean(axis=(1, 3))  # the 4x4 means an area resize gives
    assert pil.shape == cv.shape == (16, 24, 3)
    assert np.abs(pil - cv).max() > 20  # the two libraries do not agree on a downscale
    # Pillow's antialiased bilinear stays near the local means; OpenCV's samples 2x2 of each 4x4 block
    assert np.abs(pil - block).mean() < np.abs(cv - block).mean() / 2


def test_area_downscale_is_the_block_mean_in_both_libraries(noise):
    blob = png(noise)
    resize = {"size": (16, 24), "interpolation": "area"}
    block = noise.reshape(16, 4, 24, 4, 3).mean(axis=(1, 3))
    outs = [run(blob, library=library, resize=resize, layout="hwc") for library in LIBS]
    for out in outs:  # each rounds to uint8 in its own fixed-point arithmetic
        assert np.abs(out - block).max() <= 1
    assert np.abs(outs[0] - outs[1]).max() <= 1


@pytest.mark.parametrize("library", LIBS)
def test_keep_aspect_letterboxes_centred(library):
    wide = np.full((20, 40, 3), 200, dtype=np.uint8)
    out = run(
        png(wide),
        "uint8",
        library=library,
        layout="hwc",
        resize={"size": (32, 32), "keep_aspect": True, "pad_value": 114, "interpolation": "nearest"},
    )
    assert out.shape == (32, 32, 3)
    assert (out[:8] == 114).all() and (out[24:] == 114).all()  # 40 -> 32 wide, 20 -> 16 high, 8 rows each side
    assert (out[8:24] == 200).all()


def test_keep_aspect_pads_with_a_fractional_value_in_float():
    out = run(png(np.zeros((10, 20), dtype=np.uint8)), resize={"size": (20, 20), "keep_aspect": True, "pad_value": 0.5})
    assert out.dtype == np.float64
    assert out[0, 0, 0] == 0.5 and out[0, 10, 10] == 0.0


# layout, normalize, dtype


@pytest.mark.parametrize(
    ("color", "layout", "shape"),
    [("rgb", "chw", (3, 6, 8)), ("rgb", "hwc", (6, 8, 3)), ("gray", "chw", (1, 6, 8)), ("gray", "hwc", (6, 8, 1))],
)
def test_layout_shapes(color, layout, shape):
    out = run(png(np.zeros((6, 8, 3), dtype=np.uint8)), "float32", color=color, layout=layout)
    assert out.shape == shape and out.dtype == np.float32 and out.flags.c_contiguous


@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_normalize_per_channel(layout):
    img = np.empty((4, 5, 3), dtype=np.uint8)
    img[...] = (10, 20, 30)
    out = run(png(img), layout=layout, normalize={"mean": [10, 0, 30], "std": [1, 4, 2]})
    per_channel = out.reshape(3, -1) if layout == "chw" else out.reshape(-1, 3).T
    np.testing.assert_array_equal(per_channel[0], 0.0)
    np.testing.assert_array_equal(per_channel[1], 5.0)
    np.testing.assert_array_equal(per_channel[2], 0.0)


def test_one_normalize_value_serves_every_channel_and_cast_rounds_and_clips():
    img = np.array([[[0, 128, 255]]], dtype=np.uint8)
    out = run(png(img), "float16", layout="hwc", normalize={"mean": [127.5], "std": [127.5]})
    assert out.dtype == np.float16
    np.testing.assert_allclose(out[0, 0], [-1.0, 0.5 / 127.5, 1.0], atol=1e-3)
    clipped = run(png(img), "int8", layout="hwc", normalize={"mean": [0.0], "std": [0.5]})
    np.testing.assert_array_equal(clipped[0, 0], [0, 127, 127])  # 0, 256 and 510 clipped to int8


def test_files_of_different_sizes_without_resize_are_refused():
    pre = Preprocessor(steps(), "float32")
    with pytest.raises(InputError, match=r"'b.png'.*differ in size") as err:
        pre([png(np.zeros((4, 4, 3), np.uint8)), png(np.zeros((5, 4, 3), np.uint8))], ["a.png", "b.png"])
    assert "resize.size" in err.value.hint


# damaged files and bombs


@pytest.mark.parametrize("library", LIBS)
def test_corrupt_and_truncated_files_are_refused_naming_the_file(noise, library):
    pre = Preprocessor(steps(library=library), "float32")
    blob = png(noise)
    for bad in (b"not an image at all", blob[: len(blob) // 2]):
        with pytest.raises(InputError, match=r"file 'cat 1.png' does not decode") as err:
            pre([bad], ["cat 1.png"])
        assert "Pillow" in str(err.value) or "OpenCV" in str(err.value)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes whose header claims width x height (no pixel data)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("library", LIBS)
@pytest.mark.parametrize("size", [(9000, 8000), (100_000, 100_000)])  # under and over Pillow's own limit
def test_pixel_bomb_is_refused_from_its_header(library, size):
    blob = png_header_only(*size)
    assert len(blob) < 100 and size[0] * size[1] > MAX_IMAGE_PIXELS
    with pytest.raises(InputError, match=r"'bomb.png' is refused unread"):
        Preprocessor(steps(library=library), "float32")([blob], ["bomb.png"])


def test_opencv_decodes_only_what_pillow_reads_the_header_of():
    import cv2

    ok, pfm = cv2.imencode(".pfm", np.zeros((4, 4, 3), np.float32))  # a format OpenCV reads, Pillow not
    assert ok
    with pytest.raises(InputError, match=r"'x.png' does not decode as an image in OpenCV \(its header read by Pillow"):
        run(pfm.tobytes(), library="opencv")


def test_sixteen_bit_images_are_refused():
    deep = png(np.full((4, 4), 40000, dtype=np.uint16))
    with pytest.raises(InputError, match="8-bit"):
        run(deep)


# audio


def audio(**kw) -> Preprocessor:
    return Preprocessor(FilePreprocessing.model_validate({"decode": "audio", "library": "scipy", **kw}), "float32")


def test_wav_round_trip_pad_and_trim():
    clip = (np.sin(np.arange(1000) / 7) * 20000).astype(np.int16)
    np.testing.assert_array_equal(audio().decode(wav(clip), "a.wav"), clip)
    padded = audio(length=1200, sample_rate=16000)([wav(clip)], ["a.wav"])
    assert padded.shape == (1, 1200) and padded.dtype == np.float32
    np.testing.assert_array_equal(padded[0, :1000], clip)
    assert (padded[0, 1000:] == 0).all()
    trimmed = audio(length=300, normalize={"mean": [0], "std": [32768]})([wav(clip), wav(clip[:10])], ["a", "b"])
    assert trimmed.shape == (2, 300)
    np.testing.assert_allclose(trimmed[0], clip[:300] / 32768, rtol=1e-6)


def test_wav_rate_mismatch_stereo_and_garbage_are_refused():
    clip = np.zeros(100, dtype=np.int16)
    with pytest.raises(InputError, match=r"'a.wav' is sampled at 8000 Hz; the model takes 16000"):
        audio(sample_rate=16000)([wav(clip, 8000)], ["a.wav"])
    with pytest.raises(InputError, match=r"'s.wav' has 2 channels") as err:
        audio()([wav(np.zeros((100, 2), np.int16))], ["s.wav"])
    assert "mono" in err.value.hint
    with pytest.raises(InputError, match=r"'g.wav' is not a readable WAV"):
        audio()([b"RIFF....garbage"], ["g.wav"])


def test_a_wav_whose_chunks_claim_more_than_the_file_holds_is_refused():
    """Cut short (scipy raised struct.error: exit 70), or a data chunk claiming 4 GB over 8 bytes (scipy
    read the 8 and said nothing): refused from the chunk headers, naming the file."""
    good = wav(np.zeros(4, np.int16))
    lying = bytearray(good)
    lying[40:44] = (0xFFFFFFF0).to_bytes(4, "little")  # the data chunk's size
    cases = [
        (good[:30], r"'fmt ' chunk at byte 12 declares 16 bytes, but only 10 follow"),
        (good[:38], r"ends inside a chunk header at byte 36 of 38"),
        (good[:36], r"has no 'data' chunk"),
        (bytes(lying), r"'data' chunk at byte 36 declares 4294967280 bytes, but only 8 follow"),
    ]
    for blob, match in cases:
        with pytest.raises(InputError, match=rf"file 'a.wav' is not a readable WAV file: .*{match}"):
            audio()([blob], ["a.wav"])
    assert audio()([good], ["a.wav"]).shape == (1, 4)


# manifests and drift attribution


def test_describe_names_each_step_its_library_and_versions():
    import PIL

    desc = describe(steps(library="pillow", resize={"size": (8, 8)}))
    assert [s["step"] for s in desc["steps"]] == ["decode", "color", "resize", "layout", "normalize", "dtype"]
    assert [s["library"] for s in desc["steps"]] == ["pillow"] * 3 + ["numpy"] * 3
    assert desc["versions"] == {"pillow": PIL.__version__, "numpy": np.__version__}
    assert set(library_versions(steps(library="opencv"))) == {"opencv", "numpy"}


def test_differing_steps_and_with_step_on_a_color_swap(noise):
    ref = steps(library="pillow", resize={"size": (16, 24)})
    dev = device_preprocessing(ref, DevicePreprocessing(color="bgr"))
    assert differing_steps(ref, dev) == ["color"]
    assert differing_steps(ref, ref) == []
    only = with_step(ref, dev, "color")
    assert only == dev
    assert with_step(ref, dev, "resize") == ref  # nothing of resize differs
    blob = png(noise)
    np.testing.assert_array_equal(
        Preprocessor(only, "float32")([blob], ["a"]), Preprocessor(ref, "float32")([blob], ["a"])[:, ::-1]
    )


def test_differing_steps_and_with_step_on_a_resize_and_library_change():
    ref = steps(library="pillow", resize={"size": (16, 24), "interpolation": "bilinear", "antialias": True})
    dev = device_preprocessing(
        ref, DevicePreprocessing(library="opencv", resize={"interpolation": "area"}, layout="hwc")
    )
    # the library runs decode, color and resize: its swap counts against all three
    assert differing_steps(ref, dev) == ["decode", "color", "resize", "layout"]
    decode = with_step(ref, dev, "decode")  # the decode library alone
    assert (decode.decoder, decode.library, decode.resize) == ("opencv", "pillow", ref.resize)
    color = with_step(ref, dev, "color")  # the transform library goes with color, the reference's resize stays
    assert (color.decoder, color.library, color.color) == ("pillow", "opencv", "rgb")
    assert color.resize is not None and color.resize.interpolation == "bilinear"
    assert color.resize.antialias is None  # OpenCV cannot filter: the swap means its own behaviour
    resize = with_step(ref, dev, "resize")
    assert (resize.decoder, resize.library, resize.resize, resize.layout) == ("pillow", "opencv", dev.resize, "chw")
    assert with_step(ref, dev, "layout").layout == "hwc"


def digit_png() -> tuple[np.ndarray, bytes]:
    """An 8x8 digit-like image (ink 0..240) and its 28x28 nearest-upscaled gray PNG, as the digits example writes."""
    digit = (np.random.default_rng(3).integers(0, 17, (8, 8)) * 15).astype(np.uint8)
    big = Image.fromarray(digit).resize((28, 28), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    big.save(buf, "PNG")
    return digit, buf.getvalue()


def test_a_library_swap_is_attributed_to_resize_not_to_decode():
    digit, blob = digit_png()
    ref = steps(library="pillow", color="gray", resize={"size": (8, 8), "interpolation": "area"})
    dev = device_preprocessing(ref, DevicePreprocessing(library="opencv"))
    assert differing_steps(ref, dev) == ["decode", "color", "resize"]

    def x(s: FilePreprocessing) -> np.ndarray:
        return Preprocessor(s, "float64")([blob], ["7.png"])

    ref_x = x(ref)
    np.testing.assert_array_equal(ref_x[0, 0], digit)  # Pillow's box filter gives the digit back
    assert np.abs(x(dev) - ref_x).max() > 0
    decode = with_step(ref, dev, "decode")
    assert (decode.decoder, decode.library) == ("opencv", "pillow")
    # the gray PNG decodes to the same pixels in both libraries: decoding costs nothing
    gray = Image.open(io.BytesIO(blob))
    assert gray.mode == "L"
    opencv_decoded = Preprocessor(steps(library="opencv"), "uint8").decode(blob, "7.png")
    for c in range(3):
        np.testing.assert_array_equal(opencv_decoded[..., c], np.asarray(gray))
    assert np.abs(x(decode) - ref_x).max() == 0
    # OpenCV's INTER_AREA at a 3.5x non-integer scale is not Pillow's box filter: the resize is the step
    resize = with_step(ref, dev, "resize")
    assert (resize.decoder, resize.library) == ("pillow", "opencv")
    assert np.abs(x(resize) - ref_x).max() > 10
    # color shares the transform library, so its variant sees the same swap
    np.testing.assert_array_equal(x(with_step(ref, dev, "color")), x(resize))


@pytest.mark.parametrize(
    ("decoder", "library", "kw"),
    [
        ("opencv", "pillow", {"color": "rgb", "resize": {"size": (16, 24), "interpolation": "bilinear"}}),
        ("opencv", "pillow", {"color": "bgr", "layout": "hwc"}),
        ("opencv", "pillow", {"color": "gray", "resize": {"size": (32, 48), "interpolation": "lanczos"}}),
        ("pillow", "opencv", {"color": "rgb", "resize": {"size": (16, 24), "interpolation": "area"}}),
        ("pillow", "opencv", {"color": "bgr", "resize": {"size": (100, 50), "interpolation": "bicubic"}}),
        ("pillow", "opencv", {"color": "gray", "layout": "hwc"}),
    ],
)
@pytest.mark.parametrize("gray_file", [False, True])
def test_mixed_decode_and_transform_libraries_equal_the_transform_library_alone(noise, decoder, library, kw, gray_file):
    image = noise[..., 1] if gray_file else noise  # a gray file: Pillow decodes it 2-D ("L"), OpenCV to BGR
    blob = png(image)
    mixed = Preprocessor(steps(library=library, decode_library=decoder, **kw), "float32")
    alone = Preprocessor(steps(library=library, **kw), "float32")
    np.testing.assert_array_equal(mixed([blob], ["a.png"]), alone([blob], ["a.png"]))
    # decode hands the array over in the transform library's natural order
    natural = image if library == "pillow" or gray_file else image[..., ::-1]
    handed = mixed.decode(blob, "a.png")
    np.testing.assert_array_equal(handed if handed.ndim == image.ndim else handed[..., 0], natural)


def test_describe_lists_both_libraries_when_decoding_in_another():
    import cv2
    import PIL

    mixed = steps(library="pillow", decode_library="opencv", resize={"size": (8, 8)})
    desc = describe(mixed)
    assert [s["library"] for s in desc["steps"]] == ["opencv", "pillow", "pillow"] + ["numpy"] * 3
    assert desc["versions"] == {"numpy": np.__version__, "opencv": cv2.__version__, "pillow": PIL.__version__}
    assert desc["steps"][0]["settings"]["library"] == "opencv"
    assert desc["steps"][2]["settings"]["library"] == "pillow"
    json.dumps(desc)  # a manifest's JSON
    assert set(library_versions(steps(decode_library="pillow"))) == {"pillow", "numpy"}


def test_decode_library_alone_differs_in_decode_only():
    ref = steps(library="opencv", resize={"size": (8, 8), "interpolation": "area"})
    dev = device_preprocessing(ref, DevicePreprocessing(decode_library="pillow"))
    assert (dev.decoder, dev.library) == ("pillow", "opencv")
    assert differing_steps(ref, dev) == ["decode"]
    assert with_step(ref, dev, "decode") == dev
    assert with_step(ref, dev, "resize") == ref  # nothing of resize differs
    # a device library alone leaves the model's own decode library in place
    own = steps(library="pillow", decode_library="opencv")
    swapped = device_preprocessing(own, DevicePreprocessing(library="opencv"))
    assert (swapped.decoder, swapped.library) == ("opencv", "opencv")
    assert differing_steps(own, swapped) == ["color"]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (
            {"decode": "audio", "library": "scipy", "decode_library": "opencv"},
            "decode_library 'opencv' cannot read WAV",
        ),
        ({"decode": "image", "decode_library": "scipy"}, "decode_library scipy decodes audio only"),
    ],
)
def test_decode_library_is_validated_like_library(kw, match):
    with pytest.raises(ValueError, match=match):
        FilePreprocessing.model_validate(kw)
    assert FilePreprocessing.model_validate({"decode": "audio", "decode_library": "scipy", "library": "scipy"})


def test_with_step_refuses_a_step_that_cannot_be_isolated():
    ref = steps(normalize={"mean": [1, 2, 3], "std": [1, 1, 1]})
    dev = steps(color="gray", normalize={"mean": [2], "std": [1]})
    assert differing_steps(ref, dev) == ["color", "normalize"]
    with pytest.raises(ConfigError, match="'color' cannot be isolated"):
        with_step(ref, dev, "color")
    with pytest.raises(ValueError, match="unknown preprocessing step"):
        with_step(ref, dev, "colour")


# the files dataset


def make_set(folder: Path, names: list[str], labels: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        (folder / name).write_bytes(png(np.full((4, 4, 3), i, dtype=np.uint8)))
    if labels is not None:
        (folder / "labels.csv").write_text(labels)


def test_files_dataset_lists_sorted_with_labels_and_take(tmp_path):
    make_set(tmp_path / "m" / "eval", ["b.png", "a.JPG", "c d,é.png"], 'file,label\nb.png,1\n"c d,é.png",2\na.JPG,0\n')
    (tmp_path / "m" / "eval" / ".DS_Store").write_bytes(b"x")
    ds = read_files_dataset(tmp_path, "m", "eval", "evaluation", "image")
    assert ds.names == ["a.JPG", "b.png", "c d,é.png"]
    assert ds.labels is not None and ds.labels.tolist() == [0, 1, 2]
    assert ds.blobs[1] == (tmp_path / "m" / "eval" / "b.png").read_bytes()
    first = read_files_dataset(tmp_path, "m", "eval", "evaluation", "image", take=2)
    assert first.names == ["a.JPG", "b.png"] and first.labels is not None and first.labels.tolist() == [0, 1]
    (tmp_path / "m" / "eval" / "labels.csv").write_text("file,label\nb.png,1\na.JPG,0\n")
    with pytest.raises(InputError, match="no label for 1 file"):  # take does not excuse the rest
        read_files_dataset(tmp_path, "m", "eval", "evaluation", "image", take=1)
    bare = tmp_path / "m" / "bare"
    make_set(bare, ["x.png"])
    assert read_files_dataset(tmp_path, "m", "bare", "golden", "image").labels is None


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        ("name,label\na.png,0\n", r"row 1 is \['name', 'label'\]"),
        ("file,label\na.png,0\na.png,1\n", r"row 3 labels 'a.png' again \(first on row 2\)"),
        ("file,label\na.png,-1\n", r"row 2: label '-1' of 'a.png' is not an integer >= 0"),
        ("file,label\na.png,1.5\n", r"row 2: label '1.5'"),
        ("file,label\na.png,0\nzz.png,1\n", r"row 3 names 'zz.png', which is not a file"),
        ("file,label\na.png,0,3\n", r"row 2 has 3 fields"),
        ("file,label\nb.png,0\n", r"no label for 1 file\(s\): 'a.png'"),
    ],
)
def test_labels_csv_errors_name_the_row(tmp_path, labels, match):
    make_set(tmp_path / "d", ["a.png", "b.png"], labels)
    with pytest.raises(InputError, match=match):
        read_files_dataset(tmp_path, ".", "d", "golden", "image")


def test_files_dataset_refuses_unsupported_empty_and_wrong_kind(tmp_path):
    make_set(tmp_path / "d", ["a.png"])
    (tmp_path / "d" / "notes.txt").write_text("hi")
    (tmp_path / "d" / "sub").mkdir()
    with pytest.raises(InputError, match=r"not image files.*'notes.txt', 'sub'"):
        read_files_dataset(tmp_path, ".", "d", "golden", "image")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no image files"):
        read_files_dataset(tmp_path, ".", "empty", "golden", "image")
    make_set(tmp_path / "imgs", ["a.png"])
    with pytest.raises(InputError, match=r"not audio files \(.wav\): 'a.png'"):
        read_files_dataset(tmp_path, ".", "imgs", "golden", "audio")
    with pytest.raises(InputError, match="is not a folder"):
        read_files_dataset(tmp_path, ".", "missing", "golden", "image")


def test_files_dataset_refuses_paths_leading_out(tmp_path):
    project, outside = tmp_path / "project", tmp_path / "outside"
    make_set(outside, ["a.png"])
    make_set(project / "m" / "d", ["a.png"])
    with pytest.raises(InputError, match="outside the project root"):
        read_files_dataset(project, "m", "../../outside", "golden", "image")
    os.symlink(outside, project / "m" / "linked")
    with pytest.raises(InputError, match="outside the project root"):
        read_files_dataset(project, "m", "linked", "golden", "image")
    os.symlink(outside / "a.png", project / "m" / "d" / "b.png")
    with pytest.raises(InputError, match="outside the project root"):
        read_files_dataset(project, "m", "d", "golden", "image")


def test_files_dataset_refuses_too_many_bytes(tmp_path, monkeypatch):
    import pipeline.project.files as files

    make_set(tmp_path / "d", ["a.png", "b.png"])
    monkeypatch.setattr(files, "MAX_DATASET_BYTES", 100)
    with pytest.raises(InputError, match="above the limit"):
        read_files_dataset(tmp_path, ".", "d", "golden", "image")


def test_pack_unpack_round_trip_through_npz(tmp_path):
    blobs = [b"\x00\x01", b"", b"\xff" * 5]
    names = ["a.png", "b\nweird ☃.png", "c"]
    packed = pack(blobs, names, np.array([3, 0, 1]))
    np.savez(tmp_path / "s.npz", x=np.zeros(3), **packed)
    with np.load(tmp_path / "s.npz", allow_pickle=False) as loaded:
        got_blobs, got_names, got_labels = unpack(dict(loaded))
    assert got_blobs == blobs and got_names == names
    assert got_labels is not None and got_labels.tolist() == [3, 0, 1]
    assert unpack(pack(blobs, names, None))[2] is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"file_offsets": np.array([0, 2, 1, 7])}, "never falling"),
        ({"file_offsets": np.array([0, 2, 2, 9])}, "rise from 0 to the 7 bytes"),
        ({"file_offsets": np.array([0, 7])}, "2 offsets for 3 names"),
        ({"file_bytes": np.zeros(7, np.int32)}, "expected 1-d uint8"),
        ({LABELS: np.array([0, -1, 0])}, "negative"),
    ],
)
def test_unpack_refuses_a_damaged_packing(change, match):
    packed = pack([b"ab", b"", b"cdefg"], ["a", "b", "c"], np.array([0, 1, 2]))
    with pytest.raises(MalformedFile, match=match):
        unpack({**packed, **change})
    with pytest.raises(MalformedFile, match="missing"):
        unpack({"file_bytes": packed["file_bytes"]})
