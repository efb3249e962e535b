"""Atomic file writes and content hashes.

Every file a later step trusts is written to a temporary sibling and renamed into place, so a
crash leaves either the old file or the new one, never half of one. The temporary sibling is
named ``.<name>.<pid>.<random>.tmp``: the next write of the same target removes those whose
process is gone (a build killed with -9 leaves its staging folder behind).

A write that fails because the folder is read-only or the disk is full raises ``StorageError``
(exit 3) naming the path and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core.errors import MalformedFile, StorageError

log = logging.getLogger(__name__)

STALE_SECONDS = 3600  # a temporary sibling without a pid in its name is left behind after this
_READ_ONLY = {errno.EACCES, errno.EPERM, errno.EROFS}
_FULL = {errno.ENOSPC, errno.EDQUOT}
_FULL_OR_TOO_BIG = frozenset(_FULL | {errno.EFBIG})
_STAGING = re.compile(r"\.([^/]+)\.\d+\.[^/.]+\.tmp(?=/|$)")


def storage_error(exc: OSError, path: str | os.PathLike | None = None) -> StorageError | None:
    """``exc`` as a StorageError naming ``path`` (else the error's file) and what to do; None when
    it is not a read-only folder, a full disk, a too-large file or a file where a folder should be."""
    where = Path(path if path is not None else exc.filename if exc.filename is not None else ".")
    where = Path(_STAGING.sub(r"\1", str(where)))  # name the target, not its staging sibling
    reason = exc.strerror or str(exc)
    if exc.errno in _READ_ONLY:
        folder = where.parent  # files are written as temporary siblings: the folder must take new entries
        return StorageError(
            f"cannot write {where}: {folder} is not writable ({reason})",
            hint=f"make {folder} writable (check its permissions, `lsattr -d`, read-only mounts), then run again",
            path=str(where),
        )
    if exc.errno in _FULL:
        return StorageError(
            f"cannot write {where}: no space left on the disk holding it ({reason})",
            hint=f"free space on that disk (or raise the quota); `df -h {where.parent}` shows it, then run again",
            path=str(where),
        )
    if exc.errno == errno.EFBIG:
        return StorageError(
            f"cannot write {where}: the file is larger than the file system or `ulimit -f` allows ({reason})",
            hint="raise `ulimit -f`, or put the project on a file system that takes "
            "files this large (and free space), then run again",
            path=str(where),
        )
    if exc.errno == errno.ENOTDIR:
        return StorageError(
            f"cannot write {where}: a part of the path is a file, not a folder ({reason})",
            hint=f"remove or rename the file in the way of {where.parent}",
            path=str(where),
        )
    return None


@contextlib.contextmanager
def _writing(path: Path, only: frozenset[int] | None = None) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        err = storage_error(exc, path) if only is None or exc.errno in only else None
        if err is None:
            raise
        raise err from exc


def _pid_alive(pid: int, since: float) -> bool:
    """The process exists and is older than ``since`` (not a later one that reused the pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    try:
        import psutil

        return psutil.Process(pid).create_time() <= since + 1
    except Exception:  # no psutil, or the process ended meanwhile: trust the kill check
        return True


def remove_stale(path: Path) -> list[Path]:
    """Remove what killed writers of ``path`` left: ``.<name>.<pid>.*.tmp`` of dead processes,
    pid-less ones older than STALE_SECONDS, and a ``.<name>.old`` next to the target."""
    prefix = f".{path.name}."
    removed: list[Path] = []
    try:
        siblings = [p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(".tmp")]
    except OSError:
        return removed
    for tmp in siblings:
        try:
            mtime = tmp.lstat().st_mtime
        except OSError:
            continue
        pid = tmp.name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid():
            stale = not _pid_alive(int(pid), mtime)
        else:
            stale = not pid.isdigit() and time.time() - mtime > STALE_SECONDS
        if stale:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            removed.append(tmp)
    old = path.with_name(f".{path.name}.old")
    if old.exists() and path.exists():  # a swap that finished but was killed before its clean-up
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    elif old.exists():  # killed half-way through the swap: the old one is the last good one
        with contextlib.suppress(OSError):
            os.replace(old, path)
    if removed:
        log.info("removed %d stale temporary file(s) of %s left by an interrupted run", len(removed), path)
    return removed


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}."


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    with _writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_tmp_prefix(path), suffix=".tmp")
        try:
            os.fchmod(fd, _FILE_MODE)  # mkstemp makes 0600; a written file should read like any other
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return path


def to_json(obj: Any) -> str:
    """Canonical JSON: sorted keys, two-space indent, trailing newline (stable diffs)."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_bytes(path, to_json(obj).encode())


def git_ignored(folder: str | os.PathLike) -> Path:
    """``folder``, holding a ``.gitignore`` that ignores everything in it: local state of this checkout
    (outside every DVC output, so nothing else ignores it in a team's repository)."""
    ignore = Path(folder) / ".gitignore"
    if not ignore.exists():
        atomic_write_bytes(ignore, b"*\n")
    return Path(folder)


def atomic_savez(path: str | os.PathLike, **arrays: Any) -> Path:
    """np.savez (uncompressed, deterministic bytes) written atomically."""
    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return atomic_write_bytes(path, buf.getvalue())


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only if the block succeeds."""
    path = Path(path)
    with _writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_tmp_prefix(path), suffix=".tmp"))
        os.chmod(tmp, 0o777 & ~_umask())
    old = path.with_name(f".{path.name}.old")
    try:
        # the block fills the staging folder: a full disk there is ours to name too (other errors,
        # such as an unreadable input, are the block's own)
        with _writing(path, only=_FULL_OR_TOO_BIG):
            yield tmp
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():  # the swap failed half-way: put the old one back
            os.replace(old, path)
        raise


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    return sha256_bytes(to_json(obj).encode())


def sha256_arrays(arrays: dict[str, Any]) -> str:
    """Hash of named arrays by name, dtype, shape and bytes (independent of file format)."""
    import numpy as np

    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def read_json(path: str | os.PathLike) -> Any:
    """The parsed file; MalformedFile (exit 2, also a ValueError) naming it when it is not JSON."""
    with open(path, encoding="utf-8") as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as exc:
            raise MalformedFile(
                f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})",
                hint="regenerate it with the step that writes it (or delete it and run again)",
            ) from exc
        except UnicodeDecodeError as exc:
            raise MalformedFile(
                f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})",
                hint="regenerate it with the step that writes it (or delete it and run again)",
            ) from exc


# git's conflict markers: ours, base (diff3/zdiff3), separator, theirs; always at a line's start
_CONFLICT_MARKER = re.compile(r"(?:<{7}|\|{7}|>{7})(?:[ \t].*)?|={7}[ \t]*")
MERGE_CONFLICT_FIX = (
    "resolve the merge conflict: keep the right side of each '<<<<<<<' … '>>>>>>>' block and delete the marker lines"
)


def merge_conflict(path: str | os.PathLike, text: str) -> str | None:
    """What is wrong when ``text`` (of ``path``) still holds a git merge conflict marker, naming
    the first one's line; None when it holds none."""
    for number, line in enumerate(text.splitlines(), 1):
        if line[:1] in "<=>|" and _CONFLICT_MARKER.fullmatch(line):
            shown = line if len(line) <= 80 else line[:80] + "…"
            return f"{path} has an unresolved git merge conflict: line {number} is the marker {shown!r}"
    return None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (made, with its folder, when missing) for the block: the
    processes that take it on the same file serialise (making a cached environment, writing a store)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
