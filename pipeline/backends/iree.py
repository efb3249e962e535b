"""IREE: ONNX imported to MLIR, compiled ahead of time into a VM flatbuffer (``module.vmfb``) for a
CPU (``llvm-cpu``), a Vulkan (SPIR-V) or a CUDA device, run through ``iree.runtime``.

IREE cross-compiles: the compiler builds any target on any host, and only running the engine
needs the device. The one exception is ``target_cpu: host``, which compiles for the build host's
CPU: such a SKU is built on its target hardware. "host" is resolved here, not by LLVM: the
architecture's generic CPU plus the features the host reports (``pipeline.host.probe``). LLVM's
own host detection goes by the CPU's name, and a name implies features a virtual machine may hide
(an Emerald Rapids guest without AMX is still "emeraldrapids", which implies AMX).

The build report lists the dispatches (fusion groups) the compiler produced, read from the
executable sources it dumps: the op and element types are in each dispatch's name, and the ONNX
nodes fused into it are in the MLIR locations the importer attaches to every op.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import re
import shutil
import subprocess
import threading
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.backends.base import Backend
from pipeline.backends.contract import BuildContext, BuildOutcome, Capabilities, EngineMeta, Runner, Staged
from pipeline.backends.opset import convert_opset
from pipeline.core.errors import ConfigError, EnvironmentProblem, InputError, UnsupportedOp, first_line
from pipeline.host import probe
from pipeline.model.graph import all_nodes, default_opset, signature, tensors_to_raw
from pipeline.results.reports import LayerInfo, TensorSig

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from pipeline.project.config import SkuSpec

logger = logging.getLogger(__name__)

VMFB = "module.vmfb"
# what the base class's precision conversion is called in an error that blames it
_PRECISION_STEP = {"fp16": "FP16 conversion", "int8": "INT8 QDQ quantization"}
IMPORTER_MIN_OPSET = 17
COMPILE_TIMEOUT_S = 1800  # a hung compiler must not hang CI; tiny models compile in seconds
_DRIVERS = {"local": ("local-task", "local-sync"), "vulkan": ("vulkan",), "cuda": ("cuda",)}
_HOST_ALIGNMENT = 64  # IREE_HAL_HEAP_BUFFER_ALIGNMENT: what the CPU dispatches assume of a buffer
# the embedded-ELF triples IREE's llvm-cpu backend uses per SKU architecture
_TRIPLES = {"x86_64": "x86_64-unknown-unknown-eabi-elf", "aarch64": "aarch64-unknown-unknown-eabi-elf"}
# flags the backend sets from the options: passing them in extra_flags would contradict the record
_OWNED_FLAGS = (
    "--iree-hal-target-device",
    "--iree-hal-local-target-device-backends",
    "--iree-llvmcpu-target-cpu",
    "--iree-llvmcpu-target-cpu-features",
    "--iree-llvmcpu-target-triple",
    "--iree-vulkan-target",
    "--iree-cuda-target",
    "--iree-hal-dump-executable-sources-to",
    "--mlir-print-debuginfo",
    "--iree-scheduling-dump-statistics-format",
    "--iree-scheduling-dump-statistics-file",
    "-o",
)
_PIP = "pip install 'iree-base-compiler==3.13.*' 'iree-base-runtime==3.13.*'"
# flags that change how fast an engine runs, not what it computes or for which target: in
# extra_flags they are dropped where the model does not build with them (IREE 3.13's im2col
# broke the 1x1 convolutions of a squeeze-excite block at batch 1), unless strict_flags
PERFORMANCE_FLAGS = frozenset(
    {
        "--iree-global-opt-use-im2col-for-convs",
        "--iree-opt-data-tiling",
        "--iree-dispatch-creation-data-tiling",
        "--iree-dispatch-creation-experimental-set-data-tiling-ops",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops",
        "--iree-llvmcpu-enable-ukernels",
        "--iree-opt-level",
        "--iree-opt-aggressively-propagate-transposes",
        "--iree-opt-outer-dim-concat",
        "--iree-opt-const-expr-hoisting",
    }
)


class IreeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target_device: Literal["local", "vulkan", "cuda"] = "local"
    target_backend: Literal["llvm-cpu"] = Field("llvm-cpu", description="code generator of the local device")
    target_cpu: str = Field(
        "host",
        description="LLVM CPU name (e.g. x86-64-v3, znver3, cortex-a76); host: the build "
        "host's CPU, as a generic CPU with the features the host reports",
    )
    target_cpu_features: list[str] = Field(default_factory=list, description="LLVM features, e.g. [+avx2, +fma]")
    vulkan_target: str | None = Field(
        None, description="e.g. llvmpipe (lavapipe), valhall, rdna3, ampere; required for vulkan"
    )
    cuda_target: str = "sm_80"
    extra_flags: list[str] = Field(
        default_factory=list,
        description="passed verbatim to iree-compile, recorded; known performance flags among them "
        "(PERFORMANCE_FLAGS) are dropped where the model does not build with them, unless strict_flags",
    )
    optional_flags: list[str] = Field(
        default_factory=list,
        description="performance flags kept only where the model builds with them: one that makes "
        "iree-compile fail is dropped, with the compiler's error in the build report and a warning",
    )
    strict_flags: bool = Field(False, description="drop no flag: a build that fails with the SKU's flags fails")
    driver: Literal["local-task", "local-sync", "vulkan", "cuda"] | None = Field(
        None, description="runtime HAL driver (default: local-task, vulkan or cuda after target_device)"
    )

    @property
    def runtime_driver(self) -> str:
        return self.driver or _DRIVERS[self.target_device][0]

    @property
    def droppable_flags(self) -> list[str]:
        """The flags a build may go without (in the order given): optional_flags, and the extra_flags
        that only tune speed. Target-defining flags are options of their own and never dropped."""
        if self.strict_flags:
            return []
        known = [f for f in self.extra_flags if f.split("=", 1)[0] in PERFORMANCE_FLAGS]
        return list(dict.fromkeys(known + list(self.optional_flags)))


def _versions() -> dict[str, str]:
    out = {}
    for package in ("iree-base-runtime", "iree-base-compiler", "onnx"):
        # a device running engines need not carry the compiler
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[package] = metadata.version(package)
    return out


class IreeMeta(EngineMeta):
    entry: str
    driver: str
    target_device: str
    inputs: list[TensorSig]
    outputs: list[TensorSig]
    compile_flags: list[str]
    dropped_flags: list[dict[str, str]] = Field(default_factory=list)
    requested_target: dict[str, Any]
    resolved_target: dict[str, Any]


class IreeBackend(Backend):
    name = "iree"
    Options = IreeOptions
    Meta = IreeMeta
    capabilities = Capabilities(
        precisions=("fp32", "fp16"),
        devices=("cpu", "gpu"),
        runtime_package="iree-base-runtime",
        per_node_precision=True,
    )
    install_hint = _PIP
    engine_format = "skuforge-iree-vmfb/1"
    runtime_keys = ("iree-base-runtime",)  # a vmfb is tied to the runtime that loads it

    @classmethod
    def _check_sku_impl(cls, sku: SkuSpec, options: IreeOptions) -> list[str]:
        problems = []
        if options.runtime_driver not in _DRIVERS[options.target_device]:
            problems.append(
                f"options.driver: {options.driver} cannot run a {options.target_device} engine "
                f"(use {' or '.join(_DRIVERS[options.target_device])})"
            )
        if options.target_device == "vulkan" and not options.vulkan_target:
            problems.append(
                "options.vulkan_target: required for target_device vulkan (e.g. llvmpipe for lavapipe, "
                "valhall, rdna3, ampere): a target that does not match the device can run and compute wrong results"
            )
        if options.target_device != "local":
            set_here = sorted({"target_cpu", "target_cpu_features", "target_backend"} & options.model_fields_set)
            if set_here:
                problems.append(f"options.{set_here[0]}: only applies to target_device local")
        if options.target_device == "cuda" and sku.target.device != "gpu":
            problems.append("target.device: a cuda engine runs on a GPU: set target.device: gpu")
        for key in ("extra_flags", "optional_flags"):
            for flag in getattr(options, key):
                if not flag.startswith("-"):
                    problems.append(f"options.{key}: {flag!r} is not a flag (write --name=value)")
                elif flag.split("=", 1)[0] in _OWNED_FLAGS:
                    problems.append(f"options.{key}: {flag.split('=', 1)[0]} is set from the other options; use those")
        both = sorted(set(options.extra_flags) & set(options.optional_flags))
        if both:
            problems.append(f"options.optional_flags: {both[0]} is in extra_flags too; keep it in one list")
        return problems

    def cross_compiles(self, sku: SkuSpec) -> bool:
        opts: IreeOptions = self.options(sku)
        return not (opts.target_device == "local" and opts.target_cpu == "host")

    def environment_problems(self, sku: SkuSpec, purpose: str = "run") -> list[str]:
        if purpose == "build":
            return _compiler_problems()
        return list(_runtime_problems(self.options(sku).runtime_driver))

    def versions(self) -> dict[str, str]:
        return _versions()

    # --- build ----------------------------------------------------------------------------------

    def _adapt(self, model: onnx.ModelProto, ctx: BuildContext, staged: Staged) -> onnx.ModelProto:
        import onnx

        original = model
        # the importer lowers ops as defined from opset 17 on (older MaxPool, Slice, ... have no lowering)
        model, conversion = convert_opset(
            model,
            max(default_opset(model), IMPORTER_MIN_OPSET),
            ctx.probe_inputs,
            f"IREE's ONNX importer lowers ops from opset {IMPORTER_MIN_OPSET} on",
        )
        # each conversion's input, newest first: an import failure is checked against them (_import_failure)
        earlier = [(_PRECISION_STEP[ctx.sku_spec.precision], staged.source)] if ctx.sku_spec.precision != "fp32" else []
        if conversion is not None:
            tensors_to_raw(original)
            onnx.save(original, str(staged.work / "unconverted.onnx"))
            step = f"opset conversion from {conversion.from_opset} to {conversion.to_opset}"
            earlier.append((step, staged.work / "unconverted.onnx"))
        tensors_to_raw(model)  # the importer reads raw_data, not every typed field (FP16 in int32_data)
        staged.notes.update(
            conversion=conversion, entry=_entry_name(model), signature=signature(model), earlier=earlier
        )
        return model

    def _build_impl(self, ctx: BuildContext, staged: Staged) -> BuildOutcome:
        opts: IreeOptions = staged.options
        conversion, entry, sig = staged.notes["conversion"], staged.notes["entry"], staged.notes["signature"]
        work = staged.work
        # the graph as imported (with the FP16 converter's casts), in graph order
        node_types = {n.name: n.op_type for n in staged.model.graph.node if n.name}
        # a refusal may name a node inside an If/Loop/Scan body: those are known by name too
        named = {n.name: n.op_type for n in all_nodes(staged.model.graph) if n.name} | node_types
        _progress(ctx, "iree import", 0.1)
        try:
            _to_mlir(staged.source, work / "input.mlir")
        except _ImportRefused as exc:
            raise _import_failure(exc, named, staged.notes["earlier"], work, (ctx.model, ctx.sku)) from exc
        _progress(ctx, "iree compile", 0.3)
        flags, dropped = _compile(
            work, compile_flags(opts, ctx.sku_spec.target.arch), opts.droppable_flags, ctx.engine_dir / VMFB, named
        )
        dispatches = parse_dispatches(work / "sources", list(node_types), opts.runtime_driver)
        target = _resolved_target(work / "sources")
        sites = _dispatch_sites(work / "statistics.json")
        if not dispatches:
            raise EnvironmentProblem(
                "iree-compile dumped no executable sources: the dispatch report would be empty",
                hint="check the extra_flags; this IREE version may name its dumps differently",
            )
        warnings = [conversion.warning()] if conversion else []
        warnings += [
            f"iree-compile failed with {d['flag']} on this model ({d['error']}): built without it, so the "
            "engine may be slower than the SKU's flags intend (options.strict_flags: true makes this a failure)"
            for d in dropped
        ]
        hardware_specific = opts.target_device == "local" and opts.target_cpu == "host"
        requested = (
            {"cpu": opts.target_cpu, "cpu_features": opts.target_cpu_features} if opts.target_device == "local" else {}
        )
        if hardware_specific:
            warnings.append(
                f"target_cpu host resolved to {target.get('cpu')} with {len(target.get('cpu_features', []))} "
                "CPU features (those this host reports): the engine runs only on CPUs that have them (a CPU "
                "without one crashes with an illegal instruction; loading checks this)"
            )
        fused = sum(1 for d in dispatches if len(d.fused_from) > 1)
        if not any(d.fused_from for d in dispatches):
            warnings.append("no ONNX node locations survived in the dumped dispatches: fused_from is empty")
        meta = IreeMeta(
            entry=entry,
            driver=opts.runtime_driver,
            target_device=opts.target_device,
            inputs=sig.inputs,
            outputs=sig.outputs,
            compile_flags=flags,
            dropped_flags=dropped,
            requested_target=requested,
            resolved_target=target,
            # the reported flags the target was resolved from
            host_cpu=probe.cpu_record() if hardware_specific else None,
        )
        options = {
            **opts.model_dump(mode="json"),
            "compile_flags": flags,
            "dropped_flags": dropped,
            "requested_target": requested,
            "resolved_target": target,
            "dispatches": len(dispatches),
            "fused_dispatches": fused,
            "dispatch_sites": sites,
            "opset_conversion": conversion.to_json() if conversion else None,
        }
        return BuildOutcome(
            files=[VMFB],
            layers=dispatches,
            requested_devices=[opts.runtime_driver],
            partition_boundaries=0,
            options=options,
            hardware_specific=hardware_specific,
            warnings=warnings,
            meta=meta,
        )

    # --- load -----------------------------------------------------------------------------------

    def _load_impl(self, engine_dir: Path, meta: IreeMeta, sku: SkuSpec) -> Runner:
        problems = list(_runtime_problems(meta.driver))
        if problems:
            raise EnvironmentProblem(
                "; ".join(problems),
                hint=f"run it where the {meta.driver} device is "
                f"(the SKU's runner labels: {', '.join(sku.runner_labels)}); {self.install_hint}",
            )
        if meta.target_device == "local":
            missing = missing_cpu_features(meta.resolved_target.get("cpu_features", []))
            if missing:
                raise EnvironmentProblem(
                    f"{engine_dir} was compiled for CPU {meta.resolved_target.get('cpu')} with features this CPU "
                    f"lacks: {', '.join(missing)}",
                    hint="rebuild it on this host (target_cpu: host), or with an options.target_cpu this CPU supports "
                    "(e.g. x86-64-v3), or run it on the SKU's runner",
                )
        return IreeRunner(engine_dir / VMFB, meta)


# --- environment --------------------------------------------------------------------------------


def _compiler_problems() -> list[str]:
    problems = []
    if importlib.util.find_spec("onnx") is None:
        problems.append("onnx is not installed (the IREE ONNX importer needs it): pip install onnx")
    if importlib.util.find_spec("iree.compiler") is None:
        return problems + [f"iree-base-compiler is not installed ({_PIP})"]
    if _iree_compile() is None:
        problems.append("iree-compile was not found in the iree-base-compiler installation (reinstall it)")
    return problems


@functools.cache
def _runtime_problems(driver: str) -> tuple[str, ...]:
    """Cached per process: every stage asks, and creating a Vulkan or CUDA device takes a while."""
    if importlib.util.find_spec("iree.runtime") is None:
        return (f"iree-base-runtime is not installed ({_PIP})",)
    import iree.runtime as rt

    available = rt.query_available_drivers()
    if driver not in available:
        return (
            f"IREE runtime driver {driver} is not in this iree-base-runtime "
            f"(available: {', '.join(sorted(available))})",
        )
    try:
        rt.get_driver(driver).create_default_device()
    except Exception as exc:  # the runtime raises RuntimeError/ValueError with the driver's status
        detail = first_line(exc)
        return (f"no {driver} device on this host ({detail})",)
    return ()


def _iree_compile() -> str | None:
    from iree.compiler.tools.binaries import find_tool

    try:
        return find_tool("iree-compile")
    except Exception:  # find_tool raises a plain Exception when the binary is absent
        return None


def missing_cpu_features(required: list[str]) -> list[str]:
    """Features an engine was compiled for (``+name``, LLVM names) that this CPU does not report
    (``/proc/cpuinfo``, the probe every host target is resolved from); features without a
    reported flag are not judged."""
    return probe.missing_llvm_features(required)


# --- import and compile -------------------------------------------------------------------------

_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _entry_name(model: onnx.ModelProto) -> str:
    """The entry function is named after the graph; give it a plain name when the graph's is not one."""
    if not _SYMBOL.match(model.graph.name or ""):
        model.graph.name = re.sub(r"\W", "_", model.graph.name or "") if model.graph.name else "main"
        if not _SYMBOL.match(model.graph.name):
            model.graph.name = f"m_{model.graph.name}"
    return model.graph.name


