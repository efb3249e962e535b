"""The arguments of the `skuforge` commands not in their own group (no library import: `--help` stays fast)."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> str:
    """A registered version number (MLflow counts from 1), checked before any store is opened."""
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a version number: give a positive integer such as 3 "
            "(`skuforge releases --model M` lists the versions)"
        )
    return str(int(value))


# The stage commands: name -> (needs --sku, help). Their handler is pipeline/cli/commands.py run_stage.
STAGE_COMMANDS: dict[str, tuple[bool, str]] = {
    "prepare": (False, "check the model, infer shapes, run graph passes"),
    "data": (False, "golden, calibration, evaluation and hard-tail sets"),
    "reference": (False, "ONNX Runtime CPU FP32 reference outputs"),
    "calibrate": (False, "INT8 calibration table"),
    "build": (True, "build the engine with the SKU's backend"),
    "validate": (True, "correctness and placement gates"),
    "emulate": (True, "validate an aarch64 SKU's engine on this x86-64 host under QEMU (emulate.json)"),
    "bench": (True, "latency, throughput and memory"),
    "manifest": (True, "write the manifest"),
}

# Extra switches of a stage command: flag -> (keyword argument of the stage function, help)
STAGE_FLAGS: dict[str, dict[str, tuple[str, str]]] = {
    "build": {
        "--check-reproducible": (
            "check_reproducible",
            "build the engine a second time (new process, temporary "
            "folder and cache copy) and record the verdict (bitwise, equivalent, "
            "unverified, differs) in build.json; exit 1 below the SKU's "
            "reproducibility.require",
        ),
        "--require-cache": (
            "cache_required",
            "fail on any miss of the SKU's checked-in compiler cache (a "
            "stale, corrupt or missing cache, a tuning task not in the database), as "
            "skus.<s>.cache.require or SKUFORGE_REQUIRE_CACHE=1 do",
        ),
    },
}


def _wide(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wide", action="store_true", help="every column of the matrix (default: the key ones, in 120 columns)"
    )


def register(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="check the registry")
    csub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    v = csub.add_parser("validate", help="validate params.yaml")
    v.add_argument("--json", action="store_true")
    v.set_defaults(handler="pipeline.cli.commands:config_validate")
    r = csub.add_parser("resolve", help="write the resolved settings per model and (model, SKU) that DVC tracks")
    r.add_argument("--json", action="store_true")
    r.set_defaults(handler="pipeline.cli.commands:config_resolve")

    skus = sub.add_parser("skus", help="list SKUs and whether this host can build them")
    skus.add_argument("--buildable-here", action="store_true", help="only the SKUs this host can build")
    skus.add_argument("--json", action="store_true")
    skus.set_defaults(handler="pipeline.cli.commands:list_skus")

    ex = sub.add_parser("export", help="train an example model and export it to ONNX")
    ex.add_argument("--example", required=True)
    ex.add_argument("--json", action="store_true")
    ex.set_defaults(handler="pipeline.cli.commands:export_example")

    _register_stages(sub)
    _register_mlflow(sub)
    _register_results(sub)
    _register_runner(sub)


def _register_stages(sub: argparse._SubParsersAction) -> None:
    """One command per pipeline stage: --model (and --sku), the stage's flags."""
    for name, (needs_sku, help_text) in STAGE_COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--model", required=True)
        if needs_sku:
            p.add_argument("--sku", required=True)
        p.add_argument("--json", action="store_true", help="print the report as JSON")
        flags = STAGE_FLAGS.get(name, {})
        for flag, (kw, flag_help) in flags.items():
            # unset: None, so the library's default (the SKU's setting) decides
            p.add_argument(flag, dest=kw, action="store_const", const=True, default=None, help=flag_help)
        p.set_defaults(handler="pipeline.cli.commands:run_stage")


def _register_mlflow(sub: argparse._SubParsersAction) -> None:
    """MLflow: publish, promote, releases."""
    p = sub.add_parser("publish", help="record engines in MLflow (a run each) and register them (idempotent)")
    p.add_argument("--model", help="the model of the pair to publish")
    p.add_argument("--sku", help="the SKU of the pair to publish")
    p.add_argument("--all", action="store_true", help="every (model, SKU) with a manifest")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler="pipeline.cli.commands:publish")

    p = sub.add_parser("promote", help="move a registry alias along the chain when the gates pass, or roll it back")
    p.add_argument("--model", required=True)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--sku", action="append", help="the SKU (repeatable)")
    which.add_argument("--all", action="store_true", help="every SKU the release requires (release.skus)")
    p.add_argument("--to", required=True, metavar="ALIAS", help="the alias to move (release.aliases)")
    p.add_argument(
        "--version",
        type=positive_int,
        metavar="N",
        help="the version to move (default: newest for the first alias, else the holder of the alias before)",
    )
    p.add_argument("--reason", help="why (required for the aliases in release.reason_required)")
    p.add_argument("--rollback", action="store_true", help="move the alias back to its previous holder")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.commands:promote")

    p = sub.add_parser("releases", help="registered versions and aliases per SKU of a model")
    p.add_argument("--model", required=True)
    p.add_argument("--history", action="store_true", help="also the alias moves (who, when, why)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.commands:releases")


