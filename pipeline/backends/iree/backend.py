"""The IREE backend: build (import, compile, the dispatch report), load, and the checks of a SKU."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.backends.base import Backend
from pipeline.backends.contract import BuildContext, BuildOutcome, Capabilities, Runner, Staged
from pipeline.backends.iree.common import (
    DRIVERS,
    IMPORTER_MIN_OPSET,
    OWNED_FLAGS,
    PIP_HINT,
    PRECISION_STEP,
    VMFB,
    IreeMeta,
    IreeOptions,
    compiler_problems,
    iree_versions,
    missing_cpu_features,
    report_progress,
    runtime_problems,
)
from pipeline.backends.iree.compiler import (
    ImportRefused,
    compile_flags,
    compile_module,
    entry_name,
    import_failure,
    to_mlir,
)
from pipeline.backends.iree.dispatches import dispatch_sites, parse_dispatches, resolved_target
from pipeline.backends.iree.runner import IreeRunner
from pipeline.backends.opset import convert_opset
from pipeline.core.errors import EnvironmentProblem
from pipeline.host import probe
from pipeline.model.graph import all_nodes, default_opset, signature, tensors_to_raw

if TYPE_CHECKING:
    import onnx

    from pipeline.project.config import SkuSpec

logger = logging.getLogger(__name__)

logger = logging.getLogger(__name__)


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
    install_hint = PIP_HINT
    engine_format = "skuforge-iree-vmfb/1"
    runtime_keys = ("iree-base-runtime",)  # a vmfb is tied to the runtime that loads it

    @classmethod
    def _check_sku_impl(cls, sku: SkuSpec, options: IreeOptions) -> list[str]:
        problems = []
        if options.runtime_driver not in DRIVERS[options.target_device]:
            problems.append(
                f"options.driver: {options.driver} cannot run a {options.target_device} engine "
                f"(use {' or '.join(DRIVERS[options.target_device])})"
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
                elif flag.split("=", 1)[0] in OWNED_FLAGS:
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
            return compiler_problems()
        return list(runtime_problems(self.options(sku).runtime_driver))

    def versions(self) -> dict[str, str]:
        return iree_versions()

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
        # each conversion's input, newest first: an import failure is checked against them (import_failure)
        earlier = [(PRECISION_STEP[ctx.sku_spec.precision], staged.source)] if ctx.sku_spec.precision != "fp32" else []
        if conversion is not None:
            tensors_to_raw(original)
            onnx.save(original, str(staged.work / "unconverted.onnx"))
            step = f"opset conversion from {conversion.from_opset} to {conversion.to_opset}"
            earlier.append((step, staged.work / "unconverted.onnx"))
        tensors_to_raw(model)  # the importer reads raw_data, not every typed field (FP16 in int32_data)
        staged.notes.update(conversion=conversion, entry=entry_name(model), signature=signature(model), earlier=earlier)
        return model

    def _build_impl(self, ctx: BuildContext, staged: Staged) -> BuildOutcome:
        opts: IreeOptions = staged.options
        conversion, entry, sig = staged.notes["conversion"], staged.notes["entry"], staged.notes["signature"]
        work = staged.work
        # the graph as imported (with the FP16 converter's casts), in graph order
        node_types = {n.name: n.op_type for n in staged.model.graph.node if n.name}
        # a refusal may name a node inside an If/Loop/Scan body: those are known by name too
        named = {n.name: n.op_type for n in all_nodes(staged.model.graph) if n.name} | node_types
        report_progress(ctx, "iree import", 0.1)
        try:
            to_mlir(staged.source, work / "input.mlir")
        except ImportRefused as exc:
            raise import_failure(exc, named, staged.notes["earlier"], work, (ctx.model, ctx.sku)) from exc
        report_progress(ctx, "iree compile", 0.3)
        flags, dropped = compile_module(
            work, compile_flags(opts, ctx.sku_spec.target.arch), opts.droppable_flags, ctx.engine_dir / VMFB, named
        )
        dispatches = parse_dispatches(work / "sources", list(node_types), opts.runtime_driver)
        target = resolved_target(work / "sources")
        sites = dispatch_sites(work / "statistics.json")
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
        problems = list(runtime_problems(meta.driver))
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
