"""Signed release metadata: a TUF repository kept in the release store, and the client devices use.

The four TUF roles sign what the store serves (the ``tuf`` package's Metadata API):

- ``root`` names the keys and thresholds of every role (``metadata/<n>.root.json``; rotating keys
  writes the next version signed by the old and new keys);
- ``targets`` lists every file a device may fetch (engines, manifests, golden data, release and
  rollout documents) with its length and sha256;
- ``snapshot`` pins the targets version, ``timestamp`` pins the snapshot version and expires soon,
  so a frozen store is noticed (freeze attack) and an older, validly signed state is refused by a
  device that saw a newer one (rollback attack).

Files are stored once, by content: target ``releases/m/r1/sku/engine/model.onnx`` with sha256 ``h``
is the blob ``blobs/sha256/h`` (consistent snapshots: the URL a client forms carries the hash).

Publishing is a compare-and-swap on ``metadata/timestamp.json``: blobs first, then new versioned
targets and snapshot files (never overwriting), then the timestamp, conditional on the etag read at
the start. A writer that loses the race re-reads and applies its change again; the state a reader
sees only ever moves from one whole, signed state to the next.

A store writer without the keys cannot sign, but can put back an older, validly signed
``timestamp.json`` (a replay: an aborted rollout looks active again). Devices refuse it (ngclient
remembers what it trusted); writers and readers here must too, or they would build on it. So each
swap also archives the timestamp it committed under a key never overwritten
(``metadata/timestamps/<countdown>-<v>.json``, named so that the newest lists first), and
:func:`read_state` refuses a ``timestamp.json`` older than the newest archived one that verifies.
A writer also keeps, on its own machine (``Keys.ledger``), the versions it last committed to each
store, which catches a replay that deleted the archive too. :func:`repair` re-signs a timestamp
above every version seen, on the newest committed snapshot.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.core.errors import ConfigError, GateFailed, InputError, ServiceError, SkuforgeError, StorageError
from pipeline.core.io import atomic_write_json
from pipeline.rollout.store import Blob, PreconditionFailed, Store

if TYPE_CHECKING:
    from tuf.api.metadata import Metadata, Targets

    from pipeline.project.config import Expiry
    from pipeline.results.signing import SigningKey

log = logging.getLogger(__name__)

METADATA = "metadata"
BLOBS = "blobs/sha256"
TIMESTAMP_KEY = f"{METADATA}/timestamp.json"
ROLES = ("root", "targets", "snapshot", "timestamp")
SPEC_VERSION = "1.0.31"
MAX_ATTEMPTS = 20
ARCHIVE = f"{METADATA}/timestamps"
_COUNTDOWN = 10**12  # archive names count down from here: the newest sorts (and lists) first
MAX_UNVERIFIED = 20  # archive entries that do not verify, skipped before the archive is refused
PINS = "release-roots"  # beside params.yaml: one pinned root per store
LEGACY_PIN = "release-root.json"  # the single pin of earlier versions, read for the store it was made for
REPAIR_HINT = (
    "nothing was written. If you did not restore the store on purpose, someone with write access "
    "to it put back older metadata: check who. Then run `skuforge release repair` with the signing "
    "key: it signs a timestamp above every version seen, on the newest committed state"
)

Init = Literal["created", "completed", "existing"]


class VerificationFailed(GateFailed):
    """Signed metadata or a file did not verify (bad signature, expired, replayed, wrong hash)."""


def blob_key(sha256: str) -> str:
    return f"{BLOBS}/{sha256}"


@dataclass
class Keys:
    """Signing keys per role. The default: one publishing key (``SKUFORGE_SIGNING_KEY`` or the
    developer key, pipeline/results/signing.py) signs every role with threshold 1; ``root`` may instead be a
    set of offline keys with a threshold."""

    root: list[SigningKey]
    online: SigningKey  # targets, snapshot and timestamp
    root_threshold: int = 1
    anchor: bytes | None = None  # the project's pinned root.json: the store's chain must hold it
    ledger: Path | None = None  # folder of this machine's records of what it committed (None: none kept)

    @classmethod
    def single(cls, key: SigningKey, anchor: bytes | None = None, ledger: Path | None = None) -> Keys:
        return cls(root=[key], online=key, anchor=anchor, ledger=ledger)


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def _expires(days: float) -> datetime:
    return _now() + timedelta(days=days)


def _sign(md: Metadata, keys: list[SigningKey]) -> bytes:
    from tuf.api.serialization.json import JSONSerializer

    for i, key in enumerate(keys):
        md.sign(key.tuf_signer(), append=i > 0)
    return md.to_bytes(JSONSerializer(compact=False))


def _put_new(store: Store, key: str, data: bytes) -> bool:
    """Write ``key`` unless it exists; True when this call wrote it."""
    try:
        store.put(key, data, if_none_match=True)
        return True
    except PreconditionFailed:
        return False


def put_blob(store: Store, data: bytes) -> str:
    """Store ``data`` by content; its sha256. An existing blob of the right size is kept."""
    sha = hashlib.sha256(data).hexdigest()
    if not _put_new(store, blob_key(sha), data):
        have = store.get(blob_key(sha))
        if have is None or have.data != data:  # a damaged copy (truncated by hand, say): replace it
            log.warning("blob %s in the store is damaged: rewriting it", sha[:12])
            store.put(blob_key(sha), data)
    return sha


# --- the repository (CI side) ---------------------------------------------------------------------


@dataclass
class State:
    """What the store serves now: the signed metadata and the timestamp's etag (for the swap)."""

    root: Metadata
    targets: Metadata
    snapshot: Metadata
    timestamp: Metadata
    etag: str
    origin: str = ""  # sha256 of the store's 1.root.json: which store this is, for the writer's ledger


