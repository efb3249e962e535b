"""The arguments of `skuforge rollout` (no library import: `--help` stays fast)."""

from __future__ import annotations

import argparse
from pathlib import Path

ACTIONS = ("pause", "resume", "abort", "rollback")


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="s3://bucket/prefix or a folder (default: $SKUFORGE_STORE, else rollout.store)")


def _which(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model")
    g.add_argument("--all", action="store_true", help="every model with a live rollout")


def register(sub: argparse._SubParsersAction) -> None:
    rel = sub.add_parser("release", help="signed releases in the release store (TUF)")
    rsub = rel.add_subparsers(dest="release_command", metavar="ACTION", required=True)
    p = rsub.add_parser("init", help="create the store's signed root and empty metadata (once per store)")
    _store_arg(p)
    p.add_argument(
        "--root-key",
        action="append",
        type=Path,
        default=[],
        help="offline root key file (repeat for several; default: the publishing key)",
    )
    p.add_argument("--threshold", type=int, default=1, help="root keys needed to sign a new root (default 1)")
    p.set_defaults(handler="pipeline.cli.rollout:release_init")
    p = rsub.add_parser("publish", help="sign one model's engines (every release SKU and the fallback) into the store")
    p.add_argument("--model", required=True)
    p.add_argument("--alias", help="take the MLflow versions holding this alias (default: this project's build folder)")
    p.add_argument("--sku", action="append", help="only these SKUs (repeat); the fallback SKU is always included")
    _store_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:release_publish")
    p = rsub.add_parser("root", help="write the store's trusted root: the file devices are provisioned with")
    p.add_argument("--out", type=Path, required=True)
    _store_arg(p)
    p.set_defaults(handler="pipeline.cli.rollout:release_root")

    ro = sub.add_parser("rollout", help="move a release over the fleet in waves with health gates")
    osub = ro.add_subparsers(dest="rollout_command", metavar="ACTION", required=True)
    p = osub.add_parser("plan", help="which devices each wave reaches (nothing is written)")
    p.add_argument("--model", required=True)
    p.add_argument("--inventory", type=Path, required=True, help="fleet inventory, YAML or CSV")
    p.add_argument("--release", help="default: the newest in the store (an id is needed only to salt the hash)")
    _store_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:rollout_plan")
    p = osub.add_parser("start", help="start rolling a release out (wave 1)")
    p.add_argument("--model", required=True)
    p.add_argument("--release", help="default: the newest in the store")
    p.add_argument("--inventory", type=Path, help="fleet inventory: sizes the waves' minimum report counts")
    p.add_argument("--reason", default="")
    _store_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:rollout_start")
    for name, text in (
        ("status", "each rollout's wave, device reports and gate verdicts"),
        ("advance", "check the gates: roll back on failure, else next wave once baked"),
    ):
        p = osub.add_parser(name, help=text)
        _which(p)
        _store_arg(p)
        p.add_argument("--json", action="store_true")
        if name == "status":
            p.add_argument("--markdown", action="store_true", help="a table for a CI job summary")
        p.set_defaults(handler="pipeline.cli.rollout:" + ("rollout_status" if name == "status" else "rollout_advance"))
    for name in ACTIONS:
        p = osub.add_parser(
            name,
            help={
                "pause": "stop advancing (devices keep what they run)",
                "resume": "advance again (the wave's bake time restarts)",
                "abort": "end the rollout where it is (no more devices take it)",
                "rollback": "every device returns to the previous release",
            }[name],
        )
        _which(p)
        p.add_argument("--reason", required=True, help="goes into the rollout's log")
        _store_arg(p)
        p.add_argument("--json", action="store_true")
        p.set_defaults(handler="pipeline.cli.rollout:rollout_move", action=name)

    p = sub.add_parser("agent", help="the device agent: fetch, verify, smoke-test, activate and report")
    p.add_argument("--device", type=Path, required=True, help="the device file (id, sku, models; docs/rollout.md)")
    p.add_argument(
        "--state", type=Path, required=True, help="the agent's folder (engines, A/B slots, trusted metadata)"
    )
    p.add_argument("--root", type=Path, help="the trusted root.json (needed on the first run)")
    p.add_argument("--store", help="s3://bucket/prefix or a folder (default: $SKUFORGE_STORE)")
    p.add_argument("--interval", type=float, default=0, help="seconds between passes (default 0: one pass)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:run_agent")
