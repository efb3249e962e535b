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
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.errors import ConfigError, GateFailed, InputError, ServiceError
from pipeline.rollout.store import PreconditionFailed, Store

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

    @classmethod
    def single(cls, key: SigningKey, anchor: bytes | None = None) -> Keys:
        return cls(root=[key], online=key, anchor=anchor)


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
    import hashlib

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


def initialise(store: Store, keys: Keys, expiry: Expiry) -> bool:
    """Create root, empty targets, snapshot and timestamp; False (nothing written) when the store
    already has a repository."""
    from tuf.api.metadata import Metadata, MetaFile, Role, Root, Snapshot, Targets, Timestamp

    if store.exists(f"{METADATA}/1.root.json"):
        return False
    root = Root(version=1, spec_version=SPEC_VERSION, expires=_expires(expiry.root_days), consistent_snapshot=True)
    for key in keys.root:
        root.add_key(key.tuf_signer().public_key, "root")
    root.roles["root"] = Role([k.tuf_signer().public_key.keyid for k in keys.root], keys.root_threshold)
    for role in ("targets", "snapshot", "timestamp"):
        root.add_key(keys.online.tuf_signer().public_key, role)
    root_bytes = _sign(Metadata(root), keys.root)
    targets = Targets(version=1, spec_version=SPEC_VERSION, expires=_expires(expiry.targets_days))
    targets_bytes = _sign(Metadata(targets), [keys.online])
    snapshot = Snapshot(
        version=1,
        spec_version=SPEC_VERSION,
        expires=_expires(expiry.snapshot_days),
        meta={"targets.json": MetaFile(version=1)},
    )
    snapshot_bytes = _sign(Metadata(snapshot), [keys.online])
    timestamp = Timestamp(
        version=1, spec_version=SPEC_VERSION, expires=_expires(expiry.timestamp_days), snapshot_meta=MetaFile(version=1)
    )
    if not _put_new(store, f"{METADATA}/1.root.json", root_bytes):
        return False
    store.put(f"{METADATA}/root.json", root_bytes)
    _put_new(store, f"{METADATA}/1.targets.json", targets_bytes)
    _put_new(store, f"{METADATA}/1.snapshot.json", snapshot_bytes)
    _put_new(store, TIMESTAMP_KEY, _sign(Metadata(timestamp), [keys.online]))
    return True


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