def _new_root(keys: Keys, expiry: Expiry) -> bytes:
    from tuf.api.metadata import Metadata, Role, Root

    root = Root(version=1, spec_version=SPEC_VERSION, expires=_expires(expiry.root_days), consistent_snapshot=True)
    for key in keys.root:
        root.add_key(key.tuf_signer().public_key, "root")
    root.roles["root"] = Role([k.tuf_signer().public_key.keyid for k in keys.root], keys.root_threshold)
    for role in ("targets", "snapshot", "timestamp"):
        root.add_key(keys.online.tuf_signer().public_key, role)
    return _sign(Metadata(root), keys.root)


def initialise(store: Store, keys: Keys, expiry: Expiry) -> Init:
    """Create the store's repository: root, empty targets and snapshot, then the timestamp last.

    Resumable: ``1.root.json`` is the claim (written if absent); an init that died after it left a
    store this call completes ("completed"). A store whose repository is whole is left as it is
    ("existing"). Checked before anything is written: a store with a root must be this project's
    (its chain holds ``keys.anchor``, else its version 1 carries a valid signature of one of
    ``keys.root``), and a pinned root with no repository in the store is refused (the store was
    emptied, or the pin is another store's)."""
    from tuf.api.metadata import Metadata, MetaFile, Snapshot, Targets, Timestamp

    claimed = store.exists(f"{METADATA}/1.root.json")
    if not claimed and keys.anchor is not None:
        raise VerificationFailed(
            f"the project pins a root for {store.url} but the store has no repository: it was emptied, "
            "or the pin is another store's",
            hint="restore the store from a backup; to start a new store there on purpose, delete its "
            "pin under release-roots/ (devices provisioned with the old root will refuse the new one)",
        )
    made = not claimed and _put_new(store, f"{METADATA}/1.root.json", _new_root(keys, expiry))
    root, origin = _chain(store, keys)  # whoever made the claim (another init racing us), it must be ours
    if not made and store.exists(TIMESTAMP_KEY):
        read_state(store, keys)  # whole and verifiable: nothing to complete
        return "existing"
    _check_online(root, keys)
    targets = Targets(version=1, spec_version=SPEC_VERSION, expires=_expires(expiry.targets_days))
    snapshot = Snapshot(
        version=1,
        spec_version=SPEC_VERSION,
        expires=_expires(expiry.snapshot_days),
        meta={"targets.json": MetaFile(version=1)},
    )
    timestamp = Timestamp(
        version=1, spec_version=SPEC_VERSION, expires=_expires(expiry.timestamp_days), snapshot_meta=MetaFile(version=1)
    )
    latest = _serialised(root)
    have = store.get(f"{METADATA}/root.json")
    if have is None or have.data != latest:
        store.put(f"{METADATA}/root.json", latest)
    _put_new(store, f"{METADATA}/1.targets.json", _sign(Metadata(targets), [keys.online]))
    _put_new(store, f"{METADATA}/1.snapshot.json", _sign(Metadata(snapshot), [keys.online]))
    ts_bytes = _sign(Metadata(timestamp), [keys.online])
    if _put_new(store, TIMESTAMP_KEY, ts_bytes):
        _landed(store, keys, origin, ts_bytes, Committed(1, 1, 1))
    read_state(store, keys)  # what a crashed init left must verify as what this one would write
    log.debug("%s the signed release store at %s", "created" if made else "completed", store.url)
    return "created" if made else "completed"


def _parse(data: bytes, what: str) -> Metadata:
    from tuf.api.metadata import Metadata

    try:
        return Metadata.from_bytes(data)
    except Exception as exc:  # DeserializationError and friends: the store holds garbage
        raise VerificationFailed(
            f"the store's {what} is not TUF metadata: {exc}",
            hint="restore it from a backup; never edit store metadata by hand",
        ) from exc


