"""Checked-in compiler caches: what a build replays instead of searching again.

An auto-tuning compiler (TVM's MetaSchedule) searches schedules on the target; TensorRT times
tactics at build time. Their decisions are kept in git under ``caches/<sku>/<model>/`` so a
build on any runner of the SKU replays them, and ``cache.json`` beside them is the index:

    {"backend": "tvm", "kind": "tuning-database",
     "key": {"tvm": "0.22.0", "target": "llvm -mcpu=haswell ..."},   # what the cache is valid for
     "files": [{"path": ..., "sha256": ..., "bytes": ...}],
     "tuned_at": "2026-12-01T10:00:00Z", "trials": 64}

A build opens a ``CacheSession``. The cache is trusted only when the index's key equals the
backend's key for the SKU (compiler version and target), every file matches its record, and the
backend can read it; otherwise it is *stale*, *corrupt* or *missing*: reported, never read. A
build never removes or rewrites a cache it did not trust: it builds without it, leaves the folder
as it is and says so (the build record, the manifest, the matrix row); only ``skuforge cache
refresh``, run by a person, replaces it. The folder holds plain files the index lists and nothing
else, but for an editor's files (``EDITOR_FILES``: dot-files, ``*~``, ``*.swp``, ``#...#``),
which are ignored with a warning naming them. Anything else there (a file the index does not
list, a symlink: the folder itself, a file, a subfolder) or an index path that leaves the folder
(``../``, absolute) is *foreign*: the build stops (exit 2) naming it, so a person looks before
anything is read or removed. The backend counts hits and misses (tuning tasks found or not in the
database, a timing cache accepted or not). With ``skus.<s>.cache.require`` (or
``SKUFORGE_REQUIRE_CACHE=1``, the CI flag) any miss fails the build (exit 1), so a release build
is known to replay the checked-in decisions. Nothing is written unless the build succeeds (the
cache is committed after the engine is in place); files and index are written atomically, the
index last.
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.core.env import SKUFORGE_REQUIRE_CACHE
from pipeline.core.errors import GateFailed, InputError
from pipeline.core.io import atomic_write_bytes, atomic_write_json, read_json, sha256_bytes, sha256_file, sha256_json
from pipeline.core.paths import path_problem

if TYPE_CHECKING:
    from pipeline.backends.base import Backend
    from pipeline.backends.contract import BuildContext

INDEX = "cache.json"
REQUIRE_ENV = SKUFORGE_REQUIRE_CACHE.name  # "1" or "true": every build fails on a cache miss (CI's release flag)
State = Literal["fresh", "stale", "corrupt", "missing", "unchecked", "none"]
# an editor's files (vim's swap, emacs's backup and autosave, any dot-file: a half-written temporary
# of ours too): never read, never removed, named in a warning. Matched on the file's own name.
EDITOR_FILES = (".*", "*~", "*.swp", "*.swo", "#*#")


def required_by_env() -> bool:
    return SKUFORGE_REQUIRE_CACHE.get()


def files_digest(records: list[dict[str, Any]]) -> str | None:
    """One sha256 for a cache's files (path, content): the manifest's cache hash."""
    return sha256_json(sorted((r["path"], r["sha256"]) for r in records)) if records else None


def _read_index(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    path = folder / INDEX
    if not path.is_file():
        return None, None
    try:
        doc = read_json(path)
    except ValueError as exc:
        return None, f"{INDEX} is not JSON ({exc})"
    if not isinstance(doc, dict) or not isinstance(doc.get("files", []), list):
        return None, f"{INDEX} is not a cache index (an object with a 'files' list)"
    return doc, None


def _entries(folder: Path) -> tuple[list[str], list[str]]:
    """What ``folder`` holds besides its index, never following a link: (files, symlinks), as
    paths relative to it. A symlink to a folder is listed, not entered."""
    files, links = [], []
    for top, dirs, names in os.walk(folder):
        for name in sorted(dirs + names):
            path = Path(top, name)
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                links.append(rel)
            elif name in names and rel != INDEX:
                files.append(rel)
    return sorted(files), sorted(links)


def editor_file(rel: str) -> bool:
    """Whether a path of the cache folder names an editor's file (EDITOR_FILES), ignored by a build."""
    name = posixpath.basename(rel)
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in EDITOR_FILES)


