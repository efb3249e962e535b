"""``skuforge release``, ``skuforge rollout`` and ``skuforge agent``: shipping engines to devices."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging

from pipeline.core.errors import ConfigError, InputError, SkuforgeError
from pipeline.core.io import atomic_write_bytes
from pipeline.core.paths import cache_dir
from pipeline.project.config import load_registry
from pipeline.results.signing import read_key_file, signing_key
from pipeline.rollout import controller, identity, trust
from pipeline.rollout.agent import HEALTHY, Agent, Device, load_device
from pipeline.rollout.controller import advance, move, status
from pipeline.rollout.inventory import Inventory, load_inventory
from pipeline.rollout.plan import DeviceGroup, plan
from pipeline.rollout.recovery import repair
from pipeline.rollout.release import publish_release, release_doc, releases_of
from pipeline.rollout.store import open_store, store_url
from pipeline.rollout.trust import Keys, initialise, pin_path, read_pin, root_bytes
from pipeline.tracking.client import actor
from pipeline.verify.selection import select

log = logging.getLogger(__name__)

LEDGER = "release-stores"  # under the cache folder: what this machine committed to each store


def _context(args: argparse.Namespace, keys: bool = True):

    reg = load_registry(args.params)
    url = args.store or store_url(reg.rollout.store)
    store = open_store(url, reg.root)
    if not keys:
        return reg, store, None
    anchor = read_pin(reg.root, url, store)  # the pin of the store opened, never another's
    return reg, store, Keys.single(signing_key(), anchor=anchor, ledger=cache_dir() / LEDGER)


def _actor() -> str:

    return actor()


def _print(args: argparse.Namespace, data, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if getattr(args, "json", False) else text)


_INIT_DONE = {
    "created": "created the",
    "completed": "completed the interrupted init of the",
    "existing": "already initialised:",
}


def release_init(args: argparse.Namespace) -> int:

    reg, store, keys = _context(args)
    if args.root_key:
        keys = Keys(
            root=[read_key_file(p) for p in args.root_key],
            online=keys.online,
            root_threshold=args.threshold,
            anchor=keys.anchor,
            ledger=keys.ledger,
        )
    pin = pin_path(reg.root, args.store or store_url(reg.rollout.store))
    made = initialise(store, keys, reg.rollout.expiry)  # checks the store against the pin before it writes
    root = root_bytes(store, keys)
    pinned = not pin.is_file()
    if pinned:  # last: a pin names a whole store
        atomic_write_bytes(pin, root)
    where = pin.relative_to(reg.root).as_posix()
    _print(
        args,
        {
            "store": store.url,
            "result": made,
            "pin": where,
            "pin_written": pinned,
            "root_version": json.loads(root)["signed"]["version"],
            "root_sha256": hashlib.sha256(root).hexdigest(),
        },
        f"{_INIT_DONE[made]} signed release store at {store.url}; its root is pinned in {where} (commit it: "
        "writers refuse a store whose root chain does not hold it)",
    )
    return 0


def release_publish(args: argparse.Namespace) -> int:

    reg, store, keys = _context(args)
    r = publish_release(
        reg, store, keys, args.model, alias=args.alias, skus=args.sku, allow_partial=args.allow_partial, actor=_actor()
    )
    lines = [
        f"{'published' if r.created else 'unchanged, already'} {r.model} release {r.release} in {r.store} "
        f"({r.seconds:.1f} s)"
    ]
    lines += [
        f"  {s.sku:24s} {s.backend}/{s.precision}  manifest {s.manifest_digest[:12]}  {s.bytes} bytes  from {s.source}"
        + ("  (portable fallback)" if s.sku == r.fallback_sku else "")
        for s in r.skus
    ]
    if r.partial:
        lines.append(f"  partial: without {', '.join(r.partial)} (their devices run the portable fallback)")
    if r.selection is not None:
        lines.append(f"  device classes (selection {r.selection[:12]}):")
        lines += [f"    {c:22s} -> {s}" for c, s in r.classes.items()]
        lines += [f"    {c:22s} -> portable fallback: {why}" for c, why in r.unselected.items()]
    _print(args, r.to_json(), "\n".join(lines))
    return 0


def release_root(args: argparse.Namespace) -> int:

    _, store, keys = _context(args)
    root = root_bytes(store, keys)
    atomic_write_bytes(args.out, root)
    data = {
        "store": store.url,
        "out": str(args.out),
        "root_version": json.loads(root)["signed"]["version"],
        "root_sha256": hashlib.sha256(root).hexdigest(),
    }
    text = f"wrote the trusted root of {store.url} to {args.out}"
    if args.timestamp_out is not None:
        state = trust.read_state(store, keys)  # proven the newest, as a writer proves it
        atomic_write_bytes(args.timestamp_out, state.timestamp_data)
        data.update(
            timestamp_out=str(args.timestamp_out),
            timestamp_version=state.link.version,
            timestamp_sha256=state.link.sha256,
        )
        text += f" and its timestamp (version {state.link.version}) to {args.timestamp_out}"
    _print(
        args,
        data,
        text
        + ": provision devices with "
        + (
            "them (`skuforge agent --root ... --timestamp ...`)"
            if args.timestamp_out
            else "it (`skuforge agent --root`)"
        ),
    )
    return 0


def release_repair(args: argparse.Namespace) -> int:

    reg, store, keys = _context(args)
    r = repair(store, keys, reg.rollout.expiry)
    if r.action == "restored":
        found = r.found if r.found is not None else "(none)"
        what = (
            f"it was forked: dropped the store's version(s) {', '.join(map(str, r.dropped))}, which do not "
            f"follow the version {r.kept} this machine recorded"
            if r.forked
            else f"timestamp.json was version {found}, the newest committed {r.newest}"
        )
        text = (
            f"repaired {r.store}: {what}; signed version {r.timestamp} on snapshot {r.snapshot} "
            f"(the state of version {r.kept})"
        )
        if r.forked:
            text += (
                "\n  redo what the dropped versions committed (a publish, a rollout move): the store no longer has it"
            )
    elif r.action == "archived":
        text = (
            f"{r.store}: timestamp.json (version {r.timestamp}) was not in the archive; archived it as the newest "
            "committed state"
        )
    else:
        text = (
            f"{r.store} was not rolled back: timestamp.json is version {r.timestamp}, the newest committed; "
            "nothing to repair"
        )
    _print(args, r.to_json(), text)
    return 0


def _inventory(args: argparse.Namespace, reg) -> Inventory | None:
    """The fleet inventory: --inventory, else rollout.inventory of params.yaml; None when neither."""
    if getattr(args, "inventory", None) is not None:
        return load_inventory(args.inventory)
    if reg.rollout.inventory is not None:
        return load_inventory(reg.path(reg.rollout.inventory))
    return None


def _waves(args: argparse.Namespace, reg):
    """The overridden waves (--waves, --bake), or None: params.yaml's."""
    if args.waves is None and args.bake is None:
        return None
    return controller.rollout_waves(reg, args.waves, args.bake)


