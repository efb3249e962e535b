"""Fleet simulation: the real device agent on 10k-100k simulated devices against an S3 server.

Run from the project root (a few minutes for 10k devices, ~20-30 for 100k on 2 cores):

    python benchmarks/fleet_sim.py [--devices 10000 100000] [--workers 3] [--canary-failure 0.1]
                                   [--incompatible 0.005]

What is real: a moto S3 server over HTTP on loopback (tests/rollout/s3server.py), the TUF-signed
store (pipeline/rollout/trust.py), releases published from a tiny project built by the pipeline's
own stages, the controller (plan, start, advance with gates, auto rollback) and, per device, the
agent's whole pass: TUF refresh and verification, rollout document, compatibility check, verified
downloads into an A/B slot on disk, activation, and the report PUT.

What is simulated, and why:
- Devices reach the store through an edge cache per worker process (a CDN point of presence in
  front of S3): content-addressed blobs and versioned metadata are immutable and cached; the
  timestamp and root probes are purged when the controller commits; reports and listings go to the
  origin. moto serves ~150-200 requests/s on this machine, so 100k devices without a cache would
  take hours; the script prints both the requests the agents made and those that reached S3.
- The smoke test (load the engine, run 64 golden samples, compare) runs for real once per
  distinct engine per worker and is memoised: identical simulated devices would compute the same.
  Injected failures replace it for the chosen devices (a stable hash of the device id).
- Each device runs one pass when a wave first includes it (devices outside the wave would poll and
  find nothing to do); the clock for bake times is simulated.

Scenarios per fleet size: "healthy" (release r1 everywhere; a share of devices with an old ONNX
Runtime take the portable fallback) and "failing canary" (release r2, a share of canary devices
fail the smoke test: the gate must halt the rollout and every device must end on r1).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

IMMUTABLE = ("blobs/",)


def _immutable(key: str) -> bool:
    if key.startswith(IMMUTABLE):
        return True
    name = key.rsplit("/", 1)[-1]
    return key.startswith("metadata/") and name[0].isdigit() and not name.endswith(".root.json")


class EdgeCache:
    """A read-through cache in front of a store (a CDN point of presence): immutable keys are kept,
    mutable ones (timestamp, root, root probes) until ``purge``; writes and listings pass through."""

    def __init__(self, origin):
        self.origin, self.url = origin, origin.url
        self.requests: collections.Counter = collections.Counter()
        self._immutable: dict[str, object] = {}
        self._mutable: dict[str, object] = {}
        self._lock = threading.Lock()

    def purge(self) -> None:
        with self._lock:
            self._mutable.clear()

    def get(self, key):
        self.requests["get"] += 1
        table = self._immutable if _immutable(key) else self._mutable
        with self._lock:
            if key in table:
                return table[key]
        blob = self.origin.get(key)
        if blob is not None or table is self._mutable:  # negative answers only for mutable keys
            with self._lock:
                table[key] = blob
        return blob

    def exists(self, key):
        self.requests["head"] += 1
        return self.origin.exists(key)

    def put(self, key, data, **kw):
        self.requests["put"] += 1
        return self.origin.put(key, data, **kw)

    def list(self, prefix):
        self.requests["list"] += 1
        return self.origin.list(prefix)

    def delete(self, key):
        self.requests["delete"] += 1
        return self.origin.delete(key)


def _device_key(device_id: str):
    """The simulated device's ed25519 key, derived from its id (a real device makes its own at
    provisioning: pipeline/rollout/identity.py); the inventory holds its public half."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pipeline.results.signing import SigningKey

    seed = hashlib.sha256(f"fleet-sim-device\0{device_id}".encode()).digest()
    return SigningKey(Ed25519PrivateKey.from_private_bytes(seed), f"simulated {device_id}")


def _hash01(salt: str, device_id: str) -> float:
    return int.from_bytes(hashlib.sha256(f"{salt}\0{device_id}".encode()).digest()[:8], "big") / 2**64


# --- worker processes -------------------------------------------------------------------------------

_W: dict = {}


