"""``skuforge cache status|refresh`` (the checked-in compiler caches) and ``skuforge backends``
(each backend's declared capabilities)."""

from __future__ import annotations

import argparse
import json
import sys

from pipeline.backends import capability_table
from pipeline.cli import tables
from pipeline.cli.progress import ProgressLine
from pipeline.cli.tables import Column
from pipeline.ops.caches import refresh as cache_refresh
from pipeline.ops.caches import status as cache_status
from pipeline.project.config import load_registry


def status(args: argparse.Namespace) -> int:

    registry = load_registry(args.params)
    for name in args.sku or []:
        registry.sku(name)  # an unknown SKU is exit 2 with the known ones
    for name in args.model or []:
        registry.model(name)
    rows = cache_status(registry, args.sku, args.model)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2, sort_keys=True))
    else:
        print(status_text(rows))
    bad = [
        r
        for r in rows
        if (args.fail_on == "corrupt" and r.state == "corrupt") or (args.fail_on == "not-fresh" and r.state != "fresh")
    ]
    if bad:
        print(
            f"skuforge: {', '.join(f'{r.sku}/{r.model} is {r.state}' for r in bad)}; refresh with skuforge cache "
            "refresh --sku S on the SKU's runner and commit caches/",
            file=sys.stderr,
        )
        return 1
    return 0


CACHE_COLUMNS = (
    Column("sku"),
    Column("model"),
    Column("kind"),
    Column("state"),
    Column("size", numeric=True),
    Column("compiler"),
    Column("target"),
    Column("tuned"),
    Column("last build", "last build"),
)


def status_text(rows) -> str:
    if not rows:
        return "no SKU here uses a backend with a cache"
    cells = []
    for r in rows:
        last = r.last_build or {}
        rate = last.get("hit_rate")
        last_text = (
            (
                f"{last.get('hits', 0)} hits, {last.get('misses', 0)} misses"
                + (f" ({rate:.0%})" if rate is not None else "")
            )
            if last
            else None
        )
        cells.append(
            {
                "sku": r.sku,
                "model": r.model,
                "kind": r.kind,
                "state": r.state,
                "size": _size(r.bytes) if r.files else None,
                "compiler": next((f"{k} {v}" for k, v in r.key.items() if k != "target"), None),
                "target": r.key.get("target"),
                "tuned": f"{r.tuned_at or '-'}" + (f" ({r.trials} trials)" if r.trials else ""),
                "last build": last_text,
            }
        )
    notes = [
        ([f"{r.sku}/{r.model}: {r.reason}"] if r.state not in ("fresh", "none") else [])
        + ([f"{r.sku}/{r.model}: ignored {', '.join(r.ignored)} (an editor's files)"] if r.ignored else [])
        for r in rows
    ]
    return tables.render(CACHE_COLUMNS, cells, notes)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024 or unit == "MB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def refresh(args: argparse.Namespace) -> int:

    registry = load_registry(args.params)
    for name in args.model or []:
        registry.model(name)
    progress = ProgressLine()
    try:
        records = cache_refresh(registry, args.sku, args.model, trials=args.trials, progress=progress)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(records, indent=2, sort_keys=True))
    else:
        for r in records:
            where = f"caches/{r['sku']}/{r['model']}"
            print(
                f"refreshed {where}: {len(r.get('files', []))} files, sha256 {str(r.get('sha256'))[:12]}, "
                f"{'written' if r.get('updated') else 'unchanged'}; commit {where}"
            )
    return 0


def backends(args: argparse.Namespace) -> int:

    rows = capability_table()
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    elif args.markdown:
        print(markdown(rows))
    else:
        print(
            "\n".join(
                f"{r['backend']}: precisions {', '.join(r['precisions'])}; devices {', '.join(r['devices'])}; "
                f"cache {r['cache'] or 'none'}; per-node precision {'yes' if r['per_node_precision'] else 'no'}; "
                f"intermediate outputs {'yes' if r['intermediate_outputs'] else 'no'}; "
                + (
                    f"INT8 calibrated from the {'range table' if r['calibration'] == 'table' else 'samples'}; "
                    if "int8" in r["precisions"]
                    else ""
                )
                + f"device package {r['runtime_package']}"
                for r in rows
            )
        )
    return 0


def markdown(rows) -> str:
    head = (
        "| backend | precisions | devices | per-node precision | intermediate outputs | cache | INT8 calibration "
        "| device package |\n|---|---|---|---|---|---|---|---|"
    )
    yes = {True: "yes", False: "no"}
    return "\n".join(
        [head]
        + [
            f"| `{r['backend']}` | {', '.join(r['precisions'])} | {', '.join(r['devices'])} "
            f"| {yes[r['per_node_precision']]} | {yes[r['intermediate_outputs']]} | {r['cache'] or '-'} "
            f"| {r['calibration'] if 'int8' in r['precisions'] else '-'} | `{r['runtime_package']}` |"
            for r in rows
        ]
    )
