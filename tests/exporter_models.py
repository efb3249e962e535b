"""Exporter-style fixtures whose outputs a device app post-processes (tests/test_corpus.py,
tests/test_exporter_verdicts.py, benchmarks/task_verdicts.py). Each is small (under 1 MB, a few ms
a call) and comes with its params.yaml entry. The weights are set by hand (from a seeded generator,
the classifiers' heads matched to their class templates), not trained, so the outputs mean something
on the inputs generated here and the files are the same on every host:

- ``dbnet``: a DBNet-style text detector exported by PyTorch (TorchScript, opset 17: strided convs,
  an FPN whose upsampling is ONNX Resize, a sigmoid probability map [batch,1,H,W], H and W dynamic).
  Its golden and calibration sets are .npz images of bright rectangles ("text lines") on a dark noisy
  background; the map lights up each rectangle, so ``db_boxes`` finds 4-5 boxes per image.
- ``crnn``: a CTC text recognizer exported by PyTorch: a conv stack that collapses the height, 1-D
  convs over time, a linear head and a Softmax, probs [batch,24,11] (blank 0 and ten digits). Its sets
  are "digit stripe" images: each digit a glyph of three horizontal bands whose rows encode it, some
  faint (near the blank's score: the close calls an INT8 engine may flip).
- ``opset11_shapeless``: a Conv/Relu/Gemm classifier exported by PyTorch at opset 11 whose
  graph.value_info holds an entry with an element type and no shape, as some exporters write it;
  logits, ``argmax`` on 420 golden images (a declared logits output's FP32 gate needs 401).
- ``stateful_if``: a voice-activity-style model with recurrent state in and out (``state`` [2,batch,8]
  -> ``stateN``, as Silero VAD names them) and an ``If`` on a condition computed from the input
  (ReduceMax(x) > 0.9: speech updates the state, silence decays it), prob [batch,1].
- ``classifier``: a small conv classifier exported by PyTorch, probs [batch,10] after a Softmax,
  ``topk`` (k 3) on 160 golden images (.npz: ten smooth class templates blended with noise, some
  barely visible); quantized to INT8 it flips a few of those close labels (2 of 160 here).
- ``crnn_outlier``, ``classifier_outlier``: the two with a dead channel (a bias of ``outlier`` on one
  channel of conv2, which the next conv reads none of): their all-INT8 engines misread every string
  and flip most labels; kept in float, conv2 to that conv pass (tests/test_remedy_backends.py).

``FIXTURES`` maps each name to its builder (``build(path)`` writes the ONNX file at ``path`` and any
dataset beside it) and its params.yaml entry (``spec(dir_)``).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import models
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# LiteRT INT8 for this host's CPU, XNNPACK and the built-in kernels both allowed (fallback is reported
# in the build, not judged): tests/test_corpus.py, tests/test_exporter_verdicts.py, the benchmark
LITERT_INT8 = models.cpu_sku("litert", "int8", {"delegate": "xnnpack", "per_channel": True}) | {
    "placement": {"allowed": ["xnnpack", "cpu"]}
}

# --- exporting from PyTorch -----------------------------------------------------------------------


def _export(
    module: Any, example: Any, path: Path, inp: str, out: str, axes: dict[str, dict[int, str]], opset: int = 17
) -> Path:
    """torch.onnx.export as the TorchScript exporter writes it (constants folded, BN fused)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter, chosen: as deployed exporters run
        torch.onnx.export(
            module.eval(),
            (example,),
            str(path),
            input_names=[inp],
            output_names=[out],
            opset_version=opset,
            dynamo=False,
            dynamic_axes=axes,
        )
    onnx.checker.check_model(onnx.load(str(path)))
    return path