class _ImportRefused(Exception):
    """IREE's ONNX importer refused a model: its message and the model as it was read."""

    def __init__(self, message: str, model: onnx.ModelProto):
        super().__init__(message)
        self.message, self.model = message, model


def _import_onnx(source: Path, out: Path, node_types: dict[str, str]) -> None:
    """ONNX -> MLIR (torch-onnx dialect) with each op located at its ONNX node name, so the
    compiler's dumped dispatches say which nodes were fused into them; a refusal is the error
    ``import_error`` makes of it (``node_types``: the graph's node names and ops)."""
    try:
        _to_mlir(source, out)
    except _ImportRefused as exc:
        raise import_error(exc.message, exc.model, node_types) from exc


def _to_mlir(source: Path, out: Path) -> None:
    """The import itself; _ImportRefused when the importer refuses the model."""
    import onnx
    from iree.compiler.extras import onnx_importer
    from iree.compiler.ir import Context

    model = onnx.shape_inference.infer_shapes(onnx.load(str(source)), data_prop=True)
    try:
        info = onnx_importer.ModelInfo(model)
        module = info.create_module(context=Context()).operation
        onnx_importer.NodeImporter.define_function(info.main_graph, module).import_all()
        module.verify()
    except Exception as exc:  # OnnxImportError or an MLIR error: both name the node or tensor in the message
        raise _ImportRefused(str(exc) or type(exc).__name__, model) from exc
    with open(out, "w") as fh:
        module.print(file=fh, enable_debug_info=True)