def _link_problem(folder: Path, rel: str) -> str:
    path = folder / rel
    target = os.readlink(path)
    try:
        resolved, base = path.resolve(), folder.resolve()
        where = "" if resolved == base or base in resolved.parents else ", outside the cache folder"
    except (OSError, RuntimeError):  # a symlink loop
        where = ", a loop"
    return f"{rel} is a symlink (to {target}{where})"


def _escape_problem(rel: Any) -> str | None:
    """Why a path the index lists does not name a file inside the cache folder, or None."""
    if not isinstance(rel, str):
        return f"{INDEX} lists {rel!r}, which is not a file name"
    problem = path_problem(rel)
    if problem is None:
        return None
    why = {"is absolute": "an absolute path", "leaves the project root ('..')": "'..' leads out of it"}.get(
        problem, problem
    )
    return f"{INDEX} lists {rel!r}, which escapes the cache folder ({why})"


def _plain(folder: Path, name: str) -> bool:
    """``folder/name`` is a regular file reached without a symlink (the folder's or its own)."""
    path = folder / name
    return not folder.is_symlink() and not path.is_symlink() and path.is_file()


@dataclass
class CacheStatus:
    """What ``caches/<sku>/<model>/`` holds and whether a build would trust it."""

    sku: str
    model: str
    backend: str
    kind: str | None
    folder: Path
    state: State
    reason: str
    key: dict[str, str] = field(default_factory=dict)  # what the cache was made for
    want: dict[str, str] = field(default_factory=dict)  # what this host's compiler and the SKU's target make
    files: list[dict[str, Any]] = field(default_factory=list)
    tuned_at: str | None = None
    trials: int | None = None
    last_build: dict[str, Any] | None = None  # the cache record of the last build report
    ignored: list[str] = field(default_factory=list)  # an editor's files in the folder (EDITOR_FILES)
    # the folder holds what no index vouches for (an unlisted file, a symlink) or the index points out
    # of it: a build stops (exit 2) rather than read or remove anything
    foreign: bool = False

    @property
    def bytes(self) -> int:
        return sum(int(f.get("bytes", 0)) for f in self.files)

    @property
    def sha256(self) -> str | None:
        return files_digest(self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "sku": self.sku,
            "model": self.model,
            "backend": self.backend,
            "kind": self.kind,
            "folder": str(self.folder),
            "state": self.state,
            "reason": self.reason,
            "key": self.key,
            "want": self.want,
            "files": self.files,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "tuned_at": self.tuned_at,
            "trials": self.trials,
            "last_build": self.last_build,
            "ignored": self.ignored,
            "foreign": self.foreign,
        }


