"""``skuforge release``, ``skuforge rollout`` and ``skuforge agent``: shipping engines to devices."""

from __future__ import annotations

import argparse
import json

from pipeline.core.errors import ConfigError
from pipeline.core.io import atomic_write_bytes
from pipeline.project.config import load_registry
from pipeline.results.signing import read_key_file, signing_key
from pipeline.rollout import controller, trust
from pipeline.rollout.agent import Agent, Device, load_device
from pipeline.rollout.controller import advance, live_models, move, status
from pipeline.rollout.inventory import load_inventory
from pipeline.rollout.plan import plan
from pipeline.rollout.release import publish_release, release_doc, releases_of
from pipeline.rollout.store import open_store, store_url
from pipeline.rollout.trust import Keys, initialise, root_bytes
from pipeline.tracking.client import actor

PINNED_ROOT = "release-root.json"  # the store's root as this project created it: commit it


def _context(args: argparse.Namespace, keys: bool = True):

    reg = load_registry(args.params)
    store = open_store(args.store or store_url(reg.rollout.store), reg.root)
    pinned = reg.root / PINNED_ROOT
    anchor = pinned.read_bytes() if pinned.is_file() else None
    return reg, store, (Keys.single(signing_key(), anchor=anchor) if keys else None)


def _actor() -> str:

    return actor()


def _print(args: argparse.Namespace, data, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if getattr(args, "json", False) else text)


def release_init(args: argparse.Namespace) -> int:

    reg, store, keys = _context(args)
    if args.root_key:
        keys = Keys(root=[read_key_file(p) for p in args.root_key], online=keys.online, root_threshold=args.threshold)

    made = initialise(store, keys, reg.rollout.expiry)
    pinned = reg.root / PINNED_ROOT
    if made or not pinned.is_file():
        atomic_write_bytes(pinned, root_bytes(store, keys))
    print(
        f"{'created' if made else 'already initialised:'} signed release store at {store.url}; its root is pinned "
        f"in {PINNED_ROOT} (commit it: writers refuse a store whose root chain does not hold it)"
    )
    return 0


def release_publish(args: argparse.Namespace) -> int:

    reg, store, keys = _context(args)
    r = publish_release(reg, store, keys, args.model, alias=args.alias, skus=args.sku, actor=_actor())
    lines = [
        f"{'published' if r.created else 'unchanged, already'} {r.model} release {r.release} in {r.store} "
        f"({r.seconds:.1f} s)"
    ]
    lines += [
        f"  {s.sku:24s} {s.backend}/{s.precision}  manifest {s.manifest_digest[:12]}  {s.bytes} bytes  from {s.source}"
        + ("  (portable fallback)" if s.sku == r.fallback_sku else "")
        for s in r.skus
    ]
    _print(args, r.to_json(), "\n".join(lines))
    return 0


def release_root(args: argparse.Namespace) -> int:

    _, store, keys = _context(args)
    atomic_write_bytes(args.out, root_bytes(store, keys))
    print(f"wrote the trusted root of {store.url} to {args.out}: provision devices with it (`skuforge agent --root`)")
    return 0


def rollout_plan(args: argparse.Namespace) -> int:

    reg, store, _ = _context(args, keys=False)
    inventory = load_inventory(args.inventory)
    state = trust.read_state(store)
    released = releases_of(state.targets.signed, args.model)
    rid = args.release or (released[-1] if released else None)
    doc = release_doc(store, args.model, rid) if rid in released else None
    skus = list(doc["skus"]) if doc else reg.release_skus()
    p = plan(inventory, reg.rollout.waves, f"{args.model}-{rid or 'next'}", skus, reg.rollout.fallback_sku)
    lines = [
        f"plan for {args.model} {rid or '(no release yet)'}: {len(inventory)} devices, "
        f"planned in {p.seconds * 1000:.0f} ms"
    ]
    for w in p.waves:
        lines.append(f"  {w.name:10s} {w.devices:8d} devices (+{w.new_devices})  bake {w.bake_minutes:g} min")
    _print(args, p.to_json(), "\n".join(lines))
    return 0