def _fill(module: Any, rng: np.random.Generator, std: float = 0.1) -> None:
    """Every parameter from ``rng`` (N(0, std)), BatchNorm's (modules named ``*bn*``) at identity: the
    hand-set weights go on top."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.from_numpy(rng.normal(0, std, tuple(p.shape)).astype(np.float32)))
            if "bn" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)


def _set(param: Any, value: Any) -> None:
    import torch

    with torch.no_grad():
        param.copy_(torch.as_tensor(np.asarray(value, dtype=np.float32)))


def _save(graph: onnx.GraphProto, path: Path, opset: int) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="skuforge-tests")
    model.ir_version = min(onnx.IR_VERSION, max(v[1] for v in helper.VERSION_TABLE if v[2] <= opset))
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _savez(path: Path, **arrays: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path


# --- dbnet: a text detector's probability map ----------------------------------------------------


def rectangle_images(count: int, size: int, rects: tuple[int, int], seed: int) -> tuple[np.ndarray, list]:
    """``count`` images [3,size,size] in [-1, 1]: dark noise (-1..-0.5) with ``rects`` (low, high)
    bright rectangles each (channel values 0.35..1, wider than tall, at least 6 px apart at size 64),
    and their xyxy boxes. Rectangle sizes shrink as more share an image of the same size."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(-1.0, -0.5, (count, 3, size, size)).astype(np.float32)
    scale = size / 64 * min(1.0, (4.5 / np.mean(rects)) ** 0.5)
    gap = max(6, int(round(6 * scale)))
    boxes = []
    for image in images:
        want, placed = int(rng.integers(rects[0], rects[1] + 1)), []
        for _ in range(500 * want):
            if len(placed) == want:
                break
            w, h = int(rng.integers(8, 21) * scale), int(rng.integers(6, 13) * scale)
            x, y = int(rng.integers(2, size - w - 2)), int(rng.integers(2, size - h - 2))
            if all(x + w + gap <= a or a2 + gap <= x or y + h + gap <= b or b2 + gap <= y for a, b, a2, b2 in placed):
                placed.append((x, y, x + w, y + h))
                image[:, y : y + h, x : x + w] = rng.uniform(0.35, 1.0, (3, 1, 1))
        boxes.append(placed)
    return images, boxes


def _dbnet_module(seed: int) -> Any:
    import torch
    from torch import nn

    class DBNet(nn.Module):
        """Backbone at strides 2 and 4, FPN (1x1 laterals, nearest upsampling by Resize), a 3x3 head
        upsampled to the input's size and a sigmoid. Channel 0 carries the local brightness all the
        way through; the other channels are random features that blur the map a little."""

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, 2, 1)
            self.stem_bn = nn.BatchNorm2d(8)
            self.down = nn.Conv2d(8, 16, 3, 2, 1)
            self.down_bn = nn.BatchNorm2d(16)
            self.lat4 = nn.Conv2d(16, 8, 1)
            self.lat2 = nn.Conv2d(8, 8, 1)
            self.smooth = nn.Conv2d(8, 8, 3, padding=1)
            self.head = nn.Conv2d(8, 1, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            c2 = torch.relu(self.stem_bn(self.stem(x)))
            c4 = torch.relu(self.down_bn(self.down(c2)))
            p2 = self.lat2(c2) + nn.functional.interpolate(self.lat4(c4), scale_factor=2.0, mode="nearest")
            p2 = torch.relu(self.smooth(p2))
            p1 = nn.functional.interpolate(p2, scale_factor=2.0, mode="nearest")
            return torch.sigmoid(self.head(p1))

    net = DBNet()
    _fill(net, np.random.default_rng(seed), 0.1)
    net.stem.weight.data[0] = 1.0 / 27  # the local mean brightness: > 0 on a rectangle only
    net.stem.bias.data[0] = 0.0
    net.down.weight.data[0] = 0.0
    net.down.weight.data[0, 0] = 1.0 / 9
    net.down.bias.data[0] = 0.0
    net.lat4.weight.data[0] = 0.0
    net.lat4.weight.data[0, 0] = 1.0
    net.lat4.bias.data[0] = 0.0
    net.lat2.weight.data[0] = 0.0
    net.lat2.weight.data[0, 0] = 1.0
    net.lat2.bias.data[0] = 0.0
    net.smooth.weight.data[0] = 0.0
    net.smooth.weight.data[0, 0] = 1.0 / 9
    net.smooth.bias.data[0] = 0.0
    net.head.weight.data[0, 0] = 12.0 / 9  # logit 12 * (brightness level - 0.5)
    net.head.bias.data[0] = -6.0
    return net


def dbnet(
    path: Path,
    size: int = 64,
    golden: int = 48,
    rects: tuple[int, int] = (4, 5),
    calibration: int = 32,
    seed: int = 0,
) -> Path:
    """The DBNet-style detector at ``path`` (2.3k weights, H and W dynamic) and, beside it,
    ``golden.npz`` (``golden`` images of ``size`` px, ``rects`` rectangles each) and
    ``calibration.npz`` (``calibration`` such images, another seed)."""
    import torch

    _export(
        _dbnet_module(seed),
        torch.zeros(1, 3, 64, 64),
        path,
        "image",
        "prob",
        {"image": {0: "batch", 2: "height", 3: "width"}, "prob": {0: "batch", 2: "height", 3: "width"}},
    )
    _savez(path.parent / "golden.npz", image=rectangle_images(golden, size, rects, seed + 1)[0])
    _savez(path.parent / "calibration.npz", image=rectangle_images(calibration, size, rects, seed + 2)[0])
    return path


def dbnet_spec(dir_: str, size: int = 64) -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [
            {"name": "image", "dtype": "float32", "shape": ["batch", 3, "height", "width"], "range": [-1.0, 1.0]}
        ],
        "pins": {"height": size, "width": size},
        "postprocess": {"kind": "db_boxes", "output": "prob", "threshold": 0.3, "box_threshold": 0.5},
        "datasets": {"golden": {"path": "golden.npz"}, "calibration": {"path": "calibration.npz"}},
    }


