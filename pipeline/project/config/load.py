"""Loading params.yaml: YAML with unique keys, parsed into the Registry, then the checks that span
entries (names, paths, cross-references, the portable fallback, device preprocessing, collisions,
resolved shapes and sizes, datasets)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from pipeline.backends import backend_class, known_backends
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.io import MERGE_CONFLICT_FIX, merge_conflict
from pipeline.core.limits import (
    DTYPE_BYTES,
    MAX_DATASET_BYTES,
    MAX_TENSOR_BYTES,
    MAX_TENSOR_ELEMENTS,
    human_bytes,
    largest_within,
    tensor_limit,
)
from pipeline.core.paths import PATH_RULE, Layout, inside, path_problem
from pipeline.core.validation import did_you_mean, validation_problems
from pipeline.project.config.base import (
    CLASS_KINDS,
)
from pipeline.project.config.model import (
    Datasets,
    ModelSpec,
)
from pipeline.project.config.preprocessing import (
    device_preprocessing,
)
from pipeline.project.config.registry import (
    Registry,
    invalid_registry,
)
from pipeline.project.config.sku import (
    RESERVED_MODEL_NAMES,
    name_problem,
)
from pipeline.results import gatestats


def parse_registry(data: Any, source: str = "params.yaml", root: Path | None = None) -> Registry:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with 'models' and 'skus' at the top level")
    problems = _name_problems(data)
    try:
        registry = Registry.model_validate(data)
    except ValidationError as exc:
        problems += validation_problems(exc, Registry)
    if problems:
        raise invalid_registry(source, problems) from None
    registry._root = root or Path(".")
    problems = _path_problems(registry, resolve=root is not None)
    if problems:
        raise invalid_registry(source, problems)
    _check_cross_references(registry, source)
    return registry


def _name_problems(data: dict) -> list[str]:
    """Every model, SKU and example name that breaks the name rule, checked before anything else."""
    problems = []
    for section in ("examples", "models", "skus"):
        table = data.get(section)
        for name in table if isinstance(table, dict) else ():
            problem = name_problem(name)
            if problem is None and section == "models" and name in RESERVED_MODEL_NAMES:
                problem = f"is reserved (build/{name} holds other files); use e.g. {name + '_model'!r}"
            if problem is not None:
                problems.append(f"{section}.{name!r}: name {problem}")
    return problems


def _path_problems(registry: Registry, resolve: bool) -> list[str]:
    """Every registry path that would lead outside the project; ``resolve`` also follows symlinks."""
    paths: list[tuple[str, str, tuple[str, ...]]] = [
        (f"examples.{n}.dir", e.dir, (e.dir,)) for n, e in registry.examples.items()
    ]
    for name, m in registry.models.items():
        paths += [(f"models.{name}.dir", m.dir, (m.dir,)), (f"models.{name}.source", m.source, (m.dir, m.source))]
        for split in Datasets.model_fields:
            ds = getattr(m.datasets, split)
            for key in ("path", "files"):  # a .npz file or a folder of raw files
                value = getattr(ds, key) if ds is not None else None
                if value is not None:
                    paths.append((f"models.{name}.datasets.{split}.{key}", value, (m.dir, value)))
    if registry.rollout.inventory is not None:
        paths.append(("rollout.inventory", registry.rollout.inventory, (registry.rollout.inventory,)))
    problems = []
    for key, value, parts in paths:
        problem = path_problem(value) or path_problem("/".join(parts))
        if problem is None and resolve:
            try:
                inside(registry.root, *parts)
            except InputError:
                problem = (
                    f"resolves to {registry.root.joinpath(*parts).resolve()}, outside the project (a symlink leads out)"
                )
        if problem is not None:
            joined = f" (joined with dir: {'/'.join(parts)!r})" if len(parts) > 1 else ""
            problems.append(f"{key}: {value!r}{joined} {problem}; paths are {PATH_RULE}")
    return problems


def _check_cross_references(registry: Registry, source: str) -> None:
    """Every check that spans entries; all problems at once (ConfigError, exit 2)."""
    problems = _sku_problems(registry)
    for name, model in registry.models.items():
        problems += _higher_precision_problems(registry, name, model)
        problems += _model_problems(registry, name, model)
    for listed in registry.release.skus or []:
        if listed not in registry.skus:
            problems.append(
                f"release.skus: unknown SKU {listed!r}{did_you_mean(listed, registry.skus)}; "
                f"known SKUs: {', '.join(sorted(registry.skus))}"
            )
    problems += _fallback_problems(registry)
    problems += _device_preprocessing_problems(registry)
    problems += _collisions(registry)
    problems += _size_problems(registry)
    problems += _resolution_problems(registry)
    if problems:
        raise invalid_registry(source, problems)


def _sku_problems(registry: Registry) -> list[str]:
    """Each SKU's backend known and satisfied with its options, its bench settings, its axes."""
    problems: list[str] = []
    for name, sku in registry.skus.items():
        if sku.backend not in known_backends():
            problems.append(
                f"skus.{name}.backend: unknown backend {sku.backend!r}{did_you_mean(sku.backend, known_backends())}; "
                f"known backends: {', '.join(known_backends())}"
            )
            continue
        backend = backend_class(sku.backend)
        problems += [f"skus.{name}.{p}" for p in backend.check_sku(sku)]
        try:
            registry.bench(name)
        except ConfigError as exc:
            problems.append(exc.message)
        axes = {a for m in registry.models.values() for i in m.inputs for a in i.axes}
        for axis in [*sku.shapes, *sku.profiles]:
            if axis not in axes:
                problems.append(f"skus.{name}: axis {axis!r} is not a dynamic axis of any model (axes: {sorted(axes)})")
    return problems


