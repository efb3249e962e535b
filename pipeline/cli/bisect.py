"""skuforge bisect: the first divergent node of an engine, and (--fix) the nodes to keep precise."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.commands import _emit, _registry
from pipeline.cli.progress import ProgressLine
from pipeline.core.errors import ConfigError
from pipeline.core.io import atomic_write_json
from pipeline.engine.build import require_host
from pipeline.project.artifacts import layout
from pipeline.results.reports import Bisection, Remedy
from pipeline.verify.bisect import bisect
from pipeline.verify.remedy import apply_overrides, fix


def run(args: argparse.Namespace) -> int:

    if args.scan and args.fix:
        raise ConfigError("--scan measures, --fix repairs: give one", hint="skuforge bisect --model M --sku S --scan")
    if args.apply and not args.fix:
        raise ConfigError(
            "--apply writes what --fix found: give both", hint="skuforge bisect --model M --sku S --fix --apply"
        )
    registry = _registry(args)
    pair = registry.pair(args.model, args.sku)  # the one lookup of the command: passed down from here
    require_host(pair.sku, pair.sku_spec, "build")
    out = layout(registry)
    progress = ProgressLine()
    result: Remedy | Bisection
    try:
        if args.fix:
            result = fix(pair, max_rounds=args.rounds, max_builds=args.max_builds, progress=progress)
            if args.apply and result.passed:
                apply_overrides(Path(args.params), args.model, args.sku, result.keep_precise)
        else:
            result = bisect(
                pair,
                max_builds=args.max_builds,
                marks_per_build=args.marks,
                scan=args.scan,
                progress=progress,
            )
    finally:
        progress.close()
    atomic_write_json(out.report(args.model, args.sku, "fix" if args.fix else "bisect"), result.to_json())
    _emit(args, result.to_json(), lambda: _fix_text(result, args) if args.fix else bisection_text(result))
    return 1 if isinstance(result, Remedy) and not result.passed else 0  # --fix: a Remedy


def bisection_text(b) -> str:
    lines = [
        f"{b.model}/{b.sku} ({b.backend} {b.precision}): {b.verdict}, {b.builds}"
        + (f" of {b.max_builds}" if b.max_builds else "")
        + " builds, "
        f"{b.candidates} candidate tensors, {b.samples} golden samples",
        f"  {b.summary}",
    ]
    for s in b.suspects:
        e = s.error
        lines.append(f"  suspect {s.node} ({s.op_type}) -> {s.tensor}: cause {s.cause}")
        lines.append(
            f"    error: relative {_num(e.relative_error)}, median channel {_num(e.channel_relative_error)}, "
            f"max abs {_num(e.max_abs_error)}, NaN {e.nan}, Inf {e.inf}"
        )
        lines.append(
            f"    reference range [{_num(e.reference_min)}, {_num(e.reference_max)}], "
            f"abs-max {_num(e.reference_abs_max)}"
            + (f"; channel abs-max {e.channel_abs_max}" if e.channel_abs_max else "")
        )
        for i in s.inputs:
            lines.append(f"    input {i.tensor}: relative {_num(i.relative_error)}, max abs {_num(i.max_abs_error)}")
        for layer in s.engine_layers:
            lines.append(
                f"    engine layer {layer.name} ({layer.op_type})"
                + (f" fused from {', '.join(layer.fused_from)}" if layer.fused_from else "")
            )
        lines.append(f"    {s.explanation}")
        lines.append(
            f"    remedy: keep {', '.join(s.keep)} in higher precision (skuforge bisect --fix)"
            if s.keep
            else "    remedy: no node to keep in higher precision (see above)"
        )
    for t in b.tensors:
        lines.append(
            f"  {'DIVERGES' if t.divergent else 'ok':8} {t.node} ({t.op_type}): relative {_num(t.relative_error)}, "
            f"median channel {_num(t.channel_relative_error)}, max abs {_num(t.max_abs_error)}"
            + (f", NaN {t.nan}, Inf {t.inf}" if t.nan or t.inf else "")
        )
    if b.first_nonfinite:
        lines.append(f"  NaN/Inf first appear at {b.first_nonfinite}")
    return "\n".join(lines)


def _fix_text(r, args: argparse.Namespace) -> str:
    lines = [f"{r.model}/{r.sku}: {'PASSES' if r.passed else 'still FAILS'} — {r.summary}"]
    for name, o in (("before", r.before), ("after", r.after)):
        errs = ", ".join(f"{e.output} max abs {_num(e.max_abs_error)}" for e in o.outputs)
        mets = ", ".join(f"{m.split} {m.engine:.4f} (ref {m.reference:.4f})" for m in o.metrics)
        lines.append(
            f"  {name}: {'pass' if o.passed else 'fail'}; {errs}{'; ' + mets if mets else ''}; p50 {_num(o.p50_ms)} ms"
        )
        lines += [f"    {line}" for line in o.failures[:3]]
    if r.latency_ratio:
        lines.append(f"  latency cost: x{r.latency_ratio:.2f} of all-{r.precision}")
    if r.fp32_latency_ratio:
        lines.append(f"  against ONNX Runtime FP32 on this host: x{r.fp32_latency_ratio:.2f}")
    if r.max_builds:
        lines.append(
            f"  builds: {r.builds} in {len(r.rounds)} round(s); cap {r.max_builds} per bisection, {r.max_rounds} rounds"
        )
    for step in r.steps:
        lines.append(
            f"    {step.phase}: keep [{', '.join(step.keep_precise)}]: max abs {_num(step.max_abs_error)}, "
            f"{'pass' if step.passed else 'fail'} (build {step.builds}){'' if step.kept else ', undone'}"
        )
    for lesson in r.lessons:
        lines.append(f"  learned: {lesson}")
    if r.passed:
        lines.append(
            ("written to params.yaml:" if args.apply else "params.yaml override (add it, or rerun with --apply):")
            + "\n"
            + "\n".join(f"  {line}" for line in r.overrides.splitlines())
        )
    return "\n".join(lines)


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"
