"""Stateful models run as the device runs them: a sequence of calls, each output named in
``models.<m>.sequence.feed`` given back as its input on the next call, so the state's drift over
time shows (a voice-activity model, a streaming recognizer: the error of one call is small, the
error after a few hundred is what the device sees).

The golden samples, in order, are the sequence's other inputs: sequence k runs samples
k*steps .. k*steps+steps-1, starting from the first one's own state inputs. The engine and the
reference (ONNX Runtime CPU FP32, optimisations off, on the prepared model) run the same
sequences; every output after the last step is judged by the tensor gates (a fed-back output as
``state``), named ``<output>@<steps>``. docs/correctness.md, "Stateful models".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pipeline.backends.reference import reference_runner
from pipeline.core.errors import ConfigError, InputError
from pipeline.project.config import ModelSpec, SequenceSpec, TolerancePolicy
from pipeline.project.data import run_dataset
from pipeline.results.reports import OutputError
from pipeline.verify.compare import output_error

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np

# sequences judged at most: each is steps calls of the engine and of the reference
MAX_SEQUENCES = 64

Infer = Callable[[dict[str, "np.ndarray"]], dict[str, "np.ndarray"]]


def sequence_errors(
    spec: ModelSpec,
    seq: SequenceSpec,
    golden: Mapping[str, np.ndarray],
    infer: Infer,
    prepared: Path,
    in_idx: dict[str, int | None],
    out_idx: dict[str, int | None],
    batch: int,
    policy: TolerancePolicy,
) -> list[OutputError]:
    """Every output after ``seq.steps`` calls, engine against reference, over as many sequences as
    the golden samples hold (at most MAX_SEQUENCES)."""
    import numpy as np

    n = len(golden[spec.inputs[0].name])
    count = min(n // seq.steps, MAX_SEQUENCES)
    if count < 1:
        raise InputError(
            f"models.sequence.steps is {seq.steps} but the golden set holds {n} samples: no whole sequence",
            hint="give the golden set at least steps samples (datasets.golden), in the order the device sees them",
        )
    with reference_runner(prepared) as ref:
        expected = [_run(seq, golden, k, ref.infer, in_idx, out_idx, batch) for k in range(count)]
    got = [_run(seq, golden, k, infer, in_idx, out_idx, batch) for k in range(count)]
    names = sorted(expected[0])
    return [
        output_error(
            f"{name}@{seq.steps}",
            np.concatenate([g[name] for g in got]),
            np.concatenate([e[name] for e in expected]),
            policy,
            "state" if name in seq.feed else policy.declared.get(name),
        ).model_copy(update={"sequence_steps": seq.steps})
        for name in names
    ]


def _run(
    seq: SequenceSpec,
    golden: Mapping[str, np.ndarray],
    k: int,
    infer: Infer,
    in_idx: dict[str, int | None],
    out_idx: dict[str, int | None],
    batch: int,
) -> dict[str, np.ndarray]:
    """Sequence ``k``: its outputs after the last call (each with a leading sample axis of 1)."""
    state: dict[str, Any] = {}
    outputs: dict[str, np.ndarray] = {}
    for t in range(seq.steps):
        i = k * seq.steps + t
        feeds = {name: (state[name] if name in state else value[i : i + 1]) for name, value in golden.items()}
        outputs = run_dataset(infer, feeds, in_idx, out_idx, batch)
        for out, inp in seq.feed.items():
            if out not in outputs:
                raise ConfigError(
                    f"models.sequence.feed: the model has no output {out!r} (outputs: {sorted(outputs)})",
                    hint="name an output of the model that is fed back as an input",
                )
            if outputs[out].shape != golden[inp][i : i + 1].shape:
                raise ConfigError(
                    f"models.sequence.feed: output {out!r} of shape {list(outputs[out].shape[1:])} cannot feed "
                    f"input {inp!r} of shape {list(golden[inp].shape[1:])}",
                    hint="feed each state output to the input of the same shape",
                )
            state[inp] = outputs[out].astype(golden[inp].dtype, copy=False)
    return outputs