def rollout_start(args: argparse.Namespace) -> int:

    reg, store, keys = _context(args)
    inventory = None
    if args.inventory is not None:
        inventory = load_inventory(args.inventory)
    doc = controller.start(
        reg, store, keys, args.model, args.release, inventory=inventory, actor=_actor(), reason=args.reason
    )
    _print(
        args,
        doc.to_json(),
        f"started {doc.id}: {doc.release} (previous {doc.previous or 'none'}), wave {doc.waves[0].name}",
    )
    return 0


def _models(args: argparse.Namespace, store, registry) -> list[str]:

    if args.all:
        return live_models(store)
    registry.model(args.model)  # unknown (or hostile) names stop here, named
    return [args.model]


def _status_line(model: str, s) -> str:
    d = s.rollout
    if d is None:
        return f"{model}: no rollout"
    h = s.health
    head = f"{model}: {d.id} {d.status}, wave {d.wave + 1}/{len(d.waves)} ({d.waves[d.wave].name})"
    if h is not None:
        head += f", {h.reports} reports: " + ", ".join(f"{k} {v}" for k, v in h.counts.items() if v)
    lines = [head, f"  next: {s.action} ({s.reason})"]
    if h is not None:
        lines += [
            f"  gate {g.name}: {'pass' if g.passed else 'FAIL' if g.passed is False else 'wait'} - {g.detail}"
            for g in h.gates
        ]
    return "\n".join(lines)


def _markdown(rows) -> str:
    out = ["| model | rollout | status | wave | reports | failures | next |", "|---|---|---|---|---|---|---|"]
    for model, s in rows:
        d, h = s.rollout, s.health
        if d is None:
            out.append(f"| {model} | - | none | - | - | - | - |")
            continue
        failed = h.reports - h.counts.get("ok", 0) if h else 0
        out.append(
            f"| {model} | {d.id} | {d.status} | {d.waves[d.wave].name} | {h.reports if h else 0} | {failed} | "
            f"{s.action}: {s.reason.replace('|', '/')} |"
        )
    return "\n".join(out)


def rollout_status(args: argparse.Namespace) -> int:

    reg, store, _ = _context(args, keys=False)
    rows = [(m, status(reg, store, m)) for m in _models(args, store, reg)]
    if args.markdown:
        print(_markdown(rows) if rows else "no live rollouts")
        return 0
    _print(
        args, {m: s.to_json() for m, s in rows}, "\n".join(_status_line(m, s) for m, s in rows) or "no live rollouts"
    )
    return 0


def rollout_advance(args: argparse.Namespace) -> int:

    reg, store, keys = _context(args)
    rows = [(m, advance(reg, store, keys, m, actor=_actor())) for m in _models(args, store, reg)]
    _print(
        args,
        {m: s.to_json() for m, s in rows},
        "\n".join(f"{m}: {s.action}: {s.reason}" for m, s in rows) or "no live rollouts",
    )
    return 1 if any(s.action in ("rolled_back", "aborted") for _, s in rows) else 0  # a gate failed


def rollout_move(args: argparse.Namespace) -> int:

    reg, store, keys = _context(args)
    docs = [
        move(reg, store, keys, m, args.action, actor=_actor(), reason=args.reason) for m in _models(args, store, reg)
    ]
    _print(
        args,
        [d.to_json() for d in docs],
        "\n".join(f"{d.model}: {d.id} is {d.status}" for d in docs) or "no live rollouts",
    )
    return 0


def run_agent(args: argparse.Namespace) -> int:
    import time

    url = args.store or store_url("")
    if not url:
        raise ConfigError("which store?", hint="give --store s3://bucket/prefix (or a folder), or set SKUFORGE_STORE")
    cfg = load_device(args.device)
    root = args.root.read_bytes() if args.root is not None else None
    agent = Agent(open_store(url), Device.from_config(cfg), args.state, root)
    code = 0
    while True:
        for model in cfg.models:
            r = agent.run_once(model)
            active = r.active or {}
            _print(
                args,
                r.to_json(),
                f"{r.device} {model}: {r.outcome}: {r.detail} (active: "
                f"{active.get('release', 'none')} {active.get('sku', '')} {active.get('kind', '')})",
            )
            code = max(code, 0 if r.outcome in ("ok", "idle", "current") else 1)
        if args.interval <= 0:
            return code
        time.sleep(args.interval)