# --- crnn: a CTC text recognizer -----------------------------------------------------------------

CRNN_HEIGHT, CRNN_WIDTH, CRNN_CLASSES = 32, 96, 11  # 24 frames (width / 4), blank 0 and digits 1..10
# each digit's glyph: three of the eight 4-px bands of the height (the rows the conv stack pools to)
GLYPHS = np.array([[int(b in c) for b in range(8)] for c in list(itertools.combinations(range(8), 3))[::5][:10]])


def stripe_images(count: int, seed: int, faint: float = 0.15) -> tuple[np.ndarray, list[list[int]]]:
    """``count`` images [1,32,96] in [0, 1]: 3..6 digit glyphs (8 px wide, 8..9 px apart, the first
    0..3 px in) on noise (0..0.1), each at brightness 0.6..1, or 0.38..0.46 for a share ``faint``
    of them; and the digits (classes 1..10)."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(0.0, 0.1, (count, 1, CRNN_HEIGHT, CRNN_WIDTH)).astype(np.float32)
    texts = []
    for image in images:
        x, text = int(rng.integers(0, 4)), []
        for _ in range(int(rng.integers(3, 7))):
            if x + 8 > CRNN_WIDTH:
                break
            digit = int(rng.integers(1, CRNN_CLASSES))
            level = rng.uniform(0.38, 0.46) if rng.random() < faint else rng.uniform(0.6, 1.0)
            for band in np.flatnonzero(GLYPHS[digit - 1]):
                image[0, 4 * band : 4 * band + 4, x : x + 8] = level
            text.append(digit)
            x += 8 + int(rng.integers(8, 10))  # a whole 4-px frame of background: repeats stay apart
        texts.append(text)
    return images, texts


def _crnn_module(seed: int) -> Any:
    import torch
    from torch import nn

    class CRNN(nn.Module):
        """conv 3x3, pool, conv 3x3, pool (32x96 -> 8x24), an 8x1 conv to height 1 (one channel per
        digit matches its glyph's bands: +1 on, -1 off), a 1-D conv over time, a linear head, Softmax."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
            self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
            self.collapse = nn.Conv2d(16, 32, (8, 1))
            self.seq = nn.Conv1d(32, 32, 3, padding=1)
            self.head = nn.Linear(32, CRNN_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
            f = nn.functional.max_pool2d(torch.relu(self.conv2(f)), 2)
            f = torch.relu(self.collapse(f)).squeeze(2)  # [N, 32, T]
            f = torch.relu(self.seq(f)).permute(0, 2, 1)  # [N, T, 32]
            return torch.softmax(self.head(f), dim=-1)

    net = CRNN()
    _fill(net, np.random.default_rng(seed), 0.05)
    w1 = net.conv1.weight.data
    w1[0] = 0.0
    w1[0, 0, 1, 1] = 1.0  # channel 0 passes the image through both blocks
    net.conv1.bias.data[0] = 0.0
    net.conv2.weight.data[0] = 0.0
    net.conv2.weight.data[0, 0, 1, 1] = 1.0
    net.conv2.bias.data[0] = 0.0
    glyph = torch.from_numpy(2.0 * GLYPHS - 1.0).float()  # [10, 8]
    net.collapse.weight.data[:10] = 0.0
    net.collapse.weight.data[:10, 0, :, 0] = glyph
    net.collapse.bias.data[:10] = 0.0
    net.seq.weight.data[:10] = 0.0
    net.seq.weight.data[:10, :10, 1] = torch.eye(10)
    net.seq.bias.data[:10] = 0.0
    head = net.head.weight.data
    head[:, :10] *= 0.2
    head[1:, :10] += 4.0 * torch.eye(10)  # digit d scores 4 x its glyph match
    net.head.bias.data[:] = 0.0
    net.head.bias.data[0] = 3.0  # the blank wins where no glyph matches
    return net


def crnn(path: Path, golden: int = 160, seed: int = 0) -> Path:
    """The recognizer at ``path`` (8.8k weights) and, beside it, ``golden.npz`` (``golden`` stripe
    images) and ``calibration.npz`` (64, another seed)."""
    import torch

    _export(
        _crnn_module(seed),
        torch.zeros(1, 1, CRNN_HEIGHT, CRNN_WIDTH),
        path,
        "image",
        "probs",
        {"image": {0: "batch"}, "probs": {0: "batch"}},
    )
    _savez(path.parent / "golden.npz", image=stripe_images(golden, seed + 1)[0])
    _savez(path.parent / "calibration.npz", image=stripe_images(64, seed + 2)[0])
    return path


def crnn_outlier(path: Path, outlier: float = 1e4, golden: int = 160, seed: int = 0) -> Path:
    """The recognizer with one dead channel: ``conv2``'s channel 15 gets a bias of ``outlier`` and
    ``collapse`` reads none of it (its weights for that channel are 0), as a trained net can carry a
    channel the next layer learnt to ignore. In FP32 the strings are the recognizer's own; with one
    INT8 scale for conv2's output (and the MaxPool's after it) the levels go to channel 15 and the
    glyph channel falls to zero: the engine reads blanks. ``golden.npz`` and ``calibration.npz``
    as :func:`crnn`'s."""
    import torch

    net = _crnn_module(seed)
    net.conv2.bias.data[15] = outlier
    net.collapse.weight.data[:, 15] = 0.0
    _export(
        net,
        torch.zeros(1, 1, CRNN_HEIGHT, CRNN_WIDTH),
        path,
        "image",
        "probs",
        {"image": {0: "batch"}, "probs": {0: "batch"}},
    )
    _savez(path.parent / "golden.npz", image=stripe_images(golden, seed + 1)[0])
    _savez(path.parent / "calibration.npz", image=stripe_images(64, seed + 2)[0])
    return path


def crnn_spec(dir_: str) -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [
            {"name": "image", "dtype": "float32", "shape": ["batch", 1, CRNN_HEIGHT, CRNN_WIDTH], "range": [0.0, 1.0]}
        ],
        "postprocess": {"kind": "ctc_greedy", "output": "probs", "blank": 0},
        "datasets": {"golden": {"path": "golden.npz"}, "calibration": {"path": "calibration.npz"}},
    }


# --- opset11_shapeless: a value_info entry with a type and no shape ------------------------------


def _opset11_module(seed: int) -> Any:
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.fc = nn.Linear(8 * 8 * 8, 10)

        def features(self, x: torch.Tensor) -> torch.Tensor:
            return torch.flatten(nn.functional.max_pool2d(torch.relu(self.conv(x)), 2), 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.features(x))

    net = Net()
    rng = np.random.default_rng(seed)
    _fill(net, rng, 0.1)
    _he(net.conv, rng)
    _set(net.conv.bias, -0.5 * net.conv.weight.data.sum(dim=(1, 2, 3)).numpy())  # centres the [0, 1] input
    _match_head(net, 16, seed, 4.0)
    return net


def opset11_shapeless(path: Path, golden: int = 420, seed: int = 0) -> Path:
    """x[batch,3,16,16] -> Conv 3x3 -> Relu -> MaxPool 2 -> Flatten -> Gemm -> logits[batch,10],
    exported by PyTorch at opset 11; graph.value_info then gets the Relu's output with its element
    type and no shape, as some exporters write it. Beside it ``golden.npz`` (``golden`` template
    images) and ``calibration.npz`` (64)."""
    import torch

    _export(
        _opset11_module(seed),
        torch.zeros(1, 3, 16, 16),
        path,
        "x",
        "logits",
        {"x": {0: "batch"}, "logits": {0: "batch"}},
        opset=11,
    )
    model = onnx.load(str(path))
    relu = next(n.output[0] for n in model.graph.node if n.op_type == "Relu")
    kept = [v for v in model.graph.value_info if v.name != relu]
    del model.graph.value_info[:]
    model.graph.value_info.extend([*kept, helper.make_tensor_value_info(relu, TensorProto.FLOAT, None)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    _savez(path.parent / "golden.npz", x=template_images(golden, seed + 1, 16, seed)[0])
    _savez(path.parent / "calibration.npz", x=template_images(64, seed + 2, 16, seed)[0])
    return path


def opset11_shapeless_spec(dir_: str) -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 16, 16], "range": [0.0, 1.0]}],
        "postprocess": "argmax",
        "output_kinds": {"logits": "logits"},  # declared: its FP32 agreement gate needs 401 golden rows
        "datasets": {"golden": {"path": "golden.npz"}, "calibration": {"path": "calibration.npz"}},
    }