def _higher_precision_problems(registry: Registry, name: str, model: ModelSpec) -> list[str]:
    """models.<name>.higher_precision names SKUs that exist and can keep nodes precise."""
    problems: list[str] = []
    for sname, nodes in model.higher_precision.items():
        if sname not in registry.skus:
            problems.append(
                f"models.{name}.higher_precision: unknown SKU {sname!r}{did_you_mean(sname, registry.skus)}; "
                f"known SKUs: {', '.join(sorted(registry.skus))}"
            )
        elif registry.skus[sname].precision == "fp32" and nodes:
            problems.append(
                f"models.{name}.higher_precision.{sname}: the SKU builds in fp32, there is no higher "
                "precision to keep nodes in; remove the entry"
            )
        elif (
            nodes
            and registry.skus[sname].backend in known_backends()
            and not backend_class(registry.skus[sname].backend).capabilities.per_node_precision
        ):
            problems.append(
                f"models.{name}.higher_precision.{sname}: the {registry.skus[sname].backend} backend "
                "cannot keep single nodes in higher precision; remove the entry"
            )
    return problems


def _model_problems(registry: Registry, name: str, model: ModelSpec) -> list[str]:
    """A model's outputs, pins against the SKUs' shapes, and its SKU list."""
    problems: list[str] = []
    if model.metric is not None and model.outputs is not None and model.metric.output not in model.outputs:
        problems.append(f"models.{name}.metric.output: {model.metric.output!r} is not in outputs {model.outputs}")
    for output in model.output_kinds:
        if model.outputs is not None and output not in model.outputs:
            problems.append(
                f"models.{name}.output_kinds.{output}: not in outputs {model.outputs}"
                + did_you_mean(output, model.outputs)
            )
    for axis in model.pins:
        if model.batch_axis == axis:
            continue
        for sname, sku in registry.skus.items():
            if axis in sku.shapes and sku.shapes[axis] != model.pins[axis]:
                problems.append(
                    f"skus.{sname}.shapes.{axis}: only the batch axis may be re-pinned per SKU "
                    f"(datasets are generated at models.{name}.pins.{axis}={model.pins[axis]})"
                )
    for listed in model.skus or []:
        if listed not in registry.skus:
            problems.append(
                f"models.{name}.skus: unknown SKU {listed!r}{did_you_mean(listed, registry.skus)}; "
                f"known SKUs: {', '.join(sorted(registry.skus))}"
            )
    if model.skus == []:
        problems.append(f"models.{name}.skus: empty, so the model is built nowhere; list a SKU or remove the key")
    repeated = sorted({s for s in model.skus or [] if (model.skus or []).count(s) > 1})
    if repeated:
        problems.append(f"models.{name}.skus: {', '.join(repeated)} listed more than once; list each SKU once")
    return problems


PORTABLE_LEVELS = ("disable", "basic", "extended")


def _fallback_problems(registry: Registry) -> list[str]:
    """The fallback SKU must build an engine any device with ONNX Runtime can run: CPU FP32, no
    layout-specific optimisation, no CPU feature requirement."""
    name = registry.rollout.fallback_sku
    if name is None:
        return []
    if name not in registry.skus:
        return [
            f"rollout.fallback_sku: unknown SKU {name!r}{did_you_mean(name, registry.skus)}; "
            f"known SKUs: {', '.join(sorted(registry.skus))}"
        ]
    sku = registry.skus[name]
    level = sku.options.get("graph_optimization_level", "all")
    wrong = [
        what
        for what, bad in (
            (f"backend {sku.backend!r} (needs onnxruntime)", sku.backend != "onnxruntime"),
            (f"precision {sku.precision!r} (needs fp32)", sku.precision != "fp32"),
            (f"device {sku.target.device!r} (needs cpu)", sku.target.device != "cpu"),
            (f"cpu_features {sku.target.cpu_features} (needs none)", bool(sku.target.cpu_features)),
            (
                f"options.graph_optimization_level {level!r} (needs one of {', '.join(PORTABLE_LEVELS)}: higher levels "
                "write CPU-specific layout ops into the engine)",
                level not in PORTABLE_LEVELS,
            ),
        )
        if bad
    ]
    return [f"rollout.fallback_sku: {name!r} is not portable: {'; '.join(wrong)}"] if wrong else []


