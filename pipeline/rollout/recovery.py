"""Recovery of a release store put back to an older state, or forked: ``skuforge release repair``.

A store writer without the keys can put back an older, validly signed ``timestamp.json`` (a
replay), and a writer that could not tell may then sign on top of it (a fork: two states signed on
one history). Readers and writers refuse both (pipeline/rollout/trust.py: ``read_state``), devices
too (pipeline/rollout/client.py); :func:`repair`, run with the signing key, ends it: it commits the
state to keep again, above every version anyone may have trusted, in a timestamp signed as a repair.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from pipeline.core.errors import ServiceError
from pipeline.rollout import trust
from pipeline.rollout.store import Blob, PreconditionFailed, Store

if TYPE_CHECKING:
    from tuf.api.metadata import Metadata

    from pipeline.project.config import Expiry

log = logging.getLogger(__name__)


@dataclass
class Repair:
    """What :func:`repair` found and did."""

    store: str
    replayed: bool  # a state was committed again: the store was rolled back or forked
    found: int | None  # timestamp.json's version as found (None: missing or not verifying)
    newest: int  # the newest timestamp version known (archive, ledger, timestamp.json)
    timestamp: int  # timestamp.json's version now
    snapshot: int  # the snapshot it points at
    action: Literal["none", "archived", "restored"] = "none"
    kept: int | None = None  # the committed version whose state was restored
    forked: bool = False  # the store held versions that do not follow the kept one
    dropped: list[int] = field(default_factory=list)  # those versions

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Known:
    """A committed state that timestamp.json, the archive or this machine's record knows of."""

    version: int
    snapshot: int
    link: trust.Link | None  # None: a record of an earlier skuforge, versions only
    snapshot_sha256: str = ""


def _known(md: Metadata, data: bytes) -> _Known:
    return _Known(
        md.signed.version, md.signed.snapshot_meta.version, trust.Link(md.signed.version, trust.sha256_hex(data))
    )


def repair(store: Store, keys: trust.Keys, expiry: Expiry) -> Repair:
    """Undo a replay or a fork: commit the state to keep again, its targets and snapshot at versions
    above every one seen and its timestamp above every version seen (timestamp.json, the archive, this
    machine's ledger), signed as a repair that follows the kept version. The state kept is this
    machine's record when timestamp.json does not follow it (forked, or links missing), the archived
    version when timestamp.json is another file at that version, else the newest committed whose files
    verify. Devices accept it whatever they trusted before. A store that serves its newest state is
    left as it is, its timestamp archived if the archive lacks it (from a machine with no record, that
    accepts timestamp.json as the newest)."""
    for _ in range(trust.MAX_ATTEMPTS):
        root, origin = trust._chain(store, keys)
        trust._check_online(root, keys)
        blob = store.get(trust.TIMESTAMP_KEY)
        found: Metadata | None = None
        if blob is not None:
            try:
                found = trust._parse(blob.data, "timestamp.json")
                trust._verify(root, "timestamp", found, "timestamp.json")
            except trust.VerificationFailed as exc:
                log.warning("timestamp.json of %s is unusable: %s", store.url, exc)
                found = None
        archived = trust._newest_archived(store, root, iter(store.list(trust.ARCHIVE)))
        mine = trust._recorded(keys, store, origin)
        here = _known(found, blob.data) if found is not None and blob is not None else None
        there = _known(*archived) if archived is not None else None
        ours = None
        if mine is not None:
            link = trust.Link(mine.timestamp, mine.timestamp_sha256) if mine.timestamp_sha256 else None
            ours = _Known(mine.timestamp, mine.snapshot, link, mine.snapshot_sha256)
        known = [k for k in (here, there, ours) if k is not None]
        if not known:
            raise trust.VerificationFailed(
                f"the store {store.url} holds no timestamp that verifies, archived or current, and this "
                "machine has no record of it",
                hint="restore metadata/timestamp.json from a backup",
            )
        top = max(k.version for k in known)
        chosen = _to_keep(store, root, found, here, there, ours, known)
        if chosen is None:  # timestamp.json is the newest state
            assert here is not None and blob is not None
            _, targets, _ = trust._committed_state(store, root, here.snapshot)
            archive = there is None or there.version < here.version
            if archive:
                state = trust.Committed(here.version, here.snapshot, targets.signed.version)
                trust._landed(store, keys, root, origin, blob.data, state)
            action: Literal["none", "archived"] = "archived" if archive else "none"
            return Repair(store.url, False, here.version, top, here.version, here.snapshot, action)
        keep, dropped = chosen
        restored = _recommit(store, keys, root, origin, expiry, keep, known, top, blob)
        if restored is None:
            continue  # another writer changed timestamp.json meanwhile: look again
        kept, sv = restored
        log.debug(
            "repaired %s: kept the state of timestamp v%d, signed v%d on snapshot v%d", store.url, kept, top + 1, sv
        )
        return Repair(
            store.url,
            True,
            here.version if here is not None else None,
            top,
            top + 1,
            sv,
            "restored",
            kept,
            bool(dropped),
            dropped,
        )
    raise ServiceError("could not repair the timestamp: other writers kept changing it", hint="run again")