# --- stateful_if: recurrent state and an If on the input -----------------------------------------


def stateful_if(path: Path, seed: int = 0, outer_scope_constants: bool = False) -> Path:
    """x[batch,16] and state[2,batch,8] (h, c) -> prob[batch,1], stateN[2,batch,8]. An If on
    ReduceMax(x) > 0.9 (one condition for the batch, as a streaming VAD runs at batch 1): the then
    branch (speech) updates the state from x, c' = (c + tanh(x Wx + h Wh + b)) / 2, h' = tanh(c');
    the else branch (silence) decays it by 0.9. prob = sigmoid(h' v + bv). Both branches read x,
    the state and the weights from the outer scope; their index and axes constants are Constant
    nodes inside the branch, as PyTorch's exporter writes a scripted ``if``, or with
    ``outer_scope_constants`` initializers of the outer graph, as a graph optimiser that hoists
    constants leaves them (IREE 3.13 fails to compile that form: tests/test_exporter_verdicts.py)."""
    rng = np.random.default_rng(seed)
    scalars = [
        numpy_helper.from_array(np.array(0, np.int64), "i0"),
        numpy_helper.from_array(np.array(1, np.int64), "i1"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
    ]
    local = (
        []
        if outer_scope_constants
        else [helper.make_node("Constant", [], [t.name], value=t, name=f"speech/Constant_{t.name}") for t in scalars]
    )
    init = [
        numpy_helper.from_array(rng.normal(0, 0.4, (16, 8)).astype(np.float32), "wx"),
        numpy_helper.from_array(rng.normal(0, 0.4, (8, 8)).astype(np.float32), "wh"),
        numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "b"),
        numpy_helper.from_array(rng.normal(0, 1.0, (8, 1)).astype(np.float32), "v"),
        numpy_helper.from_array(np.array([0.2], np.float32), "bv"),
        numpy_helper.from_array(np.array(0.9, np.float32), "level"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array(0.9, np.float32), "decay"),
        numpy_helper.from_array(np.array(0, np.int64), "h_index"),
        *(scalars if outer_scope_constants else []),
    ]
    out = [2, "batch", 8]
    speech = helper.make_graph(
        [
            *local,
            helper.make_node("Gather", ["state", "i0"], ["h"], axis=0, name="speech/h"),
            helper.make_node("Gather", ["state", "i1"], ["c"], axis=0, name="speech/c"),
            helper.make_node("MatMul", ["x", "wx"], ["xw"], name="speech/MatMul"),
            helper.make_node("MatMul", ["h", "wh"], ["hw"], name="speech/MatMul_1"),
            helper.make_node("Add", ["xw", "hw"], ["pre0"], name="speech/Add"),
            helper.make_node("Add", ["pre0", "b"], ["pre"], name="speech/Add_1"),
            helper.make_node("Tanh", ["pre"], ["z"], name="speech/Tanh"),
            helper.make_node("Add", ["c", "z"], ["cz"], name="speech/Add_2"),
            helper.make_node("Mul", ["cz", "half"], ["c_new"], name="speech/Mul"),
            helper.make_node("Tanh", ["c_new"], ["h_new"], name="speech/Tanh_1"),
            helper.make_node("Unsqueeze", ["h_new", "axis0"], ["h_u"], name="speech/Unsqueeze"),
            helper.make_node("Unsqueeze", ["c_new", "axis0"], ["c_u"], name="speech/Unsqueeze_1"),
            helper.make_node("Concat", ["h_u", "c_u"], ["speech_state"], axis=0, name="speech/Concat"),
        ],
        "speech",
        [],
        [helper.make_tensor_value_info("speech_state", TensorProto.FLOAT, out)],
    )
    silence = helper.make_graph(
        [helper.make_node("Mul", ["state", "decay"], ["silence_state"], name="silence/Mul")],
        "silence",
        [],
        [helper.make_tensor_value_info("silence_state", TensorProto.FLOAT, out)],
    )
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0, name="/ReduceMax"),
        helper.make_node("Greater", ["peak", "level"], ["voiced"], name="/Greater"),
        helper.make_node("If", ["voiced"], ["stateN"], then_branch=speech, else_branch=silence, name="/If"),
        helper.make_node("Gather", ["stateN", "h_index"], ["h_out"], axis=0, name="/Gather"),
        helper.make_node("MatMul", ["h_out", "v"], ["hv"], name="/decoder/MatMul"),
        helper.make_node("Add", ["hv", "bv"], ["logit"], name="/decoder/Add"),
        helper.make_node("Sigmoid", ["logit"], ["prob"], name="/decoder/Sigmoid"),
    ]
    graph = helper.make_graph(
        nodes,
        "stateful_if",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, out),
        ],
        [
            helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("stateN", TensorProto.FLOAT, out),
        ],
        init,
    )
    return _save(graph, path, 17)


