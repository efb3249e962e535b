"""Import and compile: the ONNX model to MLIR (torch-mlir's importer), then iree-compile for the target,
with the compiler's and importer's failures mapped to the node and op they name."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.backends.iree.common import COMPILE_TIMEOUT_S, PRECISION_STEP, TRIPLES, IreeOptions, iree_compile_path
from pipeline.backends.iree.dispatches import loc_names
from pipeline.core.errors import ConfigError, EnvironmentProblem, InputError, UnsupportedOp, first_line
from pipeline.host import probe
from pipeline.model.graph import all_nodes

if TYPE_CHECKING:
    import onnx


logger = logging.getLogger(__name__)

logger = logging.getLogger(__name__)


_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def entry_name(model: onnx.ModelProto) -> str:
    """The entry function is named after the graph; give it a plain name when the graph's is not one."""
    if not _SYMBOL.match(model.graph.name or ""):
        model.graph.name = re.sub(r"\W", "_", model.graph.name or "") if model.graph.name else "main"
        if not _SYMBOL.match(model.graph.name):
            model.graph.name = f"m_{model.graph.name}"
    return model.graph.name


class ImportRefused(Exception):
    """IREE's ONNX importer refused a model: its message and the model as it was read."""

    def __init__(self, message: str, model: onnx.ModelProto):
        super().__init__(message)
        self.message, self.model = message, model


def import_onnx(source: Path, out: Path, node_types: dict[str, str]) -> None:
    """ONNX -> MLIR (torch-onnx dialect) with each op located at its ONNX node name, so the
    compiler's dumped dispatches say which nodes were fused into them; a refusal is the error
    ``import_error`` makes of it (``node_types``: the graph's node names and ops)."""
    try:
        to_mlir(source, out)
    except ImportRefused as exc:
        raise import_error(exc.message, exc.model, node_types) from exc


def to_mlir(source: Path, out: Path) -> None:
    """The import itself; ImportRefused when the importer refuses the model."""
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
        raise ImportRefused(str(exc) or type(exc).__name__, model) from exc
    with open(out, "w") as fh:
        module.print(file=fh, enable_debug_info=True)


def import_failure(
    refused: ImportRefused,
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
            to_mlir(before, work / "unconverted.mlir")
        except ImportRefused:
            continue  # refused before this step too: an earlier step, or the model, is the cause
        node, op_type, tensor = _refused_at(refused.message, refused.model, node_types)
        where = f" at node {node!r} ({op_type}{f', its input {tensor!r}' if tensor else ''})" if node else ""
        if step in PRECISION_STEP.values():
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
        if arch in TRIPLES:
            flags.append(f"--iree-llvmcpu-target-triple={TRIPLES[arch]}")
        if features:
            flags.append(f"--iree-llvmcpu-target-cpu-features={','.join(features)}")
    elif opts.target_device == "vulkan":
        flags.append(f"--iree-vulkan-target={opts.vulkan_target}")
    else:
        flags.append(f"--iree-cuda-target={opts.cuda_target}")
    return flags + list(opts.extra_flags) + list(opts.optional_flags)


def compile_module(
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
        iree_compile_path() or "iree-compile",
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
        node = next((n for n in loc_names(line) if n in node_types), None)
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
