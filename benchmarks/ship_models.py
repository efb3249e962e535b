"""Three representative models for the "engines worth shipping" benchmark (benchmarks/speedup.py),
built with PyTorch from code (random weights: speed does not depend on them) and exported to
ONNX opset 17:

- ``classifier``: a MobileNetV2-style image classifier (inverted residuals, depthwise convs), 1x3x160x160;
- ``detector``: a DBNet-style text detector: conv backbone at strides 4..32, an FPN whose upsampling
  is ONNX Resize, concatenated features and a sigmoid probability head, 1x3x192x192;
- ``recognizer``: a CRNN-style text recognizer: a conv stack that collapses the height, a
  two-layer bidirectional LSTM and a linear CTC head, 1x3x32x128.

    python benchmarks/ship_models.py OUT_DIR [--models classifier,detector]

writes OUT_DIR/<model>/model.onnx. ``MODELS`` gives each model's input (for a params.yaml entry).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

# input name, shape (batch first, "batch" symbolic) and value range of each model
MODELS: dict[str, dict[str, Any]] = {
    "classifier": {"input": "image", "shape": [1, 3, 160, 160], "range": [-1.0, 1.0]},
    "detector": {"input": "image", "shape": [1, 3, 192, 192], "range": [-1.0, 1.0]},
    "recognizer": {"input": "image", "shape": [1, 3, 32, 128], "range": [-1.0, 1.0]},
}


def _torch_modules() -> dict[str, Callable[[], Any]]:
    import torch
    from torch import nn

    def conv_bn(
        cin: int, cout: int, k: Any = 3, s: Any = 1, groups: int = 1, act: bool = True, pad: Any = None
    ) -> nn.Sequential:
        if pad is None:
            pad = tuple(d // 2 for d in k) if isinstance(k, tuple) else k // 2
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, s, pad, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act:
            layers.append(nn.ReLU6(inplace=True))
        return nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            hidden = cin * expand
            self.skip = stride == 1 and cin == cout
            layers = [conv_bn(cin, hidden, 1)] if expand != 1 else []
            layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden), conv_bn(hidden, cout, 1, act=False)]
            self.body = nn.Sequential(*layers)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.body(x) if self.skip else self.body(x)

    class Classifier(nn.Module):
        """MobileNetV2 at width 0.75 (t, c, n, s as in the paper)."""

        def __init__(self, classes: int = 100, width: float = 0.75):
            super().__init__()
            ch = lambda c: max(8, int(c * width + 4) // 8 * 8)  # noqa: E731
            cin = ch(32)
            layers: list[nn.Module] = [conv_bn(3, cin, 3, 2)]
            for t, c, n, s in [
                (1, 16, 1, 1),
                (6, 24, 2, 2),
                (6, 32, 3, 2),
                (6, 64, 4, 2),
                (6, 96, 3, 1),
                (6, 160, 3, 2),
                (6, 320, 1, 1),
            ]:
                for i in range(n):
                    layers.append(InvertedResidual(cin, ch(c), s if i == 0 else 1, t))
                    cin = ch(c)
            layers.append(conv_bn(cin, 1280, 1))
            self.features = nn.Sequential(*layers)
            self.head = nn.Linear(1280, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.features(x).mean((2, 3))
            return torch.softmax(self.head(x), dim=-1)

    class Detector(nn.Module):
        """DBNet-style: a ResNet-ish backbone (strides 4, 8, 16, 32), FPN (1x1 laterals, nearest
        upsampling, 3x3 smoothing), all levels upsampled to stride 4 and concatenated, a probability head."""

        def __init__(self, chans: tuple[int, ...] = (32, 64, 96, 128), inner: int = 64):
            super().__init__()
            self.stem = nn.Sequential(conv_bn(3, 16, 3, 2), conv_bn(16, chans[0], 3, 2))
            stages, cin = [], chans[0]
            for i, c in enumerate(chans):
                stages.append(nn.Sequential(conv_bn(cin, c, 3, 1 if i == 0 else 2), conv_bn(c, c, 3)))
                cin = c
            self.stages = nn.ModuleList(stages)
            self.lateral = nn.ModuleList(nn.Conv2d(c, inner, 1) for c in chans)
            self.smooth = nn.ModuleList(nn.Conv2d(inner, inner // 4, 3, padding=1) for _ in chans)
            self.head = nn.Sequential(
                conv_bn(inner, inner // 4, 3),
                nn.ConvTranspose2d(inner // 4, inner // 4, 2, 2),
                nn.BatchNorm2d(inner // 4),
                nn.ReLU(inplace=True),
                nn.ConvTranspose2d(inner // 4, 1, 2, 2),
                nn.Sigmoid(),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            feats = []
            x = self.stem(x)
            for stage in self.stages:
                x = stage(x)
                feats.append(x)
            lat = [conv(f) for conv, f in zip(self.lateral, feats, strict=True)]
            for i in range(len(lat) - 2, -1, -1):
                lat[i] = lat[i] + nn.functional.interpolate(lat[i + 1], scale_factor=2.0, mode="nearest")
            outs = [smooth(p) for smooth, p in zip(self.smooth, lat, strict=True)]
            outs = [outs[0]] + [
                nn.functional.interpolate(o, scale_factor=float(2**i), mode="nearest")
                for i, o in enumerate(outs[1:], 1)
            ]
            return self.head(torch.cat(outs, dim=1))

    class Recognizer(nn.Module):
        """CRNN: conv stack 32x128 -> 1x32 feature columns, BiLSTM x2 (hidden 128), linear CTC head."""

        def __init__(self, classes: int = 97, hidden: int = 128):
            super().__init__()
            self.cnn = nn.Sequential(
                conv_bn(3, 32, 3),
                nn.MaxPool2d(2, 2),  # 16x64
                conv_bn(32, 64, 3),
                nn.MaxPool2d(2, 2),  # 8x32
                conv_bn(64, 128, 3),
                conv_bn(128, 128, 3),
                nn.MaxPool2d((2, 1), (2, 1)),  # 4x32
                conv_bn(128, 192, 3),
                conv_bn(192, 192, 3),
                nn.MaxPool2d((2, 1), (2, 1)),  # 2x32
                # 2x1 unpadded conv to height 1, as CRNN's last layer (a pooling to height 1 from an odd
                # height 3 made IREE 3.13 fail to compile the MaxPool: "inferred input/output operand #1")
                conv_bn(192, 256, (2, 1), pad=0),
            )  # 1x32
            self.rnn = nn.LSTM(256, hidden, num_layers=2, bidirectional=True, batch_first=False)
            self.head = nn.Linear(2 * hidden, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = self.cnn(x).squeeze(2).permute(2, 0, 1)  # [T, N, C]
            y, _ = self.rnn(f)
            return self.head(y).log_softmax(-1)

    return {"classifier": Classifier, "detector": Detector, "recognizer": Recognizer}


def build(name: str, out: Path, seed: int = 0) -> Path:
    """Write ``out`` (an ONNX file, opset 17, batch axis symbolic) for model ``name``."""
    import onnx
    import torch

    torch.manual_seed(seed)
    module = _torch_modules()[name]().eval()
    with torch.no_grad():  # BatchNorm statistics away from 0/1, as after training
        for m in module.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    spec = MODELS[name]
    example = torch.rand(*spec["shape"]) * 2 - 1
    out.parent.mkdir(parents=True, exist_ok=True)
    output_axes = {1: "batch"} if name == "recognizer" else {0: "batch"}  # the recognizer's output is [T, N, C]
    torch.onnx.export(
        module,
        (example,),
        str(out),
        input_names=[spec["input"]],
        output_names=["output"],
        opset_version=17,
        dynamo=False,
        dynamic_axes={spec["input"]: {0: "batch"}, "output": output_axes},
    )
    model = onnx.load(str(out))
    model.graph.name = name
    onnx.checker.check_model(model)
    onnx.save(model, str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    for name in args.models.split(","):
        print(build(name, args.out / name / "model.onnx"))


if __name__ == "__main__":
    main()