def _import_failure(
    refused: _ImportRefused,
    node_types: dict[str, str],
    earlier: list[tuple[str, Path]],
    work: Path,
    pair: tuple[str, str] = ("<model>", "<sku>"),
) -> Exception:
    """The error for a graph the importer refused. When it was converted (FP16, opset) and the graph
    it was converted from imports, the conversion broke it, not the op: say so (never UnsupportedOp,
    whose hint is to replace the op). ``earlier``: each conversion's input, newest first."""
    import onnx

    for step, before in earlier:
        try:
            _to_mlir(before, work / "unconverted.mlir")
        except _ImportRefused:
            continue  # refused before this step too: an earlier step, or the model, is the cause
        node, op_type, tensor = _refused_at(refused.message, refused.model, node_types)
        where = f" at node {node!r} ({op_type}{f', its input {tensor!r}' if tensor else ''})" if node else ""
        if step in _PRECISION_STEP.values():
            names = {n.name for n in onnx.load(str(before), load_external_data=False).graph.node}
            model, sku = pair
            keep = (
                f"keep {node!r} precise (models.{model}.higher_precision.{sku}: [{node}]), or " if node in names else ""
            )
            hint = (
                f"{keep}build this model at fp32; report it to skuforge with the model (the {step} "
                "should keep it valid)"
            )
        else:
            hint = "re-export the model from its framework at opset 17 or newer; report it to skuforge with the model"
        return EnvironmentProblem(
            f"the {step} broke the model for IREE's ONNX importer (it imports the model before the "
            f"conversion and refuses it after){where}: {first_line(refused.message)}",
            hint=hint,
        )
    return import_error(refused.message, refused.model, node_types)