def inspect(backend: Backend, sku: str, model: str, folder: Path, want: dict[str, str] | None) -> CacheStatus:
    """The state of one cache folder against ``want`` (the backend's key; None: not checkable here)."""
    kind = backend.capabilities.cache
    status = CacheStatus(
        sku=sku,
        model=model,
        backend=backend.name,
        kind=kind,
        folder=folder,
        state="missing",
        reason="",
        want=want or {},
    )
    if kind is None:
        status.state, status.reason = "none", f"the {backend.name} backend keeps no cache"
        return status
    fix = (
        f"not trusted, and a build neither reads nor removes it; delete it, or rebuild the cache "
        f"(skuforge cache refresh --sku {sku} --model {model} removes what {INDEX} does not list)"
    )
    if folder.is_symlink():
        status.state, status.foreign = "corrupt", True
        status.reason = (
            f"the cache folder is a symlink (to {os.readlink(folder)}): not trusted; delete the link, or "
            f"rebuild the cache (skuforge cache refresh --sku {sku} --model {model} makes it a folder)"
        )
        return status
    present, links = _entries(folder) if folder.is_dir() else ([], [])
    status.ignored = [p for p in present if editor_file(p)]
    present = [p for p in present if not editor_file(p)]
    if links:  # checked before the index is read: cache.json itself may be the link
        status.state, status.foreign = "corrupt", True
        status.reason = f"{'; '.join(_link_problem(folder, x) for x in links)}; a cache holds plain files only: {fix}"
        return status
    index, problem = _read_index(folder)
    if problem:
        status.state, status.reason = "corrupt", problem
        return status
    if index is None or not index.get("files"):
        if present:  # files no index vouches for
            status.state, status.foreign = "corrupt", True
            status.reason = f"{', '.join(present)} present but not in {INDEX} (not written by skuforge): {fix}"
        else:
            status.state, status.reason = "missing", "no cache yet"
        return status
    status.key = {str(k): str(v) for k, v in (index.get("key") or {}).items()}
    status.files = [f for f in index["files"] if isinstance(f, dict)]
    escapes = [p for p in (_escape_problem(f.get("path")) for f in status.files) if p]
    if escapes:
        status.state, status.foreign = "corrupt", True
        status.reason = (
            f"{'; '.join(escapes)}: not trusted, nothing outside the folder is read; rebuild the cache "
            f"(skuforge cache refresh --sku {sku} --model {model}) to rewrite the index"
        )
        return status
    listed = {posixpath.normpath(str(f.get("path"))) for f in status.files}
    status.ignored = [p for p in status.ignored if p not in listed]  # a listed file is the cache's own
    unlisted = [p for p in present if p not in listed]
    if unlisted:  # a file planted beside an index that does not vouch for it
        status.state, status.foreign = "corrupt", True
        status.reason = f"{', '.join(unlisted)} present but not in {INDEX} (not written by skuforge): {fix}"
        return status
    status.tuned_at, status.trials = index.get("tuned_at"), index.get("trials")
    if index.get("backend") != backend.name:
        status.state, status.reason = (
            "stale",
            f"made by the {index.get('backend')} backend, the SKU uses {backend.name}",
        )
        return status
    for rec in status.files:
        path = folder / str(rec.get("path", ""))
        if not path.is_file():
            status.state, status.reason = "corrupt", f"{rec.get('path')} is listed in {INDEX} but missing"
            return status
        if path.stat().st_size != rec.get("bytes") or sha256_file(path) != rec.get("sha256"):
            status.state, status.reason = (
                "corrupt",
                f"{rec['path']} differs from its sha256 in {INDEX} (edited or truncated)",
            )
            return status
    if want is None:
        status.state, status.reason = "unchecked", f"{backend.name} is not installed here: the key cannot be computed"
        return status
    differs = sorted(k for k in set(status.key) | set(want) if status.key.get(k) != want.get(k))
    if differs:
        status.state = "stale"
        status.reason = "; ".join(f"{k}: cache {status.key.get(k)!r}, now {want.get(k)!r}" for k in differs)
        return status
    problem = backend.check_cache(folder)
    if problem:
        status.state, status.reason = "corrupt", problem
        return status
    status.state, status.reason = "fresh", "key and files match"
    return status