def _device_preprocessing_problems(registry: Registry) -> list[str]:
    """Each SKU's device-side preprocessing merged into each of its models' declared steps: a mix the
    library cannot run (OpenCV with an antialiased bilinear resize, say) is refused here, by key."""
    problems = []
    for model, sku in registry.pairs():
        device = registry.sku(sku).preprocessing.device
        if device is None:
            continue
        for name, steps in registry.model(model).file_inputs.items():
            try:
                device_preprocessing(steps, device)
            except ValidationError as exc:
                detail = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
                problems.append(f"skus.{sku}.preprocessing.device with models.{model}.preprocess.{name}: {detail}")
    return problems


def _collisions(registry: Registry) -> list[str]:
    """Two entries whose resolved-config files coincide (e.g. pair keys '<model>-<sku>'): one would be lost."""
    layout, problems = Layout(Path(".")), []
    owners: dict[Path, str] = {}
    entries = [(f"examples.{e}", layout.config_file(e, example=True)) for e in registry.examples]
    entries += [(f"models.{m}", layout.config_file(m)) for m in registry.models]
    entries += [(f"models.{m} x skus.{s}", layout.config_file(m, s)) for m, s in registry.pairs()]
    for owner, path in entries:
        if path in owners:
            problems.append(f"{owner}: its key {path.stem!r} is also the key of {owners[path]}; rename one of them")
        owners.setdefault(path, owner)
    return problems


_AxisValues = dict[str, tuple[int, str | None]]  # axis -> (value, the key that sets it; None: the built-in batch 1)


def _resolution_problems(registry: Registry) -> list[str]:
    """A generated golden set too small to resolve the agreement threshold of an output declared as
    class scores, where no evaluation or hard-tail split can join it (docs/correctness.md). Sets
    read from files are checked by validate, once their size is known."""
    problems = []
    for name, model in registry.models.items():
        golden = model.datasets.golden.generate
        classes = sorted({kind for kind in model.output_kinds.values() if kind in CLASS_KINDS})
        if golden is None or not classes or model.datasets.evaluation or model.datasets.hard_tail:
            continue
        for _, sname in registry.pairs(models=[name]):
            for kind in classes:
                tol = registry.tolerance(name, sname).for_kind(kind)
                if tol.min_top1_agreement <= 0:
                    continue
                need = gatestats.min_rows_for_agreement(tol.min_top1_agreement, tol.confidence)
                if golden.count < need:
                    problems.append(
                        f"models.{name}.datasets.golden.generate.count: {golden.count} samples cannot resolve "
                        f"min_top1_agreement {tol.min_top1_agreement} of its {kind} outputs at {tol.confidence:.0%} "
                        f"confidence on SKU {sname}: an engine flipping twice the allowed share would pass; generate "
                        f"at least {need}, or give an evaluation split (its rows join the agreement gate)"
                    )
                    break
    return problems


def _size_problems(registry: Registry) -> list[str]:
    """Every input too large for one tensor at its largest shape (the model's pins, then each SKU's
    shapes and profile maxima) and every generated set above the dataset budget, refused before a
    stage allocates them (pipeline/core/limits.py)."""
    problems = []
    for name, model in registry.models.items():
        axes = {a for i in model.inputs for a in i.axes}
        pinned: _AxisValues = {a: (v, f"models.{name}.pins.{a}") for a, v in model.pins.items()}
        if model.batch_axis in axes:
            pinned.setdefault(model.batch_axis, (1, None))
        found = {i: _tensor_problem(name, model, i, pinned, f"models.{name}.") for i in range(len(model.inputs))}
        problems += [p for p in found.values() if p]
        for _, sname in registry.pairs(models=[name]):
            sku = registry.skus[sname]
            largest = {
                **pinned,
                **{a: (v, f"skus.{sname}.shapes.{a}") for a, v in sku.shapes.items() if a in axes},
                **{a: (p.max, f"skus.{sname}.profiles.{a}.max") for a, p in sku.profiles.items() if a in axes},
            }
            # an input already too large at the model's pins is named once, there
            problems += [
                p
                for i, at_pins in found.items()
                if at_pins is None and (p := _tensor_problem(name, model, i, largest, f"skus.{sname}."))
            ]
        if not any(found.values()):  # else a sample is too large already: its sets say nothing new
            problems += _dataset_problems(name, model, {a: v for a, (v, _) in pinned.items()})
    return problems


