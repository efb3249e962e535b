"""Signed release metadata: a TUF repository kept in the release store, the writer's side (devices:
pipeline/rollout/client.py; recovery from a replay: pipeline/rollout/recovery.py).

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

A store writer without the keys can put back an older, validly signed ``timestamp.json`` (a
replay: an aborted rollout looks active again). Each swap archives the timestamp it committed under
a key never overwritten (``metadata/timestamps/<countdown>-<v>.json``, newest listed first), and
:func:`read_state` refuses a ``timestamp.json`` older than the newest archived one. Each timestamp
signs the version and sha256 of the one it follows, so history is a chain: a writer records on its
machine (``Keys.ledger``) the newest timestamp it committed or verified, by version and digest, and
refuses a store whose timestamp does not follow it (older: replayed; elsewhere: forked); a writer
with no record requires the archive to hold the timestamp it builds on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.core.errors import ConfigError, GateFailed, InputError, ServiceError, SkuforgeError
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
MAX_WALK = 256  # archived timestamps a walk along the links reads before it trusts the rest
PINS = "release-roots"  # beside params.yaml: one pinned root per store
LEGACY_PIN = "release-root.json"  # the single pin of earlier versions, read for the store it was made for
PREVIOUS = "previous"  # signed into each timestamp: the version and sha256 of the timestamp it follows
REPAIRED = "repaired"  # signed into a timestamp `release repair` made: the key holder vouches for its state
REPAIR_HINT = (
    "nothing was written. If you did not restore the store on purpose, someone with write access "
    "to it put back older metadata: check who. Then run `skuforge release repair` with the signing "
    "key: it signs a timestamp above every version seen, on the newest committed state"
)
FORK_HINT = (
    "nothing was written. Someone put back older metadata and a writer that could not tell signed on "
    "top of it. Run `skuforge release repair` with the signing key, on this machine: it commits the "
    "state this machine recorded again, above every version (devices accept it), and names the "
    "versions it drops; then redo what those did (a publish, a rollout move)"
)
UNPROVEN_HINT = (
    "nothing was written. Its archive was deleted, or the store predates it. Run `skuforge release repair` "
    "on the machine that last committed to this store: its record ($SKUFORGE_CACHE_DIR/release-stores/) "
    "restores the newest state. From a machine with no record, repair takes this version as the newest: "
    "do that only if you know nothing newer was committed (device reports name the timestamp each "
    "device trusts: `trusted_timestamp`)"
)

Init = Literal["created", "completed", "existing"]


class VerificationFailed(GateFailed):
    """Signed metadata or a file did not verify (bad signature, expired, replayed, wrong hash)."""


class Replayed(VerificationFailed):
    """The store serves a timestamp older than one committed before: it was put back."""


class Forked(VerificationFailed):
    """The store's timestamp does not follow the one a writer recorded or a device trusts: two states
    were signed on one history (a writer built on a store put back to an older state)."""


class Unproven(VerificationFailed):
    """The store cannot show that its timestamp follows the newest one known: archived timestamps
    the links run through are missing."""


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
    timestamp_data: bytes = b""  # the signed timestamp.json as read: what the next timestamp links to
    snapshot_sha256: str = ""

    @property
    def link(self) -> Link:
        """The timestamp read, by version and digest: what the next one signs as its ``previous``."""
        return Link(self.timestamp.signed.version, sha256_hex(self.timestamp_data))


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
        _landed(store, keys, root, origin, ts_bytes, Committed(1, 1, 1))
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


def _verify(root: Metadata, role: str, md: Metadata, what: str) -> None:
    from tuf.api.exceptions import UnsignedMetadataError

    try:
        root.signed.verify_delegate(role, md.signed_bytes, md.signatures)
    except UnsignedMetadataError as exc:
        raise VerificationFailed(
            f"the store's {what} is not signed by the {role} keys its root names: {exc}",
            hint="someone wrote to the store without the signing key; restore it",
        ) from exc


def _committed_state(store: Store, root: Metadata, sv: int) -> tuple[Metadata, Metadata, str]:
    """Snapshot ``sv`` and the targets it names, verified, each the version its parent says; and the
    sha256 of the snapshot file."""
    blob = _must(store, f"{METADATA}/{sv}.snapshot.json")
    snapshot = _parse(blob.data, f"{sv}.snapshot.json")
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
    return snapshot, targets, sha256_hex(blob.data)


def read_state(store: Store, keys: Keys | None = None) -> State:
    """The current metadata, each verified against the root's keys (a writer, with ``keys``, never
    builds on metadata it could not have signed itself). Refuses a replayed store (:class:`Replayed`):
    a ``timestamp.json`` older than the newest archived timestamp, or (a writer with a ledger) than
    the one this machine recorded. A writer also refuses a timestamp that does not follow its record
    (:class:`Forked`, :class:`Unproven`) or, with no record, one the archive does not vouch for; then
    it records the state it verified."""
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
        raise Replayed(
            f"the store {store.url} was rolled back: metadata/timestamp.json is version {version}, older "
            f"than version {newest[0].signed.version} it committed before "
            f"({archive_key(newest[0].signed.version)}, signed by its timestamp key)",
            hint=REPAIR_HINT,
        )
    if keys is not None:
        _prove(store, keys, root, origin, timestamp, ts_blob.data)
    snapshot, targets, snapshot_sha = _committed_state(store, root, timestamp.signed.snapshot_meta.version)
    state = State(root, targets, snapshot, timestamp, ts_blob.etag, origin, ts_blob.data, snapshot_sha)
    if keys is not None:
        _record(keys, store, origin, _committed(state))
    return state


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


# --- replay detection: the timestamp archive, the links and the writer's ledger ----------------------


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Link:
    """A timestamp by version and the sha256 of its signed file."""

    version: int
    sha256: str


def link_of(md: Metadata) -> Link | None:
    """The timestamp ``md`` signs that it follows (None: version 1, or signed before links were)."""
    raw = md.signed.unrecognized_fields.get(PREVIOUS)
    try:
        return Link(int(raw["version"]), str(raw["sha256"]))
    except (TypeError, KeyError, ValueError):
        return None


def repaired(md: Metadata) -> bool:
    """Whether ``release repair`` signed ``md``: it follows the state the key holder chose to keep."""
    return md.signed.unrecognized_fields.get(REPAIRED) is True


def _follow(ts: Any, previous: Link | None, repair: bool = False) -> None:
    """Sign into timestamp ``ts`` the one it follows (and, from repair, that it is a repair)."""
    for name in (PREVIOUS, REPAIRED):
        ts.unrecognized_fields.pop(name, None)
    if previous is not None:
        ts.unrecognized_fields[PREVIOUS] = {"version": previous.version, "sha256": previous.sha256}
    if repair:
        ts.unrecognized_fields[REPAIRED] = True


def archive_key(version: int) -> str:
    """Where timestamp ``version`` is archived: a countdown first, so the newest lists first."""
    return f"{ARCHIVE}/{_COUNTDOWN - version:012d}-{version}.json"


_ARCHIVED = re.compile(r"(\d{12})-(\d{1,12})\.json")


def _archived_version(key: str) -> int | None:
    m = _ARCHIVED.fullmatch(key.rsplit("/", 1)[-1])
    if m is None or int(m[1]) + int(m[2]) != _COUNTDOWN:
        return None
    return int(m[2])


def _archived(root: Metadata, key: str, version: int, data: bytes) -> Metadata | None:
    """The archived timestamp ``version`` in ``data`` when it verifies under ``root``; else None (an
    entry written without the key, logged)."""
    try:
        md = _parse(data, key)
        if md.signed.type != "timestamp" or md.signed.version != version:
            raise VerificationFailed(f"{key} holds {md.signed.type} version {md.signed.version}")
        _verify(root, "timestamp", md, key)
    except VerificationFailed as exc:
        log.warning("ignoring %s: %s", key, exc)
        return None
    return md


def _newest_archived(
    store: Store, root: Metadata, keys: Iterator[str], above: int = 0
) -> tuple[Metadata, bytes] | None:
    """The newest archived timestamp above version ``above`` that verifies under ``root``, and its
    bytes, from ``keys`` (the archive's listing, newest first); None when there is none. An entry that
    does not verify (written by someone without the key) is skipped, a few of them at most."""
    skipped = 0
    for key in keys:
        version = _archived_version(key)
        if version is None:
            continue
        if version <= above:
            return None
        blob = store.get(key)
        md = _archived(root, key, version, blob.data if blob is not None else b"")
        if md is not None and blob is not None:
            return md, blob.data
        skipped += 1
        if skipped >= MAX_UNVERIFIED:
            raise VerificationFailed(
                f"the timestamp archive of {store.url} holds {skipped} entries that do not verify",
                hint=f"someone without the signing key wrote under {ARCHIVE}/: delete what does not verify",
            )
    return None


@dataclass(frozen=True)
class Break:
    """Where a walk along the links failed to reach the timestamp it looked for."""

    forked: bool  # a different signed timestamp stands where a link leads (else: an archived link is missing)
    detail: str


def walk(store: Store, root: Metadata, newer: Metadata, older: Link) -> Break | None:
    """Whether timestamp ``newer`` follows ``older``: its link, then each link's archived timestamp
    (verified under ``root``) back to ``older``'s version, must hash to what the next one names: one
    GET per version in between, ``MAX_WALK`` at most. A timestamp ``release repair`` signed ends the
    walk (the key holder vouched for the state it keeps), as does one signed before links were. None
    when it follows."""
    cur = newer
    for _ in range(MAX_WALK):
        link = None if repaired(cur) else link_of(cur)
        if link is None:
            return None
        if link.version <= older.version:
            if link == older:
                return None
            return Break(
                True,
                f"version {cur.signed.version} follows a version {link.version} of sha256 {link.sha256[:12]}, "
                f"not the one of sha256 {older.sha256[:12]}",
            )
        key = archive_key(link.version)
        blob = store.get(key)
        md = _archived(root, key, link.version, blob.data) if blob is not None else None
        if blob is None or md is None:
            return Break(False, f"{key}, which version {cur.signed.version} follows, is missing or does not verify")
        if sha256_hex(blob.data) != link.sha256:
            return Break(
                True,
                f"{key} (sha256 {sha256_hex(blob.data)[:12]}) is not the version {link.version} that version "
                f"{cur.signed.version} follows (sha256 {link.sha256[:12]})",
            )
        cur = md
    log.warning("%s: stopped following links after %d archived timestamps", store.url, MAX_WALK)
    return None


def _prove(store: Store, keys: Keys, root: Metadata, origin: str, ts: Metadata, data: bytes) -> None:
    """A writer's check that ``timestamp.json`` (``ts``, signed bytes ``data``) is the newest state:
    it follows this machine's record; with no record, the archive holds it (or, when a commit stopped
    before archiving, the version it follows: then it is archived now)."""
    version, here = ts.signed.version, sha256_hex(data)
    mine = _recorded(keys, store, origin)
    if mine is not None:
        where = f"at {mine.at}, recorded in {_ledger_file(keys.ledger, store.url, origin)}" if keys.ledger else ""
        if mine.timestamp > version:
            raise Replayed(
                f"the store {store.url} was rolled back: metadata/timestamp.json is version {version}, older "
                f"than version {mine.timestamp} this machine committed or verified ({where})",
                hint=REPAIR_HINT,
            )
        if not mine.timestamp_sha256:  # a record of an earlier skuforge: versions only
            return
        if version == mine.timestamp:
            broken = None if here == mine.timestamp_sha256 else Break(True, f"the store's is sha256 {here[:12]}")
        else:
            broken = walk(store, root, ts, Link(mine.timestamp, mine.timestamp_sha256))
        if broken is not None:
            raise (Forked if broken.forked else Unproven)(
                f"the store {store.url} {'was forked' if broken.forked else 'cannot prove its history'}: "
                f"metadata/timestamp.json (version {version}) does not follow version {mine.timestamp} "
                f"(sha256 {mine.timestamp_sha256[:12]}) that this machine committed or verified ({where}): "
                f"{broken.detail}",
                hint=FORK_HINT,
            )
        return
    key = archive_key(version)
    blob = store.get(key)
    if blob is not None and blob.data == data:
        return
    if blob is not None and _archived(root, key, version, blob.data) is not None:
        raise Forked(
            f"the store {store.url} was forked: metadata/timestamp.json (version {version}, sha256 {here[:12]}) "
            f"is not the version {version} its archive holds ({key}, sha256 {sha256_hex(blob.data)[:12]})",
            hint="nothing was written. Someone put back older metadata and a writer that could not tell "
            "signed on top of it. Run `skuforge release repair` with the signing key: it keeps the "
            "archived version (committed first), commits it again above every version, and names the "
            "version it drops; then redo what that did",
        )
    link = link_of(ts)
    prev = store.get(pkey := archive_key(link.version)) if link is not None else None
    if link and prev and sha256_hex(prev.data) == link.sha256 and _archived(root, pkey, link.version, prev.data):
        _put_new(store, key, data)  # a commit that stopped between its swap and its archive
        return
    raise Unproven(
        f"the store {store.url} cannot prove that metadata/timestamp.json (version {version}) is its newest "
        f"state: its archive ({ARCHIVE}/) holds neither it nor the version it follows, and this machine "
        "has no record of the store",
        hint=UNPROVEN_HINT,
    )


@dataclass(frozen=True)
class Committed:
    """A committed state, as a writer's ledger records it: versions, and digests of the signed files."""

    timestamp: int
    snapshot: int
    targets: int
    at: str = ""
    timestamp_sha256: str = ""
    snapshot_sha256: str = ""