def _init(endpoint: str, url: str, root: bytes, state: str, failure: float, salt: str) -> None:
    from rollout.s3server import s3_client

    from pipeline.rollout.store import S3Store

    origin = S3Store(
        url,
        client=s3_client(
            endpoint, connect_timeout=5, read_timeout=30, retries={"mode": "standard", "total_max_attempts": 5}
        ),
    )
    _W.update(
        edge=EdgeCache(origin),
        origin=origin,
        root=root,
        state=Path(state),
        failure=failure,
        salt=salt,
        memo={},
        wave=None,
    )


def _smoke_for(device_id: str):
    from pipeline.rollout import agent

    memo, failure, salt = _W["memo"], _W["failure"], _W["salt"]

    def smoke(entry, slot):
        if failure and entry["requires"].get("portable") is False and _hash01(salt, device_id) < failure:
            return agent.Smoke(False, "injected: the runtime crashed on this device")
        key = (entry["manifest_digest"], tuple(sorted(entry["sha256"].items())))
        if key not in memo:
            memo[key] = agent.smoke_test(entry, slot)
        return memo[key]

    return smoke


def _run(task):
    from pipeline.rollout import agent

    wave, model, devices, now = task
    _W["now"] = now
    if _W["wave"] != wave:  # the controller committed: the edge drops mutable metadata
        _W["edge"].purge()
        _W["wave"] = wave
    before = (collections.Counter(_W["edge"].requests), collections.Counter(_W["origin"].requests))
    out = []
    for dev_id, sku, runtime in devices:
        dev = agent.Device(
            id=dev_id, sku=sku, arch="x86_64", runtime={"onnxruntime": runtime}, cpu_features=frozenset()
        )
        a = agent.Agent(
            _W["edge"], dev, _W["state"] / dev_id, _W["root"], smoke=_smoke_for(dev_id), key=_device_key(dev_id)
        )
        r = a.run_once(model, now=_W["now"])
        out.append((dev_id, r.outcome, (r.active or {}).get("release"), (r.active or {}).get("kind"), r.seconds))
    return out, _W["edge"].requests - before[0], _W["origin"].requests - before[1]


# --- one scenario -----------------------------------------------------------------------------------