class CacheSession:
    """One build's use of its cache: what it may read, what it hit and missed, what it writes."""

    def __init__(self, backend: Backend, ctx: BuildContext, required: bool):
        self.backend, self.folder, self.required = backend, ctx.cache_dir, required
        self.refresh = ctx.cache_refresh  # skuforge cache refresh: the one build that may replace the folder
        # what commit writes, decided by close
        self._unlink_folder = False
        self._drop: list[str] = []
        self._files: dict[str, bytes] = {}
        self._index: dict[str, Any] | None = None
        self.where = f"caches/{ctx.sku}/{ctx.model}"
        self.refresh_hint = f"skuforge cache refresh --sku {ctx.sku} --model {ctx.model}, then commit {self.where}"
        self.key = backend.cache_key(ctx.sku_spec)
        self.status = inspect(backend, ctx.sku, ctx.model, self.folder, self.key)
        kind = backend.capabilities.cache
        if self.status.foreign and not self.refresh:
            raise InputError(
                f"{kind} {self.where}: {self.status.reason}",
                hint=f"a build never removes anything from a cache folder; rebuild it with {self.refresh_hint} "
                f"(an editor's files, {' '.join(EDITOR_FILES)}, are ignored)",
            )
        if self.refresh:  # search afresh, whatever is there
            self.status.state, self.status.reason = "missing", "a refresh was asked for"
        self.hits, self.misses = 0, 0
        self.missed: list[str] = []  # what was not found (tasks, the cache)
        self.warnings: list[str] = []
        self._staged: dict[str, bytes] = {}
        self._tuned: dict[str, Any] | None = None
        if self.status.ignored:
            self.warnings.append(
                f"{self.where}: ignored {', '.join(self.status.ignored)} (not in {INDEX}; an editor's file by "
                "its name): never read, never removed"
            )
        if self.status.state != "fresh" and (self.status.state != "missing" or required):
            self.warnings.append(self._unused(self.status.reason))
        if self.status.state != "fresh":
            self.miss(f"the {kind} ({self.status.state}: {self.status.reason})")

    def _unused(self, reason: str) -> str:
        what = f"{self.backend.capabilities.cache} {self.where}"
        if self.status.state == "missing":
            return f"{what} is missing ({reason}): this build makes it"
        return (
            f"{what} is {self.status.state} ({reason}): not used, so the engine is built without its checked-in "
            f"decisions; the folder is left as it is (a build never rewrites a cache it does not trust): "
            f"{self.refresh_hint}"
        )

    @property
    def trusted(self) -> bool:
        return self.status.state == "fresh"

    def file(self, name: str) -> Path | None:
        """The cache file to read, or None when the cache is not trusted or its index does not list it."""
        listed = {str(f.get("path")) for f in self.status.files}
        path = self.folder / name
        return path if self.trusted and name in listed and path.is_file() else None

    def hit(self, count: int = 1) -> None:
        self.hits += count

    def miss(self, what: str) -> None:
        """Something the build needed was not in the cache; under ``required`` that fails the build."""
        self.misses += 1
        self.missed.append(what)
        if self.required:
            raise GateFailed(
                f"cache miss in {self.where}: {what}; the build requires its cache "
                f"(skus.<sku>.cache.require or {REQUIRE_ENV}=1) so it replays the checked-in decisions",
                hint=f"refresh the cache on the SKU's runner: {self.refresh_hint}",
            )

    def reject(self, reason: str) -> None:
        """The backend could not use a cache the index vouched for (another GPU's timing cache)."""
        self.status.state, self.status.reason = "corrupt", reason
        self.warnings.append(self._unused(reason))
        self.miss(f"the {self.backend.capabilities.cache} ({reason})")

    def write(self, name: str, data: bytes, trials: int | None = None, seconds: float | None = None) -> None:
        """Stage a cache file, written by ``commit`` after the engine is in place. ``trials`` and
        ``seconds``: the tuning this build spent on it (recorded as the last tuning; the next
        tuning's estimate reads its seconds per trial)."""
        self._staged[name] = data
        if trials is not None:
            tuned = self._tuned or {}
            self._tuned = {
                "trials": tuned.get("trials", 0) + trials,
                "seconds": tuned.get("seconds", 0.0) + (seconds or 0.0),
            }

    def close(self) -> dict[str, Any]:
        """Decide what the cache becomes (nothing is written yet) and return the build's cache
        record; ``commit`` writes it once the engine is in place. A build writes only a cache it
        trusted (extended) or one there was none of (made); a refresh replaces whatever is there."""
        self._unlink_folder, self._drop, self._files, self._index = False, [], {}, None
        records: list[dict[str, Any]] = []
        if self.status.state in ("fresh", "missing"):  # a stale or corrupt cache is left as it is
            records = self._decide()
        total = self.hits + self.misses
        return {
            "kind": self.backend.capabilities.cache,
            "state": self.status.state,
            "reason": self.status.reason,
            "key": self.key,
            "sha256": files_digest(records),
            "files": records,
            "hits": self.hits,
            "misses": self.misses,
            "missed": self.missed[:20],
            "hit_rate": round(self.hits / total, 4) if total else None,
            "updated": bool(self._files or self._drop or self._unlink_folder or self._index is not None),
            "required": self.required,
            "ignored": self.status.ignored,
        }

    def _decide(self) -> list[dict[str, Any]]:
        """What a cache the build may write holds after it: its records; sets what ``commit`` writes
        (and, for a refresh only, removes)."""
        index = _read_index(self.folder)[0] if _plain(self.folder, INDEX) else None  # never read through a link
        trusted = [str(f.get("path")) for f in self.status.files] if self.trusted else []
        # what the folder will hold: this build's files, and the trusted ones it did not replace
        contents = dict(self._staged)
        for name in trusted:
            if name not in contents:
                contents[name] = (self.folder / name).read_bytes()
        if self.refresh:
            # a symlinked folder is replaced by a real one (the link removed, never what it points to);
            # in a real folder, what the new index will not list goes (planted files, symlinks), but an
            # editor's files
            self._unlink_folder = self.folder.is_symlink()
            if self.folder.is_dir() and not self._unlink_folder:
                files, links = _entries(self.folder)
                self._drop = [p for p in files if p not in contents and not editor_file(p)] + [
                    p for p in links if p not in contents and p != INDEX
                ]
        self._files = {
            name: data
            for name, data in contents.items()
            if not (_plain(self.folder, name) and (self.folder / name).read_bytes() == data)
        }
        order = [n for n in self.backend.cache_files if n in contents] + sorted(
            n for n in contents if n not in self.backend.cache_files
        )
        records = [
            {"path": name, "sha256": sha256_bytes(contents[name]), "bytes": len(contents[name])} for name in order
        ]
        doc = {
            "backend": self.backend.name,
            "kind": self.backend.capabilities.cache,
            "key": self.key,
            "files": records,
            "tuned_at": (index or {}).get("tuned_at"),
            "trials": (index or {}).get("trials"),
        }
        if (index or {}).get("last_tuning") is not None:
            doc["last_tuning"] = index["last_tuning"]  # type: ignore[index]
        # this build's search made the cache; a search that decided the same files under the same key
        # again (a refresh that found nothing better) leaves the index as it was: no diff to commit
        same = index is not None and index.get("files") == records and index.get("key") == self.key
        if self._tuned is not None and (self._files or not (self.trusted or same)):
            doc["tuned_at"] = (
                _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
            )
            before = (doc["trials"] or 0) if self.trusted else 0  # trials that made the records kept
            doc["trials"] = before + self._tuned["trials"]
            # this search alone: what a trial cost on this SKU's measuring devices, for the next estimate
            doc["last_tuning"] = {"trials": self._tuned["trials"], "seconds": round(self._tuned["seconds"], 1)}
        self._index = doc if doc != index else None
        return records

    def commit(self) -> None:
        """Write what ``close`` decided: changed files, the index last; for a refresh first what no
        index vouches for removed (a symlinked folder: the link)."""
        if self._unlink_folder:
            self.folder.unlink()
        for name in self._drop:
            (self.folder / name).unlink(missing_ok=True)
        for name, data in self._files.items():
            atomic_write_bytes(self.folder / name, data)
        if self._index is not None:
            atomic_write_json(self.folder / INDEX, self._index)


