"""The device's side of the signed release store: a TUF client (ngclient) over a Store, and the
checks that keep a device on the store's newest history whatever the store serves.

ngclient refuses metadata not signed by the trusted root's keys, expired metadata and a timestamp
older than the one the device trusts (it keeps what it verified in the agent's folder). Three
things it does not do, done here:

- **a floor from provisioning**: a device that never ran trusts nothing but its root, so a store
  put back to an older state before its first pass would pass. The timestamp it was provisioned
  with (``skuforge release root --timestamp-out``, then ``skuforge agent --timestamp``) becomes
  its trusted timestamp, so anything older is refused (:class:`~pipeline.rollout.trust.Replayed`);
- **another file at the trusted version**: ngclient keeps its own copy of an equal version
  silently; a store serving a different timestamp at that version was forked
  (:class:`~pipeline.rollout.trust.Forked`);
- **a newer timestamp on another history**: each timestamp signs the version and sha256 of the one
  it follows; a newer one must lead back to the trusted one through those links (the archived
  timestamps in between, one GET each), else it was signed on a store put back to an older state.
  A timestamp ``release repair`` signed is accepted whatever it follows: the key holder chose it.

Expiry bounds what is left: a device provisioned before a state that the store no longer serves
accepts an older, still-valid timestamp until it expires (``rollout.expiry.timestamp_days``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.errors import ConfigError, ServiceError, StorageError
from pipeline.core.io import atomic_write_bytes
from pipeline.rollout import trust
from pipeline.rollout.store import Store
from pipeline.rollout.trust import TIMESTAMP_KEY, Forked, Replayed, Unproven, VerificationFailed

if TYPE_CHECKING:
    from tuf.api.metadata import Metadata

TIMESTAMP = "timestamp.json"  # ngclient's trusted timestamp in the client's folder
DEVICE_HINT = (
    "nothing was installed: the device keeps what it runs and tries again on its next pass. Whoever runs "
    "the store: `skuforge release repair` with the signing key restores the newest state, and devices "
    "accept it"
)


def _version(data: bytes) -> int | None:
    """The version a signed metadata file says it is (None: not metadata), for messages and checks
    on files ngclient verified or is about to."""
    try:
        return int(json.loads(data)["signed"]["version"])
    except (ValueError, KeyError, TypeError):
        return None


def _fetcher_class():
    from tuf.api.exceptions import DownloadHTTPError
    from tuf.ngclient import FetcherInterface

    class StoreFetcher(FetcherInterface):
        """Serves ngclient's URLs from a Store: ``store:/metadata/<name>`` and
        ``store:/targets/<dir>/<sha256>.<name>`` (content-addressed blob)."""

        def __init__(self, store: Store):
            self.store = store
            self.served: bytes | None = None  # the timestamp.json it served last (ngclient drops an equal version)

        def _fetch(self, url: str) -> Iterator[bytes]:
            rest = url.removeprefix("store:/")
            if rest.startswith("metadata/"):
                key = rest
            elif rest.startswith("targets/"):
                digest = rest.rsplit("/", 1)[-1].split(".", 1)[0]
                key = trust.blob_key(digest)
            else:
                raise DownloadHTTPError(f"not a store URL: {url}", 404)
            blob = self.store.get(key)
            if blob is None:
                raise DownloadHTTPError(f"{key} not found", 404)
            if key == TIMESTAMP_KEY:
                self.served = blob.data
            return iter([blob.data])

    return StoreFetcher


class Client:
    """A device's view of the store: TUF-verified metadata kept under ``state_dir`` (so a replayed
    older state is refused), and verified target downloads."""

    def __init__(
        self, store: Store, state_dir: str | os.PathLike, root: bytes | None = None, timestamp: bytes | None = None
    ):
        from tuf.ngclient import Updater

        self.dir = Path(state_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unwritable(exc) from exc
        self.store = store
        self._fetcher = _fetcher_class()(store)
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
                fetcher=self._fetcher,
                bootstrap=None if have_root else root,
            )
        except OSError as exc:  # persisting the bootstrap root: the folder, not the root, is at fault
            raise self._unwritable(exc) from exc
        except Exception as exc:
            raise VerificationFailed(
                f"the trusted root is unusable: {exc}", hint="provision the device again with the store's root"
            ) from exc
        self._fresh = False
        if timestamp is not None:
            self._provision(timestamp)

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
        """Fetch and verify the newest metadata. Raises VerificationFailed (bad signature, expired;
        Replayed: older than the trusted timestamp; Forked, Unproven: not on its history) or
        ServiceError (store unreachable)."""
        from tuf.api import exceptions as tex

        before = self._trusted()
        self._fetcher.served = None
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
            self._replayed(exc)
            raise VerificationFailed(
                f"release metadata refused: {type(exc).__name__}: {exc}",
                hint="the store serves metadata this device must not trust; nothing was installed",
            ) from exc
        self._check_history(before)
        self._fresh = True

    def _trusted(self) -> bytes | None:
        """The timestamp this device trusts, as ngclient keeps it (None: none yet)."""
        try:
            return (self.dir / TIMESTAMP).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._unwritable(exc) from exc

    def _root(self) -> Metadata:
        from tuf.api.metadata import Metadata

        return Metadata.from_bytes((self.dir / "root.json").read_bytes())

    def _keep(self, data: bytes) -> None:
        try:
            atomic_write_bytes(self.dir / TIMESTAMP, data)
        except OSError as exc:
            raise self._unwritable(exc) from exc

    def _provision(self, data: bytes) -> None:
        """Trust the timestamp the device was provisioned with, unless it trusts a newer one already:
        then ngclient refuses any older one the store serves."""
        try:
            md = trust._parse(data, "provisioned timestamp")
            if md.signed.type != "timestamp":
                raise VerificationFailed(f"it is {md.signed.type} metadata")
            self._root().signed.verify_delegate("timestamp", md.signed_bytes, md.signatures)
        except Exception as exc:
            raise ConfigError(
                f"the provisioned timestamp (agent --timestamp) is unusable: {exc}",
                hint="provision the device with `skuforge release root --out root.json --timestamp-out "
                "timestamp.json`, run against the store it uses",
            ) from exc
        have = self._trusted()
        version = md.signed.version
        trusted = _version(have) if have is not None else None
        if trusted is None or trusted < version:
            self._keep(data)
        elif trusted == version and have != data:
            raise Forked(
                f"the timestamp this device was provisioned with (version {version}, sha256 "
                f"{trust.sha256_hex(data)[:12]}) is not the version {version} it trusts (sha256 "
                f"{trust.sha256_hex(have or b'')[:12]}): two states were signed as version {version}",
                hint=DEVICE_HINT,
            )

    def _replayed(self, exc: Exception) -> None:
        """Raise :class:`Replayed` when ngclient refused a timestamp older than the trusted one."""
        served, have = self._fetcher.served, self._trusted()
        old, new = (_version(served) if served else None), (_version(have) if have else None)
        if old is not None and new is not None and old < new:
            raise Replayed(
                f"the store {self.store.url} serves timestamp version {old}, older than version {new} this device "
                "trusts (it verified it before, or was provisioned with it): the store was put back to an older "
                "state",
                hint=DEVICE_HINT,
            ) from exc

    def _check_history(self, before: bytes | None) -> None:
        """After ngclient's refresh: the trusted timestamp is the one the store serves, and it follows
        the one trusted ``before`` along the signed links. A timestamp that does not is not trusted
        (``before`` is put back, with ngclient's snapshot and targets of it removed)."""
        after, served = self._trusted(), self._fetcher.served
        if after is None:
            return
        v = _version(after)
        if served is not None and served != after and _version(served) == v:
            raise Forked(
                f"the store {self.store.url} serves a timestamp version {v} (sha256 {trust.sha256_hex(served)[:12]}) "
                f"other than the version {v} this device trusts (sha256 {trust.sha256_hex(after)[:12]}): the store "
                f"was forked (two states signed as version {v})",
                hint=DEVICE_HINT,
            )
        if before is None or before == after:
            return
        from tuf.api.metadata import Metadata

        was = trust.Link(_version(before) or 0, trust.sha256_hex(before))
        broken = trust.walk(self.store, self._root(), Metadata.from_bytes(after), was)
        if broken is None:
            return
        self._keep(before)
        for name in ("snapshot.json", "targets.json"):
            try:
                (self.dir / name).unlink(missing_ok=True)
            except OSError as exc:
                raise self._unwritable(exc) from exc
        what = "was forked" if broken.forked else "cannot prove its history"
        raise (Forked if broken.forked else Unproven)(
            f"the store {self.store.url} {what}: its timestamp version {v} does not follow version {was.version} "
            f"this device trusts: {broken.detail}",
            hint=DEVICE_HINT,
        )

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