def _register_results(sub: argparse._SubParsersAction) -> None:
    """The pipeline run and its results: repro, summary, select, report."""
    r = sub.add_parser(
        "repro", help="dvc repro (keep going) for the SKUs this host can build; the outcome of every pair"
    )
    r.add_argument("--model", action="append", help="only this model (repeatable)")
    r.add_argument("--sku", action="append", help="only this SKU (repeatable)")
    r.add_argument("--force", action="store_true", help="rerun stages even if unchanged")
    r.add_argument(
        "--dry",
        action="store_true",
        help="show what would run (one dvc status), run nothing; renders pipelines/ like a run",
    )
    r.add_argument("--no-publish", action="store_true", help="stop at the manifests: record nothing in MLflow")
    _wide(r)
    r.add_argument("--json", action="store_true")
    r.set_defaults(handler="pipeline.cli.commands:repro")

    s = sub.add_parser(
        "summary", help="the outcome of every (model, SKU) with its manifest's gates, metric deltas, latency"
    )
    s.add_argument("--model", action="append", help="only this model (repeatable)")
    s.add_argument("--sku", action="append", help="only this SKU (repeatable)")
    s.add_argument(
        "--outcome", action="append", help="only pairs with this outcome, e.g. passed, 'gate failed' (repeatable)"
    )
    _wide(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler="pipeline.cli.commands:summary")

    p = sub.add_parser(
        "select",
        help="the engine chosen per device class for a model: the fastest passing candidate when separated "
        "from the runner-up, else a tie broken by selection.prefer",
    )
    p.add_argument("--model", required=True)
    p.add_argument(
        "--class",
        dest="device_class",
        metavar="C",
        help="only this device class (skus.<s>.device_class; default: every class of the model's SKUs)",
    )
    p.add_argument("--json", action="store_true", help="print the selection record as JSON")
    p.add_argument(
        "--publish",
        action="store_true",
        help="also record it in MLflow: a run in the model's experiment with the record as selection.json, "
        "and the experiment tagged with the choice per class (docs/mlflow.md)",
    )
    p.set_defaults(handler="pipeline.cli.select:select_command")

    p = sub.add_parser(
        "report",
        help="a static HTML report (no network needed): latency, correctness, layers, "
        "roofline per pair; SKUs side by side per model",
    )
    p.add_argument("--model", help="only this model (default: every model)")
    p.add_argument("--sku", action="append", help="only this SKU (repeatable; default: every SKU)")
    p.add_argument("--out", metavar="DIR", help="the folder to (re)write, inside the project (default: build/report)")
    p.add_argument("--json", action="store_true", help="print the index's path and the pages written as JSON")
    p.set_defaults(handler="pipeline.cli.commands:report")


def _register_runner(sub: argparse._SubParsersAction) -> None:
    """This host as a CI runner: probe, check, labels."""
    rn = sub.add_parser("runner", help="this host as a CI runner: its state, whether it matches a SKU, runner labels")
    rsub = rn.add_subparsers(dest="runner_command", metavar="ACTION", required=True)
    p = rsub.add_parser("probe", help="the host's hardware, device state, GPU, toolchain and the SKUs it can build/run")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--peaks",
        action="store_true",
        help="add the host's peak FP32 GFLOP/s and memory GB/s (measured once, about 10 s, then cached)",
    )
    p.add_argument("--refresh", action="store_true", help="measure the peaks again (implies --peaks)")
    p.set_defaults(handler="pipeline.cli.commands:runner_probe")
    p = rsub.add_parser("check", help="exit 3 with every difference when this host does not match the SKU")
    p.add_argument("--sku", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.commands:runner_check")
    p = rsub.add_parser("labels", help="the labels of a runner class (for setup-runner.sh)")
    p.add_argument("--class", dest="runner_class", required=True, metavar="NAME")
    p.add_argument(
        "--classes", default="runners/classes.yaml", help="the runner classes (default: runners/classes.yaml)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.commands:runner_labels")