def _rollout(pool, reg, store, keys, model, inventory, devices_by_id, t0, label, failure_note):
    """Start the newest release, then run each wave's new devices and advance until done."""
    from pipeline.rollout import controller
    from pipeline.rollout.plan import first_wave, plan

    now = t0
    doc = controller.start(reg, store, keys, model, inventory=inventory, actor="fleet-sim", reason=label, now=now)
    t = time.perf_counter()
    p = plan(inventory, doc.waves, doc.id, reg.release_skus(), reg.rollout.fallback_sku)
    plan_s = time.perf_counter() - t
    first = {d.id: first_wave(doc.waves, doc.id, d.id, d.ring) for d in inventory}
    edge_req, origin_req = collections.Counter(), collections.Counter()
    outcomes, active, rows, done = collections.Counter(), {}, [], set()
    passes: list[float] = []
    wave = 0
    while True:
        todo = [devices_by_id[i] for i, w in first.items() if w is not None and w <= doc.wave and i not in done]
        t = time.perf_counter()
        chunks = [todo[i : i + 400] for i in range(0, len(todo), 400)]
        for res, e, o in pool.imap_unordered(_run, [(wave, model, c, now) for c in chunks]):
            edge_req += e
            origin_req += o
            for dev_id, outcome, release, kind, seconds in res:
                passes.append(seconds)
                outcomes[outcome] += 1
                active[dev_id] = (release, kind)
                done.add(dev_id)
        pass_s = time.perf_counter() - t
        now += timedelta(minutes=doc.waves[doc.wave].bake_minutes + 1)
        t = time.perf_counter()
        s = controller.advance(reg, store, keys, model, inventory=inventory, actor="fleet-sim", now=now)
        adv_s = time.perf_counter() - t
        rows.append((doc.waves[doc.wave].name, len(todo), pass_s, adv_s, s.action, s.reason))
        wave += 1
        doc = s.rollout
        if s.action != "advanced":
            break
    passes.sort()
    return p, plan_s, rows, outcomes, active, edge_req, origin_req, s, doc, passes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[10000, 100000])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--canary-failure", type=float, default=0.1, help="share of canary devices failing r2's smoke test")
    ap.add_argument("--incompatible", type=float, default=0.005, help="share of devices with an old ONNX Runtime")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
        help="where the simulated devices keep their state (default: /dev/shm, a RAM disk: a real "
        "device pays its own disk's fsyncs, the simulation should not pay 100k of them)",
    )
    args = ap.parse_args()
    os.environ.setdefault("SKUFORGE_KEY_DIR", tempfile.mkdtemp(prefix="fleet-keys-"))

    import logging

    logging.basicConfig(level=logging.WARNING)
    from registry_helpers import make_project, sku
    from rollout.s3server import MotoS3, s3_client

    from pipeline.project.config import load_registry
    from pipeline.results.signing import signing_key
    from pipeline.rollout import release, trust
    from pipeline.rollout.inventory import Device, load_inventory, write_inventory
    from pipeline.rollout.store import S3Store
    from pipeline.stages.bench import bench
    from pipeline.stages.build import build
    from pipeline.stages.manifest import write_manifest
    from pipeline.stages.validate import validate

    tmp = Path(tempfile.mkdtemp(prefix="fleet-sim-"))
    waves = [
        {"name": "canary", "percent": 1, "bake_minutes": 60},
        {"name": "early", "percent": 10, "bake_minutes": 240},
        {"name": "half", "percent": 50, "bake_minutes": 720},
        {"name": "all", "percent": 100, "bake_minutes": 0},
    ]
    print("building the project (conv_bn: optimized ORT FP32 + portable fallback) ...", flush=True)
    reg = make_project(
        tmp / "project",
        {"cpu": sku(), "portable": sku(options={"graph_optimization_level": "basic"})},
        rollout={
            "fallback_sku": "portable",
            "waves": waves,
            "gates": {
                "min_reports": 20,
                "max_failure_rate": 0.02,
                "max_smoke_failures": 0,
                "max_latency_regression": 0.5,
            },
        },
    )
    keys = trust.Keys.single(signing_key())
    states: list[Path] = []
    try:
        with MotoS3() as s3:
            for n in args.devices:
                bucket = s3.make_bucket()
                url = f"s3://{bucket}/fleet"
                store = S3Store(url, client=s3_client(s3.endpoint, max_pool_connections=32))
                trust.initialise(store, keys, reg.rollout.expiry)
                t = time.perf_counter()
                r1 = release.publish_release(reg, store, keys, "conv", actor="fleet-sim")
                publish_s = time.perf_counter() - t
                inv_path = tmp / f"fleet-{n}.csv"
                rt = lambda i: "1.0.0" if _hash01("rt", f"d{i:06d}") < args.incompatible else "1.32.0"  # noqa: E731
                write_inventory(
                    inv_path,
                    [
                        Device(
                            id=f"d{i:06d}",
                            sku="cpu",
                            arch="x86_64",
                            runtime={"onnxruntime": rt(i)},
                            key=_device_key(f"d{i:06d}").public_key,
                        )
                        for i in range(n)
                    ],
                )
                t = time.perf_counter()
                inventory = load_inventory(inv_path)
                load_s = time.perf_counter() - t
                by_id = {d.id: (d.id, d.sku, d.runtime["onnxruntime"]) for d in inventory}
                state = Path(tempfile.mkdtemp(prefix=f"fleet-devices-{n}-", dir=args.state_dir))
                states.append(state)  # removed in `finally`: 100k devices hold ~2M files (a RAM disk's inodes)
                root = trust.root_bytes(store)
                print(
                    f"\n=== {n} devices (inventory CSV with keys loaded in {load_s:.2f} s; r1 published in "
                    f"{publish_s:.1f} s; store {url} on {s3.endpoint})",
                    flush=True,
                )
                ctx = mp.get_context("fork")
                t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
                for label, failure in (("healthy", 0.0), ("failing canary", args.canary_failure)):
                    if label == "failing canary":  # r2: the same model rebuilt with another thread setting
                        copy = tmp / f"project-r2-{n}"
                        if not copy.exists():  # rebuilt and benchmarked again: new manifests, a new release
                            shutil.copytree(tmp / "project", copy)
                        reg2 = load_registry(copy / "params.yaml")
                        for s_ in ("cpu", "portable"):
                            build(reg2, "conv", s_)
                            validate(reg2, "conv", s_)
                            bench(reg2, "conv", s_)
                            write_manifest(reg2, "conv", s_)
                        r = release.publish_release(reg2, store, keys, "conv", actor="fleet-sim")
                        t0 += timedelta(days=3)
                    else:
                        r = r1
                    with ctx.Pool(
                        args.workers, initializer=_init, initargs=(s3.endpoint, url, root, str(state), failure, "fail")
                    ) as pool:
                        p, plan_s, rows, outcomes, active, edge_req, origin_req, final, doc, passes = _rollout(
                            pool, reg, store, keys, "conv", inventory, by_id, t0, label, failure
                        )
                    reached = sum(r_[1] for r_ in rows)
                    print(
                        f"-- {label}: release {r.release}; plan {plan_s * 1000:.0f} ms "
                        f"({', '.join(f'{w.name} {w.devices}' for w in p.waves)})"
                    )
                    print(f"   {'wave':8s} {'devices':>8s} {'agents s':>9s} {'dev/s':>7s} {'advance s':>9s}  result")
                    for name, count, pass_s, adv_s, action, why in rows:
                        print(
                            f"   {name:8s} {count:8d} {pass_s:9.1f} {count / pass_s if pass_s else 0:7.0f} "
                            f"{adv_s:9.2f}  {action}: {why[:110]}"
                        )
                    per = max(reached, 1)
                    print(
                        "   agent requests/device: "
                        + ", ".join(f"{k} {v / per:.2f}" for k, v in sorted(edge_req.items()))
                    )
                    print(
                        "   S3 requests/device:    "
                        + ", ".join(f"{k} {v / per:.2f}" for k, v in sorted(origin_req.items()))
                        + f"  (total {sum(origin_req.values())})"
                    )
                    print(f"   outcomes: {dict(outcomes)}; rollout {doc.status}")
                    if passes:
                        p50, p95, p99 = (passes[min(len(passes) - 1, int(q * len(passes)))] for q in (0.5, 0.95, 0.99))
                        print(
                            f"   agent pass (install): p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
                            f"p99 {p99 * 1000:.0f} ms over {len(passes)} passes"
                        )
                    sizes = [f.stat().st_size for f in state.rglob("*") if f.is_file()]
                    devices_with_state = sum(1 for _ in state.iterdir())
                    if devices_with_state:
                        print(
                            f"   device state: {sum(sizes) / devices_with_state / 1024:.0f} KB per device "
                            f"({devices_with_state} devices: TUF metadata, two slots, key, reports marker)"
                        )
                    if doc.status == "rolled_back":
                        with ctx.Pool(
                            args.workers, initializer=_init, initargs=(s3.endpoint, url, root, str(state), 0.0, "fail")
                        ) as pool:
                            t = time.perf_counter()
                            now_ = datetime.fromisoformat(doc.log[-1].at)
                            after = collections.Counter()
                            chunks = [list(by_id[i] for i in active)[k : k + 400] for k in range(0, len(active), 400)]
                            for res, _, _ in pool.imap_unordered(_run, [(99, "conv", c, now_) for c in chunks]):
                                for _dev_id, _outcome, rel_, kind, _ in res:
                                    after[(rel_, kind)] += 1
                            print(
                                f"   after rollback ({time.perf_counter() - t:.1f} s): devices on "
                                + ", ".join(f"{rl} {k}: {c}" for (rl, k), c in sorted(after.items(), key=str))
                            )
                    else:
                        on = collections.Counter(active.values())
                        print(
                            "   devices on " + ", ".join(f"{rl} {k}: {c}" for (rl, k), c in sorted(on.items(), key=str))
                        )
                shutil.rmtree(state, ignore_errors=True)
    finally:
        for state in states:
            shutil.rmtree(state, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