def _committed(state: State) -> Committed:
    ts = state.timestamp.signed
    return Committed(
        ts.version,
        ts.snapshot_meta.version,
        state.targets.signed.version,
        timestamp_sha256=sha256_hex(state.timestamp_data),
        snapshot_sha256=state.snapshot_sha256,
    )


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
        return Committed(
            int(doc["timestamp"]),
            int(doc["snapshot"]),
            int(doc["targets"]),
            str(doc.get("at", "")),
            str(doc.get("timestamp_sha256", "")),
            str(doc.get("snapshot_sha256", "")),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged record protects nothing; say so
        log.warning("ignoring the unreadable record %s: %s", path, exc)
        return None


def _record(keys: Keys, store: Store, origin: str, done: Committed) -> None:
    """Record ``done`` as the newest state this machine committed or verified in ``store``."""
    if keys.ledger is None:
        return
    have = _recorded(keys, store, origin)
    if have is not None and (have.timestamp > done.timestamp or have == replace(done, at=have.at)):
        return  # a concurrent writer on this machine got further, or nothing changed
    path = _ledger_file(keys.ledger, store.url, origin)
    doc = {"store": store.url, "root_sha256": origin, **asdict(replace(done, at=_now().isoformat()))}
    try:
        atomic_write_json(path, doc)
    except (SkuforgeError, OSError) as exc:  # the commit landed; only this machine's extra check is lost
        log.warning("could not record the commit to %s in %s: %s", store.url, path, exc)


def _landed(
    store: Store, keys: Keys, root: Metadata, origin: str, ts_bytes: bytes, done: Committed, base: bytes = b""
) -> None:
    """What follows a successful swap of the timestamp: archive it (and ``base``, the one it follows,
    if a commit that stopped early left that out), then record it on this machine. Neither may fail
    the commit (it landed); the next commit archives its own."""
    key = archive_key(done.timestamp)
    try:
        if not _put_new(store, key, ts_bytes):
            have = store.get(key)
            if have is None or _archived(root, key, done.timestamp, have.data) is None:
                store.put(key, ts_bytes)  # what is there does not verify: not genuine, ours is
            elif have.data != ts_bytes:
                log.error("%s already holds another signed version %d: the store was forked", key, done.timestamp)
        if base:
            _put_new(store, archive_key(_parse(base, "timestamp.json").signed.version), base)
    except SkuforgeError as exc:
        log.warning("could not archive timestamp v%d in %s: %s", done.timestamp, store.url, exc)
    _record(keys, store, origin, replace(done, timestamp_sha256=sha256_hex(ts_bytes)))


# --- committing -------------------------------------------------------------------------------------


def _write_versioned(store: Store, role: str, start: int, make: Callable[[int], bytes]) -> tuple[int, bytes]:
    """Write ``<v>.<role>.json`` at the first free version from ``start`` (an orphan of a writer that
    lost a race or crashed occupies its number for good: it is never overwritten); the version and
    the bytes written."""
    for version in range(start, start + MAX_ATTEMPTS):
        data = make(version)
        if _put_new(store, f"{METADATA}/{version}.{role}.json", data):
            return version, data
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
        base = state.link
        old_tv = targets.version
        targets.expires = _expires(expiry.targets_days)
        tv, _ = _write_versioned(store, "targets", old_tv + 1, _signed_at(state.targets, keys.online))
        snap = state.snapshot.signed
        snap.meta["targets.json"] = MetaFile(version=tv)
        snap.expires = _expires(expiry.snapshot_days)
        sv, snap_data = _write_versioned(store, "snapshot", snap.version + 1, _signed_at(state.snapshot, keys.online))
        ts = state.timestamp.signed
        ts.version += 1
        ts.snapshot_meta = MetaFile(version=sv)
        ts.expires = _expires(expiry.timestamp_days)
        _follow(ts, base)
        ts_bytes = _sign(state.timestamp, [keys.online])
        if _swap_timestamp(store, ts_bytes, state.etag):
            done = Committed(ts.version, sv, tv, snapshot_sha256=sha256_hex(snap_data))
            _landed(store, keys, state.root, state.origin, ts_bytes, done, state.timestamp_data)
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
        base = state.link
        ts.version += 1
        ts.expires = _expires(expiry.timestamp_days)
        _follow(ts, base)
        data = _sign(state.timestamp, [keys.online])
        if _swap_timestamp(store, data, state.etag):
            done = replace(_committed(state), timestamp=ts.version)
            _landed(store, keys, state.root, state.origin, data, done, state.timestamp_data)
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
    return _serialised(_chain(store, keys)[0])


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