def _latest_root(store: Store, keys: Keys | None = None) -> Metadata:
    """The newest root, reached along the versioned chain from ``1.root.json`` as a device walks it:
    each version signed by its own root keys and by the previous version's. A writer (``keys``)
    also anchors the chain: the project's pinned root (``keys.anchor``) must be a link of it, or,
    with none pinned, one of its own keys must be a root key of version 1; otherwise a store writer
    could hand it a forged root listing the writer's public key and have it sign their targets."""
    first = store.get(f"{METADATA}/1.root.json")
    if first is None:
        raise InputError(
            f"the store {store.url} has no signed root", hint="run `skuforge release init` once to create it"
        )
    root = _parse(first.data, "1.root.json")
    _root_signed(root, root, "1.root.json")
    anchor = _parse(keys.anchor, "pinned root") if keys is not None and keys.anchor else None
    if keys is not None and anchor is None:
        ours = {k.tuf_signer().public_key.keyid for k in keys.root}
        if not ours & set(root.signed.roles["root"].keyids):
            raise VerificationFailed(
                f"the root of {store.url} is not one this project created: none of its root keys is the signing key",
                hint="commit the release-root.json that `skuforge release init` wrote when it "
                "created this store (a copy of its genuine metadata/1.root.json, from a source "
                "you trust, not from the store)",
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
    return root


def read_state(store: Store, keys: Keys | None = None) -> State:
    """The current metadata, each verified against the root's keys (a writer, with ``keys``, never
    builds on metadata it could not have signed itself)."""
    from tuf.api.exceptions import UnsignedMetadataError

    root = _latest_root(store, keys)
    ts_blob = store.get(TIMESTAMP_KEY)
    if ts_blob is None:
        raise InputError(f"the store {store.url} has no timestamp.json", hint="run `skuforge release init`")
    timestamp = _parse(ts_blob.data, "timestamp.json")
    sv = timestamp.signed.snapshot_meta.version
    snapshot = _parse(_must(store, f"{METADATA}/{sv}.snapshot.json").data, f"{sv}.snapshot.json")
    tv = snapshot.signed.meta["targets.json"].version
    targets = _parse(_must(store, f"{METADATA}/{tv}.targets.json").data, f"{tv}.targets.json")
    for role, md in (("timestamp", timestamp), ("snapshot", snapshot), ("targets", targets)):
        try:
            root.signed.verify_delegate(role, md.signed_bytes, md.signatures)
        except UnsignedMetadataError as exc:
            raise VerificationFailed(
                f"the store's {role} metadata is not signed by the keys its root names: {exc}",
                hint="someone wrote to the store without the signing key; restore it",
            ) from exc
    return State(root, targets, snapshot, timestamp, ts_blob.etag)


def _must(store: Store, key: str):
    blob = store.get(key)
    if blob is None:
        raise VerificationFailed(
            f"the store lacks {key}, which its metadata names",
            hint="the store was damaged (files deleted); restore it from a backup",
        )
    return blob


def _check_online(state: State, keys: Keys) -> None:
    keyid = keys.online.tuf_signer().public_key.keyid
    for role in ("targets", "snapshot", "timestamp"):
        if keyid not in state.root.signed.roles[role].keyids:
            raise ConfigError(
                f"the signing key {keys.online.key_id} may not sign {role} metadata in {state.root.signed.type} "
                f"of this store",
                hint="set SKUFORGE_SIGNING_KEY to the key the store was created with",
            )


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

    for attempt in range(MAX_ATTEMPTS):
        state = read_state(store, keys)
        _check_online(state, keys)
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


def refresh_timestamp(store: Store, keys: Keys, expiry: Expiry, force: bool = False) -> bool:
    """Re-sign the timestamp when less than half its lifetime is left (devices refuse an expired
    one). True when it was re-signed."""
    for _ in range(MAX_ATTEMPTS):
        state = read_state(store, keys)
        _check_online(state, keys)
        ts = state.timestamp.signed
        left = ts.expires - _now()
        if not force and left > timedelta(days=expiry.timestamp_days) / 2:
            return False
        ts.version += 1
        ts.expires = _expires(expiry.timestamp_days)
        if _swap_timestamp(store, _sign(state.timestamp, [keys.online]), state.etag):
            return True
    raise ServiceError("could not re-sign the timestamp: other writers kept committing", hint="run again")


def add_target(targets: Targets, path: str, data: bytes, custom: dict | None = None) -> None:
    from tuf.api.metadata import TargetFile

    info = TargetFile.from_data(path, data, ["sha256"])
    if custom:
        info.unrecognized_fields["custom"] = custom
    targets.targets[path] = info


def root_bytes(store: Store, keys: Keys | None = None) -> bytes:
    """The current root, for provisioning devices (their trust anchor); with ``keys``, only from a
    chain this writer can vouch for."""
    from tuf.api.serialization.json import JSONSerializer

    return _latest_root(store, keys).to_bytes(JSONSerializer(compact=False))


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
        self.dir.mkdir(parents=True, exist_ok=True)
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
        except Exception as exc:
            raise VerificationFailed(
                f"the trusted root is unusable: {exc}", hint="provision the device again with the store's root"
            ) from exc
        self._fresh = False

    def refresh(self) -> None:
        """Fetch and verify the newest metadata. Raises VerificationFailed (bad signature, expired,
        replayed older version) or ServiceError (store unreachable)."""
        from tuf.api import exceptions as tex

        try:
            self.updater.refresh()
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
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".download.")
        os.close(fd)
        try:
            self.updater.download_target(info, filepath=tmp)
            return Path(tmp).read_bytes()
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