def open_session(backend: Backend, ctx: BuildContext) -> CacheSession:
    required = (ctx.sku_spec.cache.require or required_by_env()) if ctx.cache_required is None else ctx.cache_required
    return CacheSession(backend, ctx, required=required and not ctx.cache_refresh)


def write_plain_index(folder: Path, backend: Backend) -> None:
    """The index of a backend without a cache: the folder exists (DVC declares it as an output)."""
    doc = {"backend": backend.name, "files": []}
    index, _ = _read_index(folder)
    if index != doc:
        atomic_write_json(folder / INDEX, doc)


def seconds_per_trial(root: Path) -> float | None:
    """What a tuning trial last cost on a SKU: the newest ``last_tuning`` of the indexes of its
    models' caches under ``root`` (caches/<sku>/<model>/: the same devices measure every model);
    None when none is recorded."""
    best: tuple[str, float] | None = None
    for path in sorted(root.glob(f"*/{INDEX}")):
        index, _ = _read_index(path.parent)
        last = (index or {}).get("last_tuning")
        try:
            trials, seconds = int(last["trials"]), float(last["seconds"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            continue
        when = str((index or {}).get("tuned_at") or "")
        if trials > 0 and seconds > 0 and (best is None or when > best[0]):
            best = (when, seconds / trials)
    return None if best is None else best[1]