def stateful_if_spec(dir_: str) -> dict:
    """Batch 1 (the If's condition is one sample's peak)."""
    return {
        "dir": dir_,
        "source": "model.onnx",
        "pins": {"batch": 1},
        "inputs": [
            {"name": "x", "dtype": "float32", "shape": ["batch", 16], "range": [-1.0, 1.0]},
            {"name": "state", "dtype": "float32", "shape": [2, "batch", 8], "range": [-0.5, 0.5]},
        ],
    }


# --- classifier: a conv classifier whose INT8 engine flips close calls ---------------------------


def template_images(count: int, seed: int, size: int = 32, templates_seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``count`` images [3,size,size] in [0, 1], each one of ten smooth class templates blended with
    uniform noise (the template's weight 0.05..0.75: the faint ones are the close calls), and their
    classes. The templates come from ``templates_seed`` (the model's seed: its head matches them)."""
    rng = np.random.default_rng(seed)
    templates = _templates(templates_seed, size)
    classes = rng.integers(0, 10, count)
    weight = rng.uniform(0.05, 0.75, (count, 1, 1, 1))
    noise = rng.uniform(0.0, 1.0, (count, 3, size, size))
    return (weight * templates[classes] + (1 - weight) * noise).astype(np.float32), classes


def _templates(seed: int, size: int) -> np.ndarray:
    """Ten smooth patterns [10,3,size,size] in [0, 1]: random 4x4 grids upsampled."""
    coarse = np.random.default_rng([seed, 10]).uniform(0.0, 1.0, (10, 3, 4, 4))
    return coarse.repeat(size // 4, axis=2).repeat(size // 4, axis=3)


def _match_head(net: Any, size: int, seed: int, scale: float) -> None:
    """``net.fc`` matched to each class template's features (``net.features``) about their mean on
    images like the golden set's: the classifier a training run would find, without the run."""
    import torch

    with torch.no_grad():
        probe = torch.from_numpy(template_images(512, seed + 100, size, seed)[0])
        mean = net.eval().features(probe).mean(0)
        match = net.features(torch.from_numpy(_templates(seed, size).astype(np.float32))) - mean
        net.fc.weight.copy_(scale * match / match.norm(dim=1, keepdim=True))
        net.fc.bias.copy_(-net.fc.weight @ mean)


def _he(conv: Any, rng: np.random.Generator) -> None:
    """He-scaled weights (normal, variance 2 / fan-in)."""
    _set(conv.weight, rng.normal(0, (2 / conv.weight[0].numel()) ** 0.5, tuple(conv.weight.shape)))


def _classifier_module(seed: int) -> Any:
    import torch
    from torch import nn

    class Classifier(nn.Module):
        """conv, BN, ReLU, pool twice, a strided conv, a linear head, Softmax (BN folded on export)."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(16)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
            self.bn2 = nn.BatchNorm2d(32)
            self.conv3 = nn.Conv2d(32, 32, 3, stride=2, padding=1)
            self.fc = nn.Linear(32 * 4 * 4, 10)

        def features(self, x: torch.Tensor) -> torch.Tensor:
            f = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
            f = nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(f))), 2)
            return torch.flatten(torch.relu(self.conv3(f)), 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.fc(self.features(x)), dim=-1)

    net = Classifier()
    rng = np.random.default_rng(seed)
    _fill(net, rng, 0.1)
    for conv in (net.conv1, net.conv2, net.conv3):
        _he(conv, rng)
    _set(net.conv1.bias, -0.5 * net.conv1.weight.data.sum(dim=(1, 2, 3)).numpy())  # centres the [0, 1] input
    _match_head(net, 32, seed, 4.0)
    return net


def classifier(path: Path, golden: int = 160, seed: int = 0) -> Path:
    """The classifier at ``path`` (19k weights): x[batch,3,32,32] -> probs[batch,10]; beside it
    ``golden.npz`` (``golden`` template images) and ``calibration.npz`` (64, another seed)."""
    import torch

    _export(
        _classifier_module(seed),
        torch.zeros(1, 3, 32, 32),
        path,
        "x",
        "probs",
        {"x": {0: "batch"}, "probs": {0: "batch"}},
    )
    _savez(path.parent / "golden.npz", x=template_images(golden, seed + 1, 32, seed)[0])
    _savez(path.parent / "calibration.npz", x=template_images(64, seed + 2, 32, seed)[0])
    return path


def classifier_outlier(path: Path, outlier: float = 1e4, golden: int = 160, seed: int = 0) -> Path:
    """The classifier with one dead channel: ``conv2``'s channel 31 gets a bias of ``outlier`` (BN
    folds it into the exported Conv) and ``conv3`` reads none of it (its weights for that channel are
    0; the head is matched after). In FP32 the labels are the classifier's own; with one INT8 scale
    for conv2's output (and the MaxPool's after it) the levels go to channel 31 and the other 31
    channels fall to zero. ``golden.npz`` and ``calibration.npz`` as :func:`classifier`'s."""
    import torch

    net = _classifier_module(seed)
    net.bn2.bias.data[31] = outlier
    net.conv3.weight.data[:, 31] = 0.0
    _match_head(net, 32, seed, 4.0)
    _export(net, torch.zeros(1, 3, 32, 32), path, "x", "probs", {"x": {0: "batch"}, "probs": {0: "batch"}})
    _savez(path.parent / "golden.npz", x=template_images(golden, seed + 1, 32, seed)[0])
    _savez(path.parent / "calibration.npz", x=template_images(64, seed + 2, 32, seed)[0])
    return path


def classifier_spec(dir_: str) -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 32, 32], "range": [0.0, 1.0]}],
        "postprocess": {"kind": "topk", "output": "probs", "k": 3},
        "datasets": {"golden": {"path": "golden.npz"}, "calibration": {"path": "calibration.npz"}},
    }


FIXTURES: dict[str, tuple[Callable[[Path], Path], Callable[[str], dict]]] = {
    "dbnet": (dbnet, dbnet_spec),
    "crnn": (crnn, crnn_spec),
    "opset11_shapeless": (opset11_shapeless, opset11_shapeless_spec),
    "stateful_if": (stateful_if, stateful_if_spec),
    "classifier": (classifier, classifier_spec),
}
# the dead-channel variants (tests/test_remedy_backends.py, benchmarks/remedy_backends.py)
OUTLIER_FIXTURES: dict[str, tuple[Callable[..., Path], Callable[[str], dict]]] = {
    "crnn_outlier": (crnn_outlier, crnn_spec),
    "classifier_outlier": (classifier_outlier, classifier_spec),
}