_PROTO_NAME = re.compile(r'^name: "((?:[^"\\]|\\.)*)"', re.M)


def _refused_at(
    message: str, model: onnx.ModelProto, node_types: dict[str, str]
) -> tuple[str | None, str | None, str | None]:
    """The node (and its op) an importer message names, directly or through a tensor the node reads
    (then also the tensor)."""
    quoted = [n for n in node_types if f"'{n}'" in message or f'"{n}"' in message]
    named = _PROTO_NAME.findall(message)  # the importer prints the offending NodeProto or TensorProto
    node = next((n for n in named if n in node_types), None) or next(iter(quoted), None)
    if node is not None:
        return node, node_types[node], None
    for name in named + [q for q in re.findall(r"'([^']+)'", message)]:
        reader = next((n for n in all_nodes(model.graph) if name in n.input), None)
        if reader is not None:
            return reader.name or reader.output[0], reader.op_type, name
    return None, None, None


def import_error(message: str, model: onnx.ModelProto, node_types: dict[str, str]) -> Exception:
    """The importer's failure as the error the user can act on: UnsupportedOp naming the node the
    message names (directly, or through a tensor the node reads), else InputError (never an
    environment problem: the importer ran)."""
    node, op_type, tensor = _refused_at(message, model, node_types)
    if node is None:
        return InputError(
            f"IREE's ONNX importer refused the model: {first_line(message)}",
            hint="ONNX Runtime runs this model but iree-import-onnx cannot read it: use another backend "
            "for this model, or report it to iree-org/iree with the model",
        )
    what = f" (its input {tensor!r})" if tensor else ""
    return UnsupportedOp("iree", op_type, node, f"the ONNX importer failed{what}: {first_line(message)}")


def compile_flags(opts: IreeOptions, arch: str) -> list[str]:
    """iree-compile flags for the options (recorded in the engine and the build report).
    ``target_cpu: host`` becomes the generic CPU of ``arch`` and the features this host reports."""
    flags = [f"--iree-hal-target-device={opts.target_device}"]
    if opts.target_device == "local":
        cpu, features = probe.resolve_llvm_target(opts.target_cpu, opts.target_cpu_features, arch)
        flags += [f"--iree-hal-local-target-device-backends={opts.target_backend}", f"--iree-llvmcpu-target-cpu={cpu}"]
        if arch in _TRIPLES:
            flags.append(f"--iree-llvmcpu-target-triple={_TRIPLES[arch]}")
        if features:
            flags.append(f"--iree-llvmcpu-target-cpu-features={','.join(features)}")
    elif opts.target_device == "vulkan":
        flags.append(f"--iree-vulkan-target={opts.vulkan_target}")
    else:
        flags.append(f"--iree-cuda-target={opts.cuda_target}")
    return flags + list(opts.extra_flags) + list(opts.optional_flags)


def _compile(
    work: Path, flags: list[str], droppable: list[str], out: Path, node_types: dict[str, str]
) -> tuple[list[str], list[dict[str, str]]]:
    """Compile with ``flags``; when that fails and some of them are ``droppable``, find the flags the
    model builds with by building: without all droppable flags (if that fails too, its error is
    raised: the flags were not the cause), then adding them back one at a time, keeping each that
    still builds. Returns the flags used and, per dropped flag, the compiler error that dropped it."""
    first = _run_compile(work, flags, out)
    if first is None:
        return flags, []
    error = compile_error(first.returncode, first.stderr, node_types, first.args, work)
    droppable = [f for f in droppable if f in flags]
    if not droppable or isinstance(error, ConfigError) or _out_of_space(first.stderr):
        raise error
    logger.info("iree-compile failed with the SKU's flags; retrying without %s", " ".join(droppable))
    baseline = [f for f in flags if f not in droppable]
    on_disk: list[str] | None = baseline  # the flags whose outputs are in the work folder, if they built
    failed = _run_compile(work, baseline, out)
    if failed is not None:
        raise compile_error(failed.returncode, failed.stderr, node_types, failed.args, work)
    kept: list[str] = []
    dropped: list[dict[str, str]] = []
    for flag in droppable:
        trial = [f for f in flags if f not in droppable or f in kept or f == flag]
        if trial == flags:  # all of them together: the build that failed first, not run again
            failed = first
        else:
            failed = _run_compile(work, trial, out)
            on_disk = trial if failed is None else None
        if failed is None:
            kept.append(flag)
        else:
            dropped.append({"flag": flag, "error": _first_error(failed.stderr, failed.returncode)})
    final = [f for f in flags if f not in droppable or f in kept]
    if on_disk != final:  # the last build tried failed: its dumps replaced those of the flags kept
        failed = _run_compile(work, final, out)
        if failed is not None:  # it built a moment ago: the compiler is not deterministic
            raise compile_error(failed.returncode, failed.stderr, node_types, failed.args, work)
    for d in dropped:
        logger.warning("iree-compile failed with %s (%s): built without it", d["flag"], d["error"])
    return final, dropped