def _root_signed(md: Metadata, by: Metadata, what: str) -> None:
    from tuf.api.exceptions import UnsignedMetadataError

    try:
        by.signed.verify_delegate("root", md.signed_bytes, md.signatures)
    except UnsignedMetadataError as exc:
        raise VerificationFailed(
            f"the store's {what} is not signed by the root keys it must be: {exc}",
            hint="someone replaced the store's root; restore it from a backup",
        ) from exc


def _signed_by_one_of(md: Metadata, keys: list[SigningKey]) -> bool:
    """Whether a root key of ``md`` among ``keys`` signed it. Its threshold is not enough: a forged
    root may list the project's public key beside the forger's, with threshold 1, signed by the
    forger alone."""
    from securesystemslib.exceptions import UnverifiedSignatureError

    for key in keys:
        public = key.tuf_signer().public_key
        sig = md.signatures.get(public.keyid)
        if sig is None or public.keyid not in md.signed.roles["root"].keyids:
            continue
        try:
            public.verify_signature(sig, md.signed_bytes)
        except UnverifiedSignatureError:
            continue
        return True
    return False


def _chain(store: Store, keys: Keys | None = None) -> tuple[Metadata, str]:
    """The newest root, reached along the versioned chain from ``1.root.json`` as a device walks it:
    each version signed by its own root keys and by the previous version's; and the sha256 of
    ``1.root.json`` (the store's identity). A writer (``keys``) also anchors the chain: the project's
    pinned root (``keys.anchor``) must be a link of it, or, with none pinned, one of its own root
    keys must have signed version 1; otherwise a store writer could hand it a forged root listing
    the writer's public key and have it sign their targets."""
    first = store.get(f"{METADATA}/1.root.json")
    if first is None:
        raise InputError(
            f"the store {store.url} has no signed root", hint="run `skuforge release init` once to create it"
        )
    root = _parse(first.data, "1.root.json")
    _root_signed(root, root, "1.root.json")
    anchor = _parse(keys.anchor, "pinned root") if keys is not None and keys.anchor else None
    if keys is not None and anchor is None and not _signed_by_one_of(root, keys.root):
        raise VerificationFailed(
            f"the root of {store.url} is not one this project created: none of its root keys is the signing key",
            hint=f"commit the pin that `skuforge release init` wrote under {PINS}/ when it created this "
            "store (a copy of its genuine metadata/1.root.json, from a source you trust, not from the store)",
        )
    chain = {1: root}
    while True:
        n = root.signed.version
        nxt = store.get(f"{METADATA}/{n + 1}.root.json")
        if nxt is None:
            break
        new = _parse(nxt.data, f"{n + 1}.root.json")
        if new.signed.version != n + 1:
            raise VerificationFailed(
                f"{n + 1}.root.json says version {new.signed.version}",
                hint="the store's root chain was tampered with; restore it",
            )
        _root_signed(new, root, f"{n + 1}.root.json")
        _root_signed(new, new, f"{n + 1}.root.json")
        root = chain[n + 1] = new
    if anchor is not None:
        link = chain.get(anchor.signed.version)
        if link is None or link.signed_bytes != anchor.signed_bytes:
            raise VerificationFailed(
                f"the root chain of {store.url} does not contain the project's pinned root "
                f"(version {anchor.signed.version})",
                hint="the store was replaced or tampered with; restore it, or pin its root "
                "again only if you know why it changed",
            )
    return root, hashlib.sha256(first.data).hexdigest()


def _latest_root(store: Store, keys: Keys | None = None) -> Metadata:
    return _chain(store, keys)[0]


def _verify(root: Metadata, role: str, md: Metadata, what: str) -> None:
    from tuf.api.exceptions import UnsignedMetadataError

    try:
        root.signed.verify_delegate(role, md.signed_bytes, md.signatures)
    except UnsignedMetadataError as exc:
        raise VerificationFailed(
            f"the store's {what} is not signed by the {role} keys its root names: {exc}",
            hint="someone wrote to the store without the signing key; restore it",
        ) from exc


def _committed_state(store: Store, root: Metadata, sv: int) -> tuple[Metadata, Metadata]:
    """Snapshot ``sv`` and the targets it names, verified, each the version its parent says."""
    snapshot = _parse(_must(store, f"{METADATA}/{sv}.snapshot.json").data, f"{sv}.snapshot.json")
    _verify(root, "snapshot", snapshot, f"{sv}.snapshot.json")
    tv = snapshot.signed.meta["targets.json"].version
    targets = _parse(_must(store, f"{METADATA}/{tv}.targets.json").data, f"{tv}.targets.json")
    _verify(root, "targets", targets, f"{tv}.targets.json")
    for md, want, name in ((snapshot, sv, "snapshot"), (targets, tv, "targets")):
        if md.signed.version != want:  # an older signed file copied over a newer one
            raise VerificationFailed(
                f"the store's {want}.{name}.json holds version {md.signed.version}",
                hint="someone copied older metadata over newer; restore it from a backup",
            )
    return snapshot, targets