def _to_keep(
    store: Store,
    root: Metadata,
    found: Metadata | None,
    here: _Known | None,
    there: _Known | None,
    ours: _Known | None,
    known: list[_Known],
) -> tuple[list[_Known], list[int]] | None:
    """The states to restore, best first, and the versions of timestamp.json's history that do not
    follow them; None when timestamp.json (``here``) is the newest state."""
    if here is not None and found is not None and ours is not None and ours.link and here.version >= ours.version:
        same = here.version == ours.version
        if here.link != ours.link if same else trust.walk(store, root, found, ours.link):
            return [ours], list(range(ours.version, here.version + 1))  # the store's, from ours on
    if here is not None and there is not None and there.version == here.version and there.link != here.link:
        return [there], [here.version]
    if here is not None and here.version >= max(k.version for k in known):
        return None
    return sorted(known, key=lambda k: k.version, reverse=True), []  # rolled back: the newest that verifies


def _recommit(
    store: Store,
    keys: trust.Keys,
    root: Metadata,
    origin: str,
    expiry: Expiry,
    candidates: list[_Known],
    known: list[_Known],
    top: int,
    blob: Blob | None,
) -> tuple[int, int] | None:
    """Commit again the first of ``candidates`` whose files verify (and are the ones recorded): targets
    and snapshot above every version ``known`` names, timestamp ``top + 1`` signed as a repair that
    follows it. The kept version and the new snapshot's; None when timestamp.json changed meanwhile."""
    from tuf.api.metadata import Metadata, MetaFile, Timestamp

    for keep in candidates:
        try:
            snapshot, targets, sha = trust._committed_state(store, root, keep.snapshot)
        except trust.VerificationFailed as exc:
            log.warning("timestamp v%d's snapshot v%d is not usable: %s", keep.version, keep.snapshot, exc)
            continue
        if not keep.snapshot_sha256 or sha == keep.snapshot_sha256:
            break
        log.warning(
            "snapshot v%d in %s is not the one recorded for timestamp v%d", keep.snapshot, store.url, keep.version
        )
    else:
        raise trust.VerificationFailed(
            f"no committed snapshot of {store.url} verifies (tried {', '.join(f'v{k.snapshot}' for k in candidates)})",
            hint="restore the store's metadata/ from a backup",
        )
    # a device may trust any known state: the new versions must stay above all of them
    tv_top = targets.signed.version
    for k in known:
        with contextlib.suppress(trust.VerificationFailed):
            tv_top = max(tv_top, trust._committed_state(store, root, k.snapshot)[1].signed.version)
    targets.signed.expires = trust._expires(expiry.targets_days)
    tv, _ = trust._write_versioned(store, "targets", tv_top + 1, trust._signed_at(targets, keys.online))
    snapshot.signed.meta["targets.json"] = MetaFile(version=tv)
    snapshot.signed.expires = trust._expires(expiry.snapshot_days)
    sv, snap = trust._write_versioned(
        store, "snapshot", max(k.snapshot for k in known) + 1, trust._signed_at(snapshot, keys.online)
    )
    ts = Timestamp(
        version=top + 1,
        spec_version=trust.SPEC_VERSION,
        expires=trust._expires(expiry.timestamp_days),
        snapshot_meta=MetaFile(version=sv),
    )
    trust._follow(ts, keep.link, repair=True)
    data = trust._sign(Metadata(ts), [keys.online])
    try:
        if blob is None:
            store.put(trust.TIMESTAMP_KEY, data, if_none_match=True)
        else:
            store.put(trust.TIMESTAMP_KEY, data, if_match=blob.etag)
    except PreconditionFailed:
        return None
    trust._landed(
        store, keys, root, origin, data, trust.Committed(top + 1, sv, tv, snapshot_sha256=trust.sha256_hex(snap))
    )
    return keep.version, sv