def _run_compile(work: Path, flags: list[str], out: Path) -> subprocess.CompletedProcess[str] | None:
    """One iree-compile run in ``work``; None when it succeeded, else the failed process."""
    # relative dump path and cwd: the vmfb embeds the dump path, and must not depend on the temp dir
    cmd = [
        _iree_compile() or "iree-compile",
        "input.mlir",
        *flags,
        "--iree-hal-dump-executable-sources-to=sources",
        "--mlir-print-debuginfo",
        "--iree-scheduling-dump-statistics-format=json",
        "--iree-scheduling-dump-statistics-file=statistics.json",
        "-o",
        str(out.resolve()),
    ]
    # a failed run's dumps must not be read as this run's
    shutil.rmtree(work / "sources", ignore_errors=True)
    (work / "statistics.json").unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise EnvironmentProblem(
            f"iree-compile did not finish in {COMPILE_TIMEOUT_S} s",
            hint="the model may be too large for this host, or the compiler hangs on an op: "
            "report it to IREE with the model",
        ) from exc
    return proc if proc.returncode != 0 else None


def _out_of_space(stderr: str) -> bool:
    return "No space left on device" in stderr or "ENOSPC" in stderr


def _first_error(stderr: str, returncode: int) -> str:
    """The compiler's first error line (else its first line, else the exit status)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[0] if lines else f"exit status {returncode}")


_LEGALIZE = re.compile(r"failed to legalize operation '([^']+)'")
_TORCH_OP = re.compile(r'name = "onnx\.(\w+)"')


def compile_error(
    returncode: int, stderr: str, node_types: dict[str, str], cmd: list[str], work: Path | None = None
) -> Exception:
    """Turn iree-compile's diagnostics into the error the user can act on (``work``: its scratch folder)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    first = _first_error(stderr, returncode)
    shown = "\n".join(lines[:12])
    if _out_of_space(stderr):  # before the crash check: LLVM may abort on it
        out = Path(cmd[cmd.index("-o") + 1]).parent if "-o" in cmd[:-1] else None
        folders = " and ".join(
            f"{name} {folder}" for name, folder in (("the engine folder", out), ("the scratch folder", work)) if folder
        )
        line = next((ln for ln in reversed(lines) if "No space left on device" in ln or "ENOSPC" in ln), first)
        return EnvironmentProblem(
            f"iree-compile ran out of disk space writing {folders or 'its output'}: {line.strip()}",
            hint="free space on the disk(s) holding those folders (the scratch folder is under TMPDIR: "
            "point it at a larger disk) and rebuild",
        )
    if "Unknown command line argument" in stderr or "Unknown Vulkan target" in stderr or "missing GPU target" in stderr:
        return ConfigError(
            f"iree-compile refused the flags {' '.join(cmd[2:])}: {first.strip()}",
            hint="fix options.extra_flags / vulkan_target / cuda_target (iree-compile --help lists flags)",
        )
    if returncode < 0 or "Stack dump" in stderr or "PLEASE submit a bug report" in stderr:
        return UnsupportedOp(
            "iree",
            None,
            None,
            f"iree-compile crashed (exit {returncode}) on this model:\n{shown}",
            hint="a compiler bug triggered by one of the model's ops: use another backend for this "
            "model, or report it to iree-org/iree with the model",
        )
    for line in errors:
        node = next((n for n in _loc_names(line) if n in node_types), None)
        if node is None:
            continue
        legal = _LEGALIZE.search(line)
        detail = line.split("error:", 1)[1].strip()
        if legal:
            torch_op = _TORCH_OP.search(line)
            lowered = f"onnx.{torch_op.group(1)}" if torch_op else legal.group(1)
            detail = f"no lowering for {lowered} (failed to legalize {legal.group(1)})"
        return UnsupportedOp("iree", node_types[node], node, detail)
    return EnvironmentProblem(
        f"iree-compile failed (exit {returncode}): {first.strip()}\n{shown}",
        hint="see the compiler's messages above; check options.extra_flags",
    )


def _progress(ctx: BuildContext, label: str, fraction: float) -> None:
    if ctx.progress is not None:
        ctx.progress(label, fraction)


# --- the dispatch report ------------------------------------------------------------------------