def read_state(store: Store, keys: Keys | None = None) -> State:
    """The current metadata, each verified against the root's keys (a writer, with ``keys``, never
    builds on metadata it could not have signed itself). Refuses a replayed store: a
    ``timestamp.json`` older than the newest archived timestamp, or (a writer with a ledger) than
    the version this machine committed."""
    root, origin = _chain(store, keys)
    # listed before timestamp.json is read: a writer archives only after its swap, so nothing listed
    # now can be newer than the timestamp read next, unless an older one was put back since
    archived = iter(store.list(ARCHIVE))
    head = next(archived, None)
    ts_blob = store.get(TIMESTAMP_KEY)
    if ts_blob is None:
        raise InputError(f"the store {store.url} has no timestamp.json", hint="run `skuforge release init`")
    timestamp = _parse(ts_blob.data, "timestamp.json")
    _verify(root, "timestamp", timestamp, "timestamp.json")
    version = timestamp.signed.version
    newest = _newest_archived(store, root, itertools.chain([head] if head else [], archived), above=version)
    if newest is not None:
        raise VerificationFailed(
            f"the store {store.url} was rolled back: metadata/timestamp.json is version {version}, older "
            f"than version {newest.signed.version} it committed before ({archive_key(newest.signed.version)}, "
            "signed by its timestamp key)",
            hint=REPAIR_HINT,
        )
    if keys is not None and keys.ledger is not None:
        mine = _recorded(keys, store, origin)
        if mine is not None and mine.timestamp > version:
            raise VerificationFailed(
                f"the store {store.url} was rolled back: metadata/timestamp.json is version {version}, older "
                f"than version {mine.timestamp} this machine committed to it (at {mine.at}, recorded in "
                f"{_ledger_file(keys.ledger, store.url, origin)})",
                hint=REPAIR_HINT,
            )
    snapshot, targets = _committed_state(store, root, timestamp.signed.snapshot_meta.version)
    return State(root, targets, snapshot, timestamp, ts_blob.etag, origin)


def _must(store: Store, key: str) -> Blob:
    blob = store.get(key)
    if blob is None:
        raise VerificationFailed(
            f"the store lacks {key}, which its metadata names",
            hint="the store was damaged (files deleted); restore it from a backup",
        )
    return blob


def _check_online(root: Metadata, keys: Keys) -> None:
    keyid = keys.online.tuf_signer().public_key.keyid
    for role in ("targets", "snapshot", "timestamp"):
        if keyid not in root.signed.roles[role].keyids:
            raise ConfigError(
                f"the signing key {keys.online.key_id} may not sign {role} metadata in {root.signed.type} "
                f"of this store",
                hint="set SKUFORGE_SIGNING_KEY to the key the store was created with",
            )


# --- replay detection: the timestamp archive and the writer's ledger ---------------------------------


def archive_key(version: int) -> str:
    """Where timestamp ``version`` is archived: a countdown first, so the newest lists first."""
    return f"{ARCHIVE}/{_COUNTDOWN - version:012d}-{version}.json"


_ARCHIVED = re.compile(r"(\d{12})-(\d{1,12})\.json")


def _archived_version(key: str) -> int | None:
    m = _ARCHIVED.fullmatch(key.rsplit("/", 1)[-1])
    if m is None or int(m[1]) + int(m[2]) != _COUNTDOWN:
        return None
    return int(m[2])


def _newest_archived(store: Store, root: Metadata, keys: Iterator[str], above: int = 0) -> Metadata | None:
    """The newest archived timestamp above version ``above`` that verifies under ``root``, from
    ``keys`` (the archive's listing, newest first); None when there is none. An entry that does not
    verify (written by someone without the key) is skipped, a few of them at most."""
    skipped = 0
    for key in keys:
        version = _archived_version(key)
        if version is None:
            continue
        if version <= above:
            return None
        blob = store.get(key)
        try:
            md = _parse(blob.data if blob is not None else b"", key)
            if md.signed.type != "timestamp" or md.signed.version != version:
                raise VerificationFailed(f"{key} holds {md.signed.type} version {md.signed.version}")
            _verify(root, "timestamp", md, key)
        except VerificationFailed as exc:
            skipped += 1
            log.warning("ignoring %s in %s: %s", key, store.url, exc)
            if skipped >= MAX_UNVERIFIED:
                raise VerificationFailed(
                    f"the timestamp archive of {store.url} holds {skipped} entries that do not verify",
                    hint=f"someone without the signing key wrote under {ARCHIVE}/: delete what does not verify",
                ) from exc
            continue
        return md
    return None


@dataclass(frozen=True)
class Committed:
    """The versions a commit left in a store, as a writer's ledger records them."""

    timestamp: int
    snapshot: int
    targets: int
    at: str = ""