def _tensor_problem(model_name: str, model: ModelSpec, index: int, axes: _AxisValues, blame: str) -> str | None:
    """Why input ``index`` at ``axes`` is too large for one tensor, naming the key to lower (one
    starting with ``blame`` where the input has one) and the largest value that fits."""
    inp = model.inputs[index]
    values = {a: v for a, (v, _) in axes.items()}
    itemsize = DTYPE_BYTES[inp.dtype]
    limit, shape = tensor_limit(itemsize), inp.shape_at(values)
    elements = math.prod(shape)
    if elements <= limit:
        return None
    what = (
        f"input {inp.name!r} of model {model_name!r} at shape {list(shape)}: {elements} elements, "
        f"{human_bytes(elements * itemsize)} of {inp.dtype}, above the limit of {MAX_TENSOR_ELEMENTS} elements "
        f"and {human_bytes(MAX_TENSOR_BYTES)} per input tensor (docs/registry.md#limits)"
    )
    keys = {key: a for a in inp.axes if (key := axes[a][1]) is not None}
    keys = {k: a for k, a in keys.items() if k.startswith(blame)} or keys
    if not keys:
        return f"models.{model_name}.inputs.{index}.shape: {what}; lower its fixed dimensions"
    key, axis = max(keys.items(), key=lambda item: values[item[1]])
    most = largest_within(lambda v: math.prod(inp.shape_at({**values, axis: v})), values[axis], limit)
    fix = f"lower it to at most {most}" if most else f"lower the other dimensions of {inp.name!r}"
    return f"{key}: {values[axis]} puts {what}; {fix}"


def _dataset_problems(model_name: str, model: ModelSpec, pins: dict[str, int]) -> list[str]:
    """Every generated set whose samples (at the model's pins, every input) exceed MAX_DATASET_BYTES."""
    per_sample = sum(math.prod(i.shape_at(pins, drop=model.batch_axis)) * DTYPE_BYTES[i.dtype] for i in model.inputs)
    problems = []
    for split in Datasets.model_fields:
        source = getattr(model.datasets, split)
        if source is None or source.generate is None or source.generate.count * per_sample <= MAX_DATASET_BYTES:
            continue
        count, most = source.generate.count, MAX_DATASET_BYTES // per_sample
        fix = (
            f"lower it to at most {most}"
            if most
            else f"one sample alone is larger: lower models.{model_name}.pins or the inputs' fixed dimensions"
        )
        problems.append(
            f"models.{model_name}.datasets.{split}.generate.count: {count} samples of "
            f"{human_bytes(per_sample)} each make {human_bytes(count * per_sample)}, above the limit of "
            f"{human_bytes(MAX_DATASET_BYTES)} per dataset (docs/registry.md#limits); {fix}"
        )
    return problems


def load_registry(path: str | os.PathLike = "params.yaml") -> Registry:
    """Read and validate params.yaml. Paths in it are relative to its folder."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", hint="run from the project root or pass --params") from None
    conflict = merge_conflict(path, text)
    if conflict:
        raise ConfigError(conflict, hint=f"{MERGE_CONFLICT_FIX}, then run again")
    try:
        data = yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise ConfigError(
            f"{path}: key {exc.key} appears twice in one mapping (lines {exc.first} and {exc.second}); "
            "YAML would silently keep only the last",
            hint="remove or merge one of them",
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}", hint="fix the syntax at the position shown") from None
    return parse_registry(data, str(path), root=path.resolve().parent)


class _DuplicateKey(Exception):
    def __init__(self, key: str, first: int, second: int):
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _unique_key_loader() -> type:
    """A SafeLoader that refuses a key repeated in one mapping (PyYAML would keep the last). On
    libyaml's C parser where PyYAML has it: the pure-Python one took 0.3 s of every command's
    start on the example's params.yaml."""
    import yaml

    class UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        def construct_document(self, node: yaml.Node) -> Any:
            _check_unique_keys(node, (), set())
            return super().construct_document(node)

    return UniqueKeyLoader


def _check_unique_keys(node: Any, path: tuple[str, ...], seen: set[int]) -> None:
    import yaml

    if id(node) in seen:  # an alias: checked where its anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' keys may be overridden on purpose
                _check_unique_keys(value_node, path, seen)
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else f"<{key_node.tag}>"
            line = key_node.start_mark.line + 1
            if (key_node.tag, key) in lines:
                raise _DuplicateKey(repr(".".join((*path, str(key)))), lines[(key_node.tag, key)], line)
            lines[(key_node.tag, key)] = line
            _check_unique_keys(value_node, (*path, str(key)), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, (*path, str(i)), seen)