_EXPORT = re.compile(r'hal\.executable\.export public @("(?:[^"\\]|\\.)*"|[\w$.\-]+)')
_VARIANT = re.compile(r'hal\.executable\.variant public @\S+ target\(<"([^"]+)", "([^"]+)"')
_LOC_ALIAS = re.compile(r"^(#loc\w*) = loc\((.*)\)\s*$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_OP = re.compile(r'^(?:%[^=]+= )?"?([a-z_][\w]*\.[\w.]+)')
_SHAPE = re.compile(r"^(\d+|D)(x(\d+|D))*(x\w+)?$")
_ELEMENT = re.compile(r"^(bf16|f16|f32|f64|f8\w*|i1|i4|i8|i16|i32|i64)$")
# ops that bind, load, store, allocate or initialise: their locations name a neighbour, not a
# fused node (CSE merges identical empties and fills graph-wide, keeping the first node's location)
_PLUMBING = (
    "hal.",
    "iree_tensor_ext.",
    "arith.constant",
    "tensor.empty",
    "linalg.fill",
    "func.return",
    "linalg.yield",
    "scf.yield",
)
# conversions and layout ops: a dispatch made only of these moves data and has no compute precision
_MOVES = {
    "arith.extf",
    "arith.truncf",
    "arith.extsi",
    "arith.extui",
    "arith.trunci",
    "arith.index_cast",
    "arith.bitcast",
    "linalg.generic",
    "linalg.fill",
    "linalg.copy",
    "linalg.transpose",
    "linalg.broadcast",
}
_PRECISIONS = {"f16": "fp16", "bf16": "bf16", "f32": "fp32", "f64": "fp64"}
_NARROW_FIRST = ("f8", "bf16", "f16", "f32", "f64")
_CONTRACTIONS = ("conv", "matmul", "batch_matmul", "contract", "mmt4d", "depthwise")


def parse_dispatches(sources: Path, node_names: list[str], device: str) -> list[LayerInfo]:
    """One LayerInfo per dispatch in the executable sources iree-compile dumped; ``node_names``
    are the imported graph's nodes in graph order (the order of each ``fused_from``)."""
    order = {n: i for i, n in enumerate(node_names)}
    files = sorted(
        sources.glob("*.mlir"), key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]
    )
    layers = []
    for path in files:
        text = path.read_text()
        aliases = {m.group(1): m.group(2) for m in map(_LOC_ALIAS.match, text.splitlines()) if m}
        for export in _EXPORT.finditer(text):
            name = export.group(1).strip('"')
            body = _function_body(text, name)
            ops, fused, own = _body_ops_and_locs(body, aliases, order)
            layers.append(
                LayerInfo(
                    name=name,
                    op_type=dispatch_op_type(name),
                    precision=dispatch_precision(name, ops, body),
                    device=device,
                    kernel=name,
                    fused_from=sorted(fused, key=order.__getitem__) or own,
                )
            )
    return layers


def _function_body(text: str, name: str) -> list[str]:
    start = text.find(f"func.func @{name}(")
    if start < 0:
        start = text.find(f'func.func @"{name}"(')
    return text[start:].splitlines()[1:] if start >= 0 else []


def _loc_names(line: str, aliases: dict[str, str] | None = None) -> list[str]:
    """Names in the location at the end of an MLIR line (aliases resolved)."""
    at = line.rfind(" loc(")
    if at < 0:
        at = line.find("loc(")
        if at < 0:
            return []
    loc = line[at:]
    for _ in range(8):  # aliases may refer to aliases
        refs = re.findall(r"#loc\w*", loc)
        if not refs or not aliases:
            break
        for ref in refs:
            loc = loc.replace(ref, aliases.get(ref, ""), 1)
    return _QUOTED.findall(loc)


def _body_ops_and_locs(
    body: list[str], aliases: dict[str, str], node_names: dict[str, int]
) -> tuple[list[str], list[str], list[str]]:
    """The compute ops of a dispatch, the ONNX nodes their locations name (in order) and the
    nodes the function itself is located at (the fallback for a pure copy)."""
    ops: list[str] = []
    fused: list[str] = []
    own: list[str] = []
    for raw in body:
        line = raw.strip()
        if line.startswith("^") or not line:
            continue
        if line.startswith("}"):
            target = fused if line.startswith("} ->") else own  # "} ->" closes a linalg op
            for n in _loc_names(line, aliases):
                if n in node_names and n not in target:
                    target.append(n)
            continue
        match = _OP.match(line)
        if match is None or match.group(1).startswith(_PLUMBING) or match.group(1) == "return":
            continue
        ops.append(match.group(1))
        for n in _loc_names(line, aliases):
            if n in node_names and n not in fused:
                fused.append(n)
    return ops, fused, own[-1:] if own else []


def _name_tokens(name: str) -> list[str]:
    tail = re.split(r"dispatch_\d+_?", name, maxsplit=1)
    return [t for t in (tail[1] if len(tail) > 1 else name).split("_") if t]


def dispatch_op_type(name: str) -> str:
    """The root op in a dispatch name: conv_8x8x8x3x3x3_f32 -> conv, matmul_like_... -> matmul_like."""
    words = []
    for token in _name_tokens(name):
        if _SHAPE.match(token) or _ELEMENT.match(token) or all(_ELEMENT.match(t) for t in token.split("x")):
            break
        words.append(token)
    return "_".join(words) or "dispatch"


def _element_types(tokens: list[str]) -> list[str]:
    types = []
    for token in tokens:
        types += [t for t in token.split("x") if _ELEMENT.match(t)]
    return types


def dispatch_precision(name: str, ops: list[str], body: list[str]) -> str:
    """The precision a dispatch computes in, from the element types in its name (IREE names a
    dispatch ``<root op>_<shape>_<operand types>``): a contraction (conv, matmul) by its narrowest
    float input (the accumulator is wider by design), any other root op by its result type (a
    reduction accumulates in it). Conversions and copies are "n/a"."""
    if not any(op not in _MOVES for op in ops):
        return "n/a"
    types = _element_types(_name_tokens(name))
    if not types:  # the name carries no types: take those the dispatch writes
        types = re.findall(r"writeonly:tensor<(?:[\dx?]*x)?(\w+)>", "\n".join(body))
    floats = [t for t in types if t.startswith(("f", "bf"))]
    if dispatch_op_type(name).startswith(_CONTRACTIONS) and len(floats) > 1:
        floats = floats[:-1]
        chosen = min(floats, key=lambda t: next(i for i, p in enumerate(_NARROW_FIRST) if t.startswith(p)))
    elif types and types[-1] in floats:
        chosen = types[-1]
    else:
        return "int8" if "i8" in types else "n/a"  # integer index arithmetic is not judged
    return "fp8" if chosen.startswith("f8") else _PRECISIONS.get(chosen, chosen)