def _ledger_file(folder: Path, url: str, origin: str) -> Path:
    """One record per store: its url and its ``1.root.json`` (a store made again at the same url is
    another store, not a replay of this one)."""
    key = hashlib.sha256(f"{url}\n{origin}".encode()).hexdigest()[:32]
    return Path(folder) / f"{key}.json"


def _recorded(keys: Keys, store: Store, origin: str) -> Committed | None:
    if keys.ledger is None:
        return None
    path = _ledger_file(keys.ledger, store.url, origin)
    try:
        doc = json.loads(path.read_bytes())
        return Committed(int(doc["timestamp"]), int(doc["snapshot"]), int(doc["targets"]), str(doc.get("at", "")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged record protects nothing; say so
        log.warning("ignoring the unreadable record %s: %s", path, exc)
        return None


def _record(keys: Keys, store: Store, origin: str, done: Committed) -> None:
    if keys.ledger is None:
        return
    have = _recorded(keys, store, origin)
    if have is not None and have.timestamp >= done.timestamp:  # a concurrent writer on this machine got further
        return
    path = _ledger_file(keys.ledger, store.url, origin)
    doc = {
        "store": store.url,
        "root_sha256": origin,
        "timestamp": done.timestamp,
        "snapshot": done.snapshot,
        "targets": done.targets,
        "at": _now().isoformat(),
    }
    try:
        atomic_write_json(path, doc)
    except (SkuforgeError, OSError) as exc:  # the commit landed; only this machine's extra check is lost
        log.warning("could not record the commit to %s in %s: %s", store.url, path, exc)


def _landed(store: Store, keys: Keys, origin: str, ts_bytes: bytes, done: Committed) -> None:
    """What follows a successful swap of the timestamp: archive it, then record it on this machine.
    Neither may fail the commit (it landed); the next commit archives its own."""
    key = archive_key(done.timestamp)
    try:
        if not _put_new(store, key, ts_bytes):
            have = store.get(key)
            if have is None or have.data != ts_bytes:  # not ours, so not genuine: ours is
                store.put(key, ts_bytes)
    except SkuforgeError as exc:
        log.warning("could not archive timestamp v%d in %s: %s", done.timestamp, store.url, exc)
    _record(keys, store, origin, done)


@dataclass
class Repair:
    """What :func:`repair` found and did."""

    store: str
    replayed: bool
    found: int | None  # timestamp.json's version as found (None: missing or not verifying)
    newest: int  # the newest committed timestamp version known (archive, ledger, timestamp.json)
    timestamp: int  # timestamp.json's version now
    snapshot: int  # the snapshot it points at

    def to_json(self) -> dict:
        return dict(self.__dict__)


def repair(store: Store, keys: Keys, expiry: Expiry) -> Repair:
    """Undo a replay: sign a timestamp above every version seen (timestamp.json, the archive, this
    machine's ledger), pointing at the newest committed snapshot. Devices that trusted the newest
    version accept it; nothing committed is lost. A store that was not replayed is left as it is
    (its current timestamp archived if the archive lacks it)."""
    from tuf.api.metadata import Metadata, MetaFile, Timestamp

    for _ in range(MAX_ATTEMPTS):
        root, origin = _chain(store, keys)
        _check_online(root, keys)
        blob = store.get(TIMESTAMP_KEY)
        found: Metadata | None = None
        if blob is not None:
            try:
                found = _parse(blob.data, "timestamp.json")
                _verify(root, "timestamp", found, "timestamp.json")
            except VerificationFailed as exc:
                log.warning("timestamp.json of %s is unusable: %s", store.url, exc)
                found = None
        archived = _newest_archived(store, root, iter(store.list(ARCHIVE)))
        mine = _recorded(keys, store, origin)
        # (timestamp version, snapshot version) of each committed state known, newest first
        known = sorted(
            ((md.signed.version, md.signed.snapshot_meta.version) for md in (found, archived) if md is not None),
            reverse=True,
        )
        if mine is not None:
            known = sorted([*known, (mine.timestamp, mine.snapshot)], reverse=True)
        if not known:
            raise VerificationFailed(
                f"the store {store.url} holds no timestamp that verifies, archived or current, and this "
                "machine has no record of it",
                hint="restore metadata/timestamp.json from a backup",
            )
        newest = known[0][0]
        if found is not None and blob is not None and found.signed.version >= newest:
            version = found.signed.version
            sv, tv = _newest_whole(store, root, known[:1])
            if archived is None or archived.signed.version < version:  # a store older than the archive
                _landed(store, keys, origin, blob.data, Committed(version, sv, tv))
            return Repair(store.url, False, version, newest, version, sv)
        sv, tv = _newest_whole(store, root, known)
        ts = Timestamp(
            version=newest + 1,
            spec_version=SPEC_VERSION,
            expires=_expires(expiry.timestamp_days),
            snapshot_meta=MetaFile(version=sv),
        )
        data = _sign(Metadata(ts), [keys.online])
        try:
            if blob is None:
                store.put(TIMESTAMP_KEY, data, if_none_match=True)
            else:
                store.put(TIMESTAMP_KEY, data, if_match=blob.etag)
        except PreconditionFailed:
            continue
        _landed(store, keys, origin, data, Committed(newest + 1, sv, tv))
        log.debug(
            "repaired %s: timestamp.json was v%s, the newest committed v%d; signed v%d on snapshot v%d",
            store.url,
            found.signed.version if found is not None else "(none)",
            newest,
            newest + 1,
            sv,
        )
        return Repair(store.url, True, found.signed.version if found else None, newest, newest + 1, sv)
    raise ServiceError("could not repair the timestamp: other writers kept changing it", hint="run again")


def _newest_whole(store: Store, root: Metadata, known: list[tuple[int, int]]) -> tuple[int, int]:
    """The snapshot (and its targets' version) of the newest known commit whose files all verify."""
    for version, sv in known:
        try:
            snapshot, targets = _committed_state(store, root, sv)
        except VerificationFailed as exc:
            log.warning("timestamp v%d's snapshot v%d is not usable: %s", version, sv, exc)
            continue
        return snapshot.signed.version, targets.signed.version
    raise VerificationFailed(
        f"no committed snapshot of {store.url} verifies (tried {', '.join(f'v{sv}' for _, sv in known)})",
        hint="restore the store's metadata/ from a backup",
    )


# --- committing -------------------------------------------------------------------------------------


def _write_versioned(store: Store, role: str, start: int, make: Callable[[int], bytes]) -> int:
    """Write ``<v>.<role>.json`` at the first free version from ``start`` (an orphan of a writer that
    lost a race or crashed occupies its number for good: it is never overwritten)."""
    for version in range(start, start + MAX_ATTEMPTS):
        if _put_new(store, f"{METADATA}/{version}.{role}.json", make(version)):
            return version
    raise ServiceError(
        f"could not find a free {role} version after {MAX_ATTEMPTS} tries",
        hint="another writer keeps winning; run again later",
    )


def _signed_at(md: Metadata, key: SigningKey) -> Callable[[int], bytes]:
    """``make`` for _write_versioned: ``md`` at version ``v``, signed with ``key``."""

    def make(v: int) -> bytes:
        md.signed.version = v
        return _sign(md, [key])

    return make


def commit(
    store: Store, keys: Keys, expiry: Expiry, change: Callable[[Targets, State], bool], what: str = "update"
) -> State | None:
    """Apply ``change`` (which edits the targets in place; False: nothing to do) and publish the
    result atomically. Retries from a fresh read when another writer commits first. Returns the
    state written, or None when ``change`` had nothing to do."""
    from tuf.api.metadata import MetaFile

    store.clean_stale()  # what writers killed mid-write left in a local store
    for attempt in range(MAX_ATTEMPTS):
        state = read_state(store, keys)
        _check_online(state.root, keys)
        targets = state.targets.signed
        if not change(targets, state):
            return None
        old_tv = targets.version
        targets.expires = _expires(expiry.targets_days)
        tv = _write_versioned(store, "targets", old_tv + 1, _signed_at(state.targets, keys.online))
        snap = state.snapshot.signed
        snap.meta["targets.json"] = MetaFile(version=tv)
        snap.expires = _expires(expiry.snapshot_days)
        sv = _write_versioned(store, "snapshot", snap.version + 1, _signed_at(state.snapshot, keys.online))
        ts = state.timestamp.signed
        ts.version += 1
        ts.snapshot_meta = MetaFile(version=sv)
        ts.expires = _expires(expiry.timestamp_days)
        ts_bytes = _sign(state.timestamp, [keys.online])
        if _swap_timestamp(store, ts_bytes, state.etag):
            _landed(store, keys, state.origin, ts_bytes, Committed(ts.version, sv, tv))
            log.info("%s: targets v%d, snapshot v%d, timestamp v%d", what, tv, sv, ts.version)
            return state
        log.info("%s: another writer committed first (attempt %d); reading again", what, attempt + 1)
    raise ServiceError(
        f"{what}: lost the race for the store's timestamp {MAX_ATTEMPTS} times",
        hint="too many concurrent writers; run again",
    )


def _swap_timestamp(store: Store, data: bytes, etag: str) -> bool:
    try:
        store.put(TIMESTAMP_KEY, data, if_match=etag)
        return True
    except PreconditionFailed:
        # the answer to our own write may have been lost and the retry refused: then it is ours
        now = store.get(TIMESTAMP_KEY)
        return now is not None and now.data == data


def _past_half_life(md: Metadata, days: float) -> bool:
    return md.signed.expires - _now() <= timedelta(days=days) / 2


def refresh_timestamp(store: Store, keys: Keys, expiry: Expiry, force: bool = False) -> bool:
    """Re-sign the timestamp when less than half its lifetime is left, or it expired already
    (devices refuse an expired one); targets and snapshot too when they are past half their own
    lifetime (a new commit of the same targets). True when something was re-signed."""
    for _ in range(MAX_ATTEMPTS):
        state = read_state(store, keys)
        _check_online(state.root, keys)
        if _past_half_life(state.targets, expiry.targets_days) or _past_half_life(state.snapshot, expiry.snapshot_days):
            return commit(store, keys, expiry, lambda targets, state: True, what="re-sign targets") is not None
        ts = state.timestamp.signed
        if not force and not _past_half_life(state.timestamp, expiry.timestamp_days):
            return False
        ts.version += 1
        ts.expires = _expires(expiry.timestamp_days)
        data = _sign(state.timestamp, [keys.online])
        if _swap_timestamp(store, data, state.etag):
            done = Committed(ts.version, ts.snapshot_meta.version, state.targets.signed.version)
            _landed(store, keys, state.origin, data, done)
            log.info("re-signed the timestamp of %s: v%d, expires %s", store.url, ts.version, ts.expires.isoformat())
            return True
    raise ServiceError("could not re-sign the timestamp: other writers kept committing", hint="run again")


def add_target(targets: Targets, path: str, data: bytes, custom: dict | None = None) -> None:
    from tuf.api.metadata import TargetFile

    info = TargetFile.from_data(path, data, ["sha256"])
    if custom:
        info.unrecognized_fields["custom"] = custom
    targets.targets[path] = info


def _serialised(md: Metadata) -> bytes:
    from tuf.api.serialization.json import JSONSerializer

    return md.to_bytes(JSONSerializer(compact=False))


def root_bytes(store: Store, keys: Keys | None = None) -> bytes:
    """The current root, for provisioning devices (their trust anchor); with ``keys``, only from a
    chain this writer can vouch for."""
    return _serialised(_latest_root(store, keys))


def read_target(store: Store, state: State, path: str) -> bytes | None:
    """A target's bytes as a writer reads them: hash checked against the targets metadata."""
    info = state.targets.signed.targets.get(path)
    if info is None:
        return None
    blob = _must(store, blob_key(info.hashes["sha256"]))
    try:
        info.verify_length_and_hashes(blob.data)
    except Exception as exc:
        raise VerificationFailed(
            f"{path} in the store does not match its signed hash",
            hint="the blob was damaged; publish the release again",
        ) from exc
    return blob.data


# --- the project's pins: one trusted root per store -------------------------------------------------


def store_label(url: str, project: Path) -> str:
    """The store as the project names it, the same on every machine: ``s3://bucket/prefix``, or a
    folder relative to the project (an absolute path inside the project is made relative; one
    outside it stays as given)."""
    if "://" in url:
        return url.rstrip("/")
    path = Path(url)
    if path.is_absolute():
        try:
            return path.resolve().relative_to(Path(project).resolve()).as_posix()
        except ValueError:
            return os.path.normpath(path)
    return Path(os.path.normpath(path)).as_posix()


def pin_path(project: Path, url: str) -> Path:
    """``release-roots/<slug>-<hash>.json`` beside params.yaml: the root this project pinned for
    the store at ``url`` (the hash of the label keeps two labels that slug alike apart)."""
    label = store_label(url, project)
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:60] or "store"
    return Path(project) / PINS / f"{slug}-{hashlib.sha256(label.encode()).hexdigest()[:8]}.json"


def read_pin(project: Path, url: str, store: Store) -> bytes | None:
    """The root pinned for the store at ``url``: its own pin, else the single ``release-root.json``
    of earlier versions when the store's chain holds that root (it was made for this store);
    None when the project pins nothing for it."""
    path = pin_path(project, url)
    if path.is_file():
        return path.read_bytes()
    legacy = Path(project) / LEGACY_PIN
    if not legacy.is_file():
        return None
    data = legacy.read_bytes()
    pinned = _parse(data, LEGACY_PIN)
    link = store.get(f"{METADATA}/{pinned.signed.version}.root.json")
    if link is not None and _parse(link.data, "pinned root").signed_bytes == pinned.signed_bytes:
        return data
    log.warning(
        "%s pins another store than %s; this store's pin would be %s (`skuforge release init` writes it)",
        LEGACY_PIN,
        store.url,
        path.relative_to(project),
    )
    return None


# --- the client (device side) ---------------------------------------------------------------------


def _fetcher_class():
    from tuf.api.exceptions import DownloadHTTPError
    from tuf.ngclient import FetcherInterface

    class StoreFetcher(FetcherInterface):
        """Serves ngclient's URLs from a Store: ``store:/metadata/<name>`` and
        ``store:/targets/<dir>/<sha256>.<name>`` (content-addressed blob)."""

        def __init__(self, store: Store):
            self.store = store

        def _fetch(self, url: str) -> Iterator[bytes]:
            rest = url.removeprefix("store:/")
            if rest.startswith("metadata/"):
                key = rest
            elif rest.startswith("targets/"):
                digest = rest.rsplit("/", 1)[-1].split(".", 1)[0]
                key = blob_key(digest)
            else:
                raise DownloadHTTPError(f"not a store URL: {url}", 404)
            blob = self.store.get(key)
            if blob is None:
                raise DownloadHTTPError(f"{key} not found", 404)
            return iter([blob.data])

    return StoreFetcher


class Client:
    """A device's view of the store: TUF-verified metadata kept under ``state_dir`` (so a replayed
    older state is refused), and verified target downloads."""

    def __init__(self, store: Store, state_dir: str | os.PathLike, root: bytes | None = None):
        from tuf.ngclient import Updater

        self.dir = Path(state_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unwritable(exc) from exc
        have_root = (self.dir / "root.json").is_file()
        if not have_root and root is None:
            raise ConfigError(
                f"no trusted root in {self.dir}",
                hint="provision the device with the store's root (`skuforge release root --out root.json`)",
            )
        try:
            self.updater = Updater(
                metadata_dir=str(self.dir),
                metadata_base_url="store:/metadata/",
                target_base_url="store:/targets/",
                fetcher=_fetcher_class()(store),
                bootstrap=None if have_root else root,
            )
        except OSError as exc:  # persisting the bootstrap root: the folder, not the root, is at fault
            raise self._unwritable(exc) from exc
        except Exception as exc:
            raise VerificationFailed(
                f"the trusted root is unusable: {exc}", hint="provision the device again with the store's root"
            ) from exc
        self._fresh = False

    def _unwritable(self, exc: OSError) -> StorageError:
        """The agent's folder refused a write: a storage problem on the device, not a trust failure."""
        return StorageError(
            f"cannot keep the trusted release metadata in {self.dir}: {exc.strerror or exc}"
            + (f" ({exc.filename})" if exc.filename else ""),
            hint=f"make {self.dir} writable by the agent (permissions, a read-only mount, free space); "
            "nothing was installed",
            path=str(self.dir),
        )

    def refresh(self) -> None:
        """Fetch and verify the newest metadata. Raises VerificationFailed (bad signature, expired,
        replayed older version) or ServiceError (store unreachable)."""
        from tuf.api import exceptions as tex

        try:
            self.updater.refresh()
        except OSError as exc:  # ngclient persists what it verified: the folder refused it
            raise self._unwritable(exc) from exc
        except tex.DownloadError as exc:
            cause = exc.__cause__
            if isinstance(cause, ServiceError):  # the store's own error, as it raised it
                raise cause from cause.__cause__
            raise ServiceError(
                f"could not fetch release metadata: {exc}", hint="check the store and the network"
            ) from exc
        except tex.RepositoryError as exc:
            raise VerificationFailed(
                f"release metadata refused: {type(exc).__name__}: {exc}",
                hint="the store serves metadata this device must not trust; nothing was installed",
            ) from exc
        self._fresh = True

    def fetch(self, path: str) -> bytes | None:
        """A target's verified bytes, or None when the signed targets do not list it."""
        from tuf.api import exceptions as tex

        if not self._fresh:
            self.refresh()
        info = self.updater.get_targetinfo(path)
        if info is None:
            return None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".download.")
        except OSError as exc:
            raise self._unwritable(exc) from exc
        os.close(fd)
        try:
            self.updater.download_target(info, filepath=tmp)
            return Path(tmp).read_bytes()
        except OSError as exc:
            raise self._unwritable(exc) from exc
        except tex.DownloadError as exc:
            cause = exc.__cause__
            if isinstance(cause, ServiceError):  # the store's own error, as it raised it
                raise cause from cause.__cause__
            raise VerificationFailed(
                f"{path}: download failed verification or transfer: {exc}",
                hint="the store holds a damaged or missing file",
            ) from exc
        except tex.RepositoryError as exc:
            raise VerificationFailed(
                f"{path} does not match its signed hash or length ({type(exc).__name__})",
                hint="the store holds a damaged or tampered file; nothing was installed",
            ) from exc
        finally:
            Path(tmp).unlink(missing_ok=True)

    def custom(self, path: str) -> dict | None:
        info = self.updater.get_targetinfo(path)
        return None if info is None else info.unrecognized_fields.get("custom")

    def trusted_timestamp_version(self) -> int | None:
        """The timestamp version this device trusts (after ``refresh``; None before), signed into its
        reports so the controller sees which store state a device acted on. ngclient (7.x) has no
        public accessor, so its trusted set is read; None if a later ngclient moves it."""
        try:
            return int(self.updater._trusted_set.timestamp.version)
        except (AttributeError, KeyError):
            return None