def rollout_plan(args: argparse.Namespace) -> int:

    reg, store, _ = _context(args, keys=False)
    inventory = _inventory(args, reg)
    if inventory is None:
        raise ConfigError("rollout plan: which fleet?", hint="give --inventory FILE or set rollout.inventory")
    state = trust.read_state(store)
    released = releases_of(state.targets.signed, args.model)
    rid = args.release or (released[-1] if released else None)
    doc = release_doc(store, args.model, rid) if rid in released else None
    skus = list(doc["skus"]) if doc else [s for _, s in reg.pairs(models=[args.model], skus=reg.release_skus())]
    # the release's class map; before the first release, what the selection would give it
    classes = (
        (doc.get("classes") or {})
        if doc
        else {c.device_class: c.chosen for c in select(reg, args.model).classes if c.chosen}
    )
    waves = controller.rollout_waves(reg, args.waves, args.bake)
    p = plan(
        inventory,
        waves,
        f"{args.model}-{rid or 'next'}",
        skus,
        reg.rollout.fallback_sku,
        labels=args.labels or (),
        classes=classes,
    )
    lines = [
        f"plan for {args.model} {rid or '(no release yet)'}: {len(inventory)} devices, "
        f"planned in {p.seconds * 1000:.0f} ms"
    ]
    for device_class, n in inventory.by_class().items():
        chosen = p.classes.get(device_class)
        lines.append(
            f"  class {device_class:20s} {n:8d} devices -> "
            + (chosen or "no engine selected: their own SKU's where they name one, else the fallback")
        )
    if inventory.by_class() and inventory.by_sku():
        lines.append("  devices naming no class: " + ", ".join(f"{k} {v}" for k, v in inventory.by_sku().items()))
    for w in p.waves:
        lines.append(
            f"  {w.name:10s} {w.devices:8d} devices (+{w.new_devices})  bake {w.bake_minutes:g} min"
            + (f"  {w.on_fallback} on the fallback" if w.on_fallback else "")
        )
    for group, what in (
        (p.fallback, f"will run the portable fallback {p.fallback_sku} (the release has no engine for them)"),
        (p.not_served, "cannot be served (the release has no engine for them and no fallback is set)"),
        (p.never_included, "are in no wave"),
        (p.not_targeted, f"lack the labels {', '.join(p.labels)}"),
    ):
        if group.devices:
            lines.append(f"  {group.devices} device(s) {what}: {_counted(group)}")
    _print(args, p.to_json(), "\n".join(lines))
    return 0