def _dispatch_sites(statistics: Path) -> int | None:
    """How many dispatches the program issues: more than its executables when one executable
    serves several identical call sites (reported once, under the site the compiler kept)."""
    import json

    try:
        return int(json.loads(statistics.read_text())["stream-aggregate"]["execution"]["dispatch-count"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _resolved_target(sources: Path) -> dict[str, Any]:
    """What the compiler resolved the target to (e.g. target_cpu x86-64-v3 -> its features)."""
    for path in sorted(sources.glob("*.mlir")):
        text = path.read_text()
        variant = _VARIANT.search(text)
        if variant is None:
            continue
        out: dict[str, Any] = {"backend": variant.group(1), "format": variant.group(2)}
        for key, pattern in (
            ("cpu", r'\bcpu = "([^"]*)"'),
            ("cpu_features", r'\bcpu_features = "([^"]*)"'),
            ("triple", r'\btarget_triple = "([^"]*)"'),
            ("gpu_arch", r'iree_gpu\.target<arch = "([^"]*)"'),
            ("gpu_features", r'iree_gpu\.target<arch = "[^"]*", features = "([^"]*)"'),
        ):
            found = re.search(pattern, text)
            if found:
                out[key] = found.group(1)
        if "cpu_features" in out:
            # LLVM lists some features twice; keep the enabled ones, sorted, as the record
            out["cpu_features"] = sorted({f for f in out["cpu_features"].split(",") if f.startswith("+")})
        return out
    return {}


# --- running ------------------------------------------------------------------------------------


class IreeRunner(Runner):
    """A loaded vmfb on one HAL device. Calls are serialised: an IREE VM context is not safe to
    invoke from several threads at once.

    On the local (CPU) drivers a call does what ``iree-benchmark-module`` does and no more: the
    argument list is built once and reused, each input a host buffer imported into the device once
    (the caller's own array, without a copy, where it is aligned as IREE's kernels assume; else a
    runner-owned aligned array the feed is copied into), the function handle looked up at load; the
    outputs are copied from their mapped buffers into new arrays (a caller keeps them; an output may
    be the input's own buffer, which the next call overwrites). Other drivers copy every input into
    a new device buffer per call and read outputs through a staging buffer where the host cannot map
    them (``_read``)."""

    def __init__(self, vmfb: Path, meta: IreeMeta):
        import iree.runtime as rt
        import numpy as np

        super().__init__(list(meta.inputs), [o.name for o in meta.outputs])
        self._rt, self._np = rt, np
        self._out_dtypes = [np.dtype(o.dtype) for o in meta.outputs]
        self._lock = threading.Lock()
        driver, entry = meta.driver, meta.entry
        try:
            self._config = rt.Config(driver)
            self._context = rt.SystemContext(config=self._config)
            module = rt.VmModule.copy_buffer(self._config.vm_instance, vmfb.read_bytes())
            self._context.add_vm_module(module)
        except (RuntimeError, ValueError) as exc:
            detail = first_line(exc)
            raise InputError(
                f"{vmfb} cannot be loaded on the IREE {driver} driver: {detail}",
                hint="the file is damaged, from another IREE version or for another device: rebuild the engine",
            ) from exc
        self._device, self._driver = self._config.device, driver
        self._allocator = self._device.allocator
        from iree.runtime.array_interop import map_dtype_to_element_type

        # the per-call lookups cost ~0.7 us (input dtype) and ~3 us (output element type): kept as met
        self._element_type = functools.lru_cache(maxsize=None)(map_dtype_to_element_type)
        self._raw_dtype = functools.lru_cache(maxsize=None)(rt.HalElementType.map_to_dtype)
        self._host_visible, self._mapping = int(rt.MemoryType.HOST_VISIBLE), int(rt.BufferUsage.MAPPING_SCOPED)
        self._function = module.lookup_function(entry)
        if self._function is None:
            raise InputError(
                f"{vmfb} has no function {entry!r} (it has {', '.join(module.function_names)})",
                hint="engine.json and the vmfb disagree: rebuild the engine",
            )
        self._vm_context = self._context.vm_context
        self._local_driver = driver in _DRIVERS["local"]
        self._input_names = [sig.name for sig in self.inputs]
        # per input: (the caller's array imported as it is, or None where the feed is copied into
        # ``host``; host: the array the device reads; the imported buffer, kept while it is bound;
        # host's shape and dtype)
        self._bound: list[Any] = [None] * len(self.inputs)
        self._args: Any = None  # the VmVariantList of the bound inputs; None: build it again
        self._out_raw: list[Any] = [None] * len(self.output_names)  # per output, (returned dtype, cast to)

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``Runner.infer``, but for the bench loop's case on a local driver: feeds of the shapes
        and dtypes of the inputs bound at the last call (which passed every check then), each the
        same array as was imported or one to copy into the bound one, run without checking them
        again. Written for the fewest interpreter steps: right after the dispatches each costs
        several times what it does in a tight loop."""
        with self._lock:
            args = self._args
            if args is not None:
                try:
                    for name, slot in zip(self._input_names, self._bound):  # noqa: B905 (one per input)
                        arr = feeds[name]
                        if arr.shape != slot[3] or arr.dtype is not slot[4]:
                            break
                        if slot[0] is None:
                            self._np.copyto(slot[1], arr)
                        elif slot[0] is not arr:
                            break
                    else:
                        return self._invoke(args)
                except (KeyError, TypeError, AttributeError):  # not given, not bound, not an array: the checks say
                    pass
        return super().infer(feeds)

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            args = self._bind_inputs(feeds) if self._local_driver else None
            if args is None:  # not a local driver, or it cannot import host memory: copies, per call
                args = self._copy_inputs(feeds)
            return self._invoke(args)

    def _invoke(self, args: Any) -> dict[str, np.ndarray]:
        """Run the function on ``args`` (the lock held); its outputs, copied."""
        rt = self._rt
        results = rt.VmVariantList(len(self.output_names))
        try:
            self._vm_context.invoke(self._function, args, results)
        except (RuntimeError, ValueError) as exc:  # the runtime's status: a failed assertion, a lost device
            raise EnvironmentProblem(
                f"the IREE {self._driver} runtime failed to run the engine: {exc}",
                hint="the engine and this device or runtime disagree: rebuild it for this SKU, or check the device",
            ) from exc
        if not self._local_driver:
            return {
                name: self._read(results.get_as_object(i, rt.HalBufferView), dtype)
                for i, (name, dtype) in enumerate(zip(self.output_names, self._out_dtypes, strict=True))
            }
        # host memory: each output's mapping copied into a new array, in as few numpy calls as can
        # be (right after the dispatches each costs ~2 us, ~4x its cost in a tight loop: asarray
        # ~8 us, frombuffer + reshape + copy ~6, ndarray + copy ~3.5); its element type read once
        ndarray, view_type, out = self._np.ndarray, rt.HalBufferView, {}
        for i, name in enumerate(self.output_names):
            view = results.get_as_object(i, view_type)
            raw = self._out_raw[i]
            if raw is None:  # the dtype the module returns, and the engine's where they differ
                dtype = self._raw_dtype(view.element_type)
                raw = self._out_raw[i] = (dtype, None if dtype == self._out_dtypes[i] else self._out_dtypes[i])
            host = ndarray(view.shape, raw[0], view.map()).copy()
            out[name] = host if raw[1] is None else host.astype(raw[1])
        return out

    def _copy_inputs(self, feeds: dict[str, np.ndarray]) -> Any:
        """The arguments as new device buffers holding copies of the feeds (any driver)."""
        rt, np = self._rt, self._np
        args = rt.VmVariantList(len(self.inputs))
        for name in self._input_names:
            arr = np.asarray(feeds[name], order="C")  # keeps 0-d arrays 0-d
            args.push_ref(
                self._allocator.allocate_buffer_copy(
                    memory_type=rt.MemoryType.DEVICE_LOCAL,
                    allowed_usage=rt.BufferUsage.DEFAULT,
                    device=self._device,
                    buffer=arr,
                    element_type=self._element_type(arr.dtype),
                )
            )
        return args

    def _bind_inputs(self, feeds: dict[str, np.ndarray]) -> Any | None:
        """The arguments on a local driver: the host arrays bound at an earlier call, reused while
        the feeds are the same arrays (read again in place) or, for a copied input, of the same
        shape (the feed copied in); bound again otherwise. None where the runtime refuses to import
        a host array (the caller copies instead)."""
        bound, changed, asarray = self._bound, False, self._np.asarray
        for i, name in enumerate(self._input_names):
            arr, slot = asarray(feeds[name]), bound[i]  # the array itself where it is one (a scalar: a new one)
            if slot is not None and slot[3] == arr.shape and slot[4] == arr.dtype:
                if slot[0] is arr:
                    continue
                if slot[0] is None:
                    self._np.copyto(slot[1], arr)
                    continue
            try:
                bound[i], changed = self._import(arr), True
            except (RuntimeError, ValueError, TypeError, BufferError) as exc:
                logger.debug("IREE %s cannot import host arrays (%s): inputs copied per call", self._driver, exc)
                self._bound, self._args, self._local_driver = [None] * len(bound), None, False
                return None
        if changed or self._args is None:
            rt = self._rt
            args = rt.VmVariantList(len(bound))
            for slot in bound:
                args.push_ref(rt.HalBufferView(slot[2], list(slot[3]), self._element_type(slot[4])))
            self._args = args
        return self._args

    def _import(self, arr: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, Any, tuple[int, ...], Any]:
        """``arr`` imported as a device buffer without a copy where IREE's kernels can read it in
        place (C order, writable, 64-byte aligned: the CPU dispatches assume their buffers are);
        else a new aligned array holding a copy of it, imported."""
        np, rt = self._np, self._rt
        flags = arr.flags
        if flags.c_contiguous and flags.writeable and arr.ctypes.data % _HOST_ALIGNMENT == 0 and arr.size:
            shared, host = arr, arr
        else:
            shared, host = None, _aligned_empty(np, arr.shape, arr.dtype)
            np.copyto(host, arr)
        buffer = self._allocator.import_host_allocation(
            host, int(rt.MemoryType.DEVICE_LOCAL), int(rt.BufferUsage.DEFAULT)
        )
        return shared, host, buffer, host.shape, host.dtype

    def _read(self, view: Any, dtype: np.dtype) -> np.ndarray:
        """Copy an output to the host. A buffer the host cannot map (Vulkan device-local memory)
        goes through a host-visible staging buffer: DeviceArray.to_host() would try to import a
        numpy allocation instead, which lavapipe refuses (minImportedHostPointerAlignment 4096)."""
        rt, np = self._rt, self._np
        raw = self._raw_dtype(view.element_type)
        buffer = view.get_buffer()
        if (buffer.memory_type() & self._host_visible) != self._host_visible or (
            buffer.allowed_usage() & self._mapping
        ) != self._mapping:
            staging = self._device.allocator.allocate_buffer(
                memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
                allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
                allocation_size=buffer.byte_length(),
            )
            sem = self._device.create_semaphore(0)
            self._device.queue_copy(buffer, staging, rt.HalFence.create_at(sem, 0), rt.HalFence.create_at(sem, 1))
            rt.HalFence.create_at(sem, 1).wait()
            buffer = staging
        host = np.array(buffer.map().asarray(list(view.shape), raw), copy=True)
        return host if host.dtype == dtype else host.astype(dtype)

    def profile_layers(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> dict[str, float] | None:
        """None: the default runtime does not time its dispatches. The wheel's Tracy variant does,
        but it is chosen once per process at import (``IREE_PY_RUNTIME=tracy``) and its zones reach
        a file only through ``iree-tracy-capture`` listening on a socket, in Tracy's binary format:
        a subprocess and a capture server per profile, not cheap enough for the bench step."""
        return None

    def close(self) -> None:
        self._function = self._context = self._config = self._device = self._vm_context = None
        self._args, self._bound = None, [None] * len(self.inputs)


def _aligned_empty(np: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new C-order array of ``shape`` whose data starts on a ``_HOST_ALIGNMENT`` boundary."""
    dtype = np.dtype(dtype)
    nbytes = max(1, math.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + _HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype)[: math.prod(shape)].reshape(shape)
