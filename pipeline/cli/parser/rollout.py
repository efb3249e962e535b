"""The arguments of `skuforge rollout` (no library import: `--help` stays fast)."""

from __future__ import annotations

import argparse
from pathlib import Path

ACTIONS = ("pause", "resume", "abort", "rollback")


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="s3://bucket/prefix or a folder (default: $SKUFORGE_STORE, else rollout.store)")


def _inventory_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--inventory",
        type=Path,
        help="fleet inventory, CSV or YAML, with each device's public key (default: rollout.inventory)",
    )


def _percents(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated percentages, e.g. 5,50,100") from None


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--waves", type=_percents, help="cumulative percentages overriding rollout.waves, e.g. 5,50,100 (recorded)"
    )
    p.add_argument("--bake", type=float, metavar="MINUTES", help="bake time of every wave but the last (recorded)")
    p.add_argument(
        "--label",
        action="append",
        dest="labels",
        metavar="LABEL",
        help="only devices with this inventory label take part (repeat: any of them)",
    )


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
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:release_init")
    p = rsub.add_parser("publish", help="sign one model's engines (every release SKU and the fallback) into the store")
    p.add_argument("--model", required=True)
    p.add_argument("--alias", help="take the MLflow versions holding this alias (default: this project's build folder)")
    p.add_argument("--sku", action="append", help="only these SKUs (repeat); the fallback SKU is always included")
    p.add_argument(
        "--allow-partial",
        action="append",
        metavar="SKU",
        help="ship without this release SKU (repeat for each one missing): its devices run the portable fallback",
    )
    _store_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:release_publish")
    p = rsub.add_parser("root", help="write the store's trusted root: the file devices are provisioned with")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--timestamp-out",
        type=Path,
        metavar="FILE",
        help="also write the store's current timestamp, verified: a device given it (`agent --timestamp`) "
        "refuses any older state",
    )
    _store_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:release_root")
    p = rsub.add_parser(
        "repair",
        help="after a rollback or a fork of the store (an older timestamp.json put back): commit the newest "
        "state (or this machine's record of it) again, above every version seen",
    )
    _store_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:release_repair")

    _register_rollout(sub)
    _register_agent(sub)


def _register_rollout(sub: argparse._SubParsersAction) -> None:
    """skuforge rollout: plan, start and move a release over the fleet."""
    ro = sub.add_parser("rollout", help="move a release over the fleet in waves with health gates")
    osub = ro.add_subparsers(dest="rollout_command", metavar="ACTION", required=True)
    p = osub.add_parser("plan", help="which devices each wave reaches (nothing is written)")
    p.add_argument("--model", required=True)
    _inventory_arg(p)
    p.add_argument("--release", help="default: the newest in the store (an id is needed only to salt the hash)")
    _overrides(p)
    _store_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:rollout_plan")
    p = osub.add_parser("start", help="start rolling a release out (wave 1)")
    p.add_argument("--model", required=True)
    p.add_argument("--release", help="default: the newest in the store")
    _inventory_arg(p)
    _overrides(p)
    p.add_argument("--reason", default="")
    _store_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:rollout_start")
    for name, text in (
        ("status", "each rollout's wave, device reports and gate verdicts (--all: every model with a rollout)"),
        ("advance", "check the gates: roll back on failure, else next wave once baked; re-signs the timestamp"),
    ):
        p = osub.add_parser(name, help=text)
        _which(p)
        _inventory_arg(p)
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


def _register_agent(sub: argparse._SubParsersAction) -> None:
    """skuforge agent: the device side."""
    p = sub.add_parser(
        "agent",
        help="the device agent: fetch, verify, smoke-test, activate and report",
        description="Run the device agent (--device and --state), or `skuforge agent identity --state DIR` "
        "to print the device's public key for the inventory.",
    )
    # not required=True: `agent identity` takes only --state (run_agent checks both)
    p.add_argument("--device", type=Path, help="the device file (id, sku, models; docs/rollout.md); required")
    p.add_argument(
        "--state", type=Path, help="the agent's folder (engines, A/B slots, trusted metadata, device key); required"
    )
    p.add_argument("--root", type=Path, help="the trusted root.json (needed on the first run)")
    p.add_argument(
        "--timestamp",
        type=Path,
        metavar="FILE",
        help="the store's timestamp at provisioning (`release root --timestamp-out`): no older state is trusted",
    )
    p.add_argument("--store", help="s3://bucket/prefix or a folder (default: $SKUFORGE_STORE)")
    p.add_argument("--interval", type=float, default=0, help="seconds between passes (default 0: one pass)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="pipeline.cli.rollout:run_agent")
    asub = p.add_subparsers(dest="agent_command", metavar="[identity]", required=False)
    q = asub.add_parser(
        "identity", help="print the device's public key for the inventory's key column (made when absent)"
    )
    q.add_argument("--state", type=Path, required=True, help="the agent's folder (the key is identity/device_key.pem)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler="pipeline.cli.rollout:agent_identity")