def _counted(group: DeviceGroup) -> str:
    """A plan's device group by class (devices that name one), then by SKU."""
    return ", ".join(
        [f"class {k} {v}" for k, v in group.by_class.items()] + [f"{k} {v}" for k, v in group.by_sku.items()]
    )


def rollout_start(args: argparse.Namespace) -> int:

    reg, store, keys = _context(args)
    doc = controller.start(
        reg,
        store,
        keys,
        args.model,
        args.release,
        inventory=_inventory(args, reg),
        actor=_actor(),
        reason=args.reason,
        waves=_waves(args, reg),
        labels=args.labels,
    )
    _print(
        args,
        doc.to_json(),
        f"started {doc.id}: {doc.release} (previous {doc.previous or 'none'}), wave {doc.waves[0].name}\n"
        f"  {doc.log[-1].reason}",
    )
    return 0


def _models(args: argparse.Namespace, store, registry, live_only: bool = True) -> list[str]:

    if args.all:
        return controller.rollout_models(store, live_only=live_only)
    registry.model(args.model)  # unknown (or hostile) names stop here, named
    return [args.model]


def _status_line(model: str, s) -> str:
    d = s.rollout
    if d is None:
        return f"{model}: no rollout"
    h = s.health
    head = f"{model}: {d.id} {d.status}, wave {d.wave + 1}/{len(d.waves)} ({d.waves[d.wave].name})"
    if h is not None:
        head += f", {h.reports} of {h.expected} devices reported: " + ", ".join(
            f"{k} {v}" for k, v in h.counts.items() if v
        )
    lines = [head, f"  next: {s.action} ({s.reason})"]
    if h is not None:
        lines += [
            f"  gate {g.name}: {'pass' if g.passed else 'FAIL' if g.passed is False else 'wait'} - {g.detail}"
            for g in h.gates
        ]
        if h.ignored:
            lines.append(
                f"  ignored {sum(h.ignored.values())} report(s): "
                + "; ".join(f"{why} ({n})" for why, n in sorted(h.ignored.items()))
            )
            lines += [f"    {e}" for e in h.ignored_examples[:5]]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _markdown(rows) -> str:
    out = [
        "| model | rollout | status | wave | reports | failures | ignored | last transition | next |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, s in rows:
        d, h = s.rollout, s.health
        if d is None:
            out.append(f"| {model} | - | none | - | - | - | - | - | - |")
            continue
        failed = h.reports - h.counts.get("ok", 0) if h else 0
        last = d.log[-1] if d.log else None
        status = f"**{d.status}**" if d.status in ("rolled_back", "aborted") else d.status
        out.append(
            f"| {model} | {d.id} | {status} | {d.waves[d.wave].name} | {h.reports if h else '-'} | "
            f"{failed if h else '-'} | {sum(h.ignored.values()) if h else '-'} | "
            + (_cell(f"{last.action} by {last.actor} at {last.at}: {last.reason}") if last else "-")
            + f" | {_cell(f'{s.action}: {s.reason}')} |"
        )
    return "\n".join(out)


def rollout_status(args: argparse.Namespace) -> int:

    reg, store, _ = _context(args, keys=False)
    models = _models(args, store, reg, live_only=False)
    inventory = _inventory(args, reg) if models else None
    rows = [(m, status(reg, store, m, inventory)) for m in models]
    if args.markdown:
        print(_markdown(rows) if rows else "no rollouts")
        return 0
    _print(args, {m: s.to_json() for m, s in rows}, "\n".join(_status_line(m, s) for m, s in rows) or "no rollouts")
    return 0


def rollout_advance(args: argparse.Namespace) -> int:
    """Advance each live rollout on its own (one model's failure or bad evidence never stops
    another's gate), then keep the signed timestamp fresh whether or not any rollout is live."""

    reg, store, keys = _context(args)
    models = _models(args, store, reg)
    inventory = _inventory(args, reg) if models else None
    if models and inventory is None:
        raise ConfigError(
            f"rollout advance: {len(models)} live rollout(s) ({', '.join(models)}) and no fleet inventory to "
            "authenticate device reports with",
            hint="set rollout.inventory in params.yaml or give --inventory (its key column holds each device's "
            "public key)",
        )
    rows, errors = [], {}
    for m in models:
        try:
            rows.append((m, advance(reg, store, keys, m, inventory=inventory, actor=_actor())))
        except SkuforgeError as exc:
            if not args.all:
                raise
            errors[m] = exc
            log.error("%s: %s", m, exc.message)
    refreshed = trust.refresh_timestamp(store, keys, reg.rollout.expiry)
    data = {m: s.to_json() for m, s in rows}
    data.update({m: {"error": e.message, "hint": e.hint} for m, e in errors.items()})
    text = "\n".join(f"{m}: {s.action}: {s.reason}" for m, s in rows) or ("" if errors else "no live rollouts")
    text += "".join(f"\n{m}: error: {e.message}" for m, e in errors.items())
    if refreshed:
        text += "\nre-signed the store's timestamp (devices refuse an expired one)"
    _print(args, {"rollouts": data, "timestamp_refreshed": refreshed} if args.json else data, text)
    if errors:
        return max(e.exit_code for e in errors.values())
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


def _read(path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputError(
            f"cannot read {flag} {path}: {exc.strerror or exc}",
            hint="give the file `skuforge release root` wrote at provisioning",
        ) from exc


def run_agent(args: argparse.Namespace) -> int:
    """Exit 0 when every model runs what it should (ok, current, idle, or the portable fallback), else 1."""
    import time

    if args.device is None or args.state is None:
        raise InputError(
            "skuforge agent needs --device FILE and --state DIR",
            hint="or `skuforge agent identity --state DIR` to print the device's public key",
        )
    url = args.store or store_url("")
    if not url:
        raise ConfigError("which store?", hint="give --store s3://bucket/prefix (or a folder), or set SKUFORGE_STORE")
    cfg = load_device(args.device)
    root = _read(args.root, "--root") if args.root is not None else None
    pinned = _read(args.timestamp, "--timestamp") if args.timestamp is not None else None
    agent = Agent(open_store(url), Device.from_config(cfg), args.state, root, timestamp=pinned)
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
            code = max(code, 0 if r.outcome in HEALTHY else 1)
        if args.interval <= 0:
            return code
        time.sleep(args.interval)


def agent_identity(args: argparse.Namespace) -> int:
    """The device's public key (made on first use) for the inventory's ``key`` column."""
    key = identity.device_key(args.state)
    _print(
        args, {"key": key.public_key, "key_id": key.key_id, "file": str(args.state / identity.KEY_FILE)}, key.public_key
    )
    return 0
