"""A test fleet: devices with real ed25519 keys in an inventory, and reports signed as the agent signs them."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from pipeline.results.signing import SigningKey
from pipeline.rollout import doc as rdoc
from pipeline.rollout import identity, plan
from pipeline.rollout.inventory import Device, Inventory

_KEYS: list[SigningKey] = []  # generated once per process: 200 keys take ~20 ms, but tests make many fleets


def _key(i: int) -> SigningKey:
    while len(_KEYS) <= i:
        _KEYS.append(SigningKey.generate("test fleet"))
    return _KEYS[i]


class Fleet:
    """``n`` devices ``dev0..`` of one SKU, each with its own key; ``labels`` maps ids to labels."""

    def __init__(self, n: int = 200, sku: str = "cpu", arch: str = "x86_64", labels: dict[str, tuple] | None = None):
        self.keys = {f"dev{i}": _key(i) for i in range(n)}
        self.inventory = Inventory(
            Device(id=i, sku=sku, arch=arch, labels=(labels or {}).get(i, ()), key=k.public_key)
            for i, k in self.keys.items()
        )

    def first_in(self, doc: rdoc.RolloutDoc, wave: int, n: int = 1) -> list[str]:
        """``n`` devices of the fleet that wave ``wave`` is the first to take."""
        ids = [
            d.id
            for d in self.inventory
            if rdoc.targeted(doc, d.labels) and plan.first_wave(doc.waves, doc.id, d.id, d.ring) == wave
        ]
        assert len(ids) >= n, f"the fleet has only {len(ids)} devices first in wave {wave}"
        return ids[:n]

    def body(self, doc: rdoc.RolloutDoc, device_id: str, outcome: str = "ok", **fields: Any) -> dict[str, Any]:
        at = fields.pop("at", None) or datetime.now(timezone.utc).replace(microsecond=0)
        return {
            "device": device_id,
            "model": doc.model,
            "rollout": doc.id,
            "release": doc.release,
            "outcome": outcome,
            "latency_ratio": 1.0,
            "at": at.isoformat(),
            "attempt": 1,
            **fields,
        }

    def report(self, store, doc: rdoc.RolloutDoc, device_id: str, outcome: str = "ok", **fields: Any) -> str:
        """Store a report signed by the device, as the agent does; its key."""
        key = rdoc.report_key(doc.model, doc.id, outcome, device_id)
        store.put(key, identity.sign_report(self.keys[device_id], self.body(doc, device_id, outcome, **fields)))
        return key
