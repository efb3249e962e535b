"""Which (model, SKU) pairs this host builds, running ``dvc repro`` for them, what each stage
command's failure was (outcome records), and the matrix of outcomes per (model, SKU)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.core.errors import ConfigError, EnvironmentProblem, InputError, MalformedFile, SkuforgeError
from pipeline.core.io import MERGE_CONFLICT_FIX, atomic_write_json, merge_conflict
from pipeline.core.processes import stop_group
from pipeline.core.redact import redact
from pipeline.engine.matrix import (
    EMULATE_STAGE,
    EXAMPLE_STAGES,
    GLOBAL_STAGES,
    MODEL_STAGES,
    PAIR_STAGES,
    PIPELINES_DIR,
    SkuStatus,
    parse_address,
    sku_statuses,
    stage_address,
    stage_chain,
)
from pipeline.project.config import Registry
from pipeline.results.outcomes import clear_outcome


def targets(
    registry: Registry,
    models: list[str] | None,
    skus: list[str] | None,
    publish: bool = True,
    statuses: list[SkuStatus] | None = None,
) -> tuple[list[str], list[SkuStatus]]:
    """dvc targets (stage addresses) for this host, and the SKUs it cannot take all the way.

    A SKU this host can build and run goes to its publish stage (its manifest with
    ``publish=False``); one it can only build (a cross-compiled engine) goes to its build stage,
    and its runner validates, benches and publishes it; one whose engines it validates under emulation
    (an aarch64 CPU SKU on an x86-64 host) goes to its emulate stage. Only the pairs the registry builds
    (Registry.pairs: ``models.<m>.skus``). ``statuses``: sku_statuses, computed when None.
    """
    for m in models or []:
        registry.model(m)
    for s in skus or []:
        registry.sku(s)
    statuses = [s for s in (sku_statuses(registry) if statuses is None else statuses) if not skus or s.sku in skus]
    by_sku = {s.sku: s for s in statuses}
    pairs = registry.pairs(models or None, list(by_sku))
    if models and skus and not pairs:
        raise ConfigError(
            f"model {', '.join(models)} is built for none of the SKUs asked for: {', '.join(skus)}",
            hint=f"add the SKU to models.{models[0]}.skus in params.yaml, or ask for one listed there",
        )
    last = PAIR_STAGES[-1] if publish else "manifest"
    out = [stage_address(_last_stage(by_sku[s], last), m, s) for m, s in pairs if by_sku[s].buildable]
    return out, [s for s in statuses if not (s.buildable and s.runnable)]


def _last_stage(status: SkuStatus, last: str) -> str:
    """How far this host takes a SKU's pairs: all the way; to the emulate stage where it cannot run
    them but validates them under emulation (never benchmarked); to the build otherwise."""
    return last if status.runnable else EMULATE_STAGE if status.emulated else "build"


def upstream_stages(registry: Registry, dvc_targets: list[str]) -> set[str]:
    """The stage addresses the targets depend on, targets included."""
    names: set[str] = set(GLOBAL_STAGES) | {f"{s}@{e}" for s in EXAMPLE_STAGES for e in registry.examples}
    for target in dvc_targets:
        stage, model, sku = parse_address(target)
        assert model is not None and sku is not None, target  # targets() makes (model, SKU) addresses only
        names |= {f"{s}@{model}" for s in MODEL_STAGES}
        names |= {stage_address(s, model, sku) for s in stage_chain(stage)}
    return names


def _dvc(root: Path) -> str:
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    if not Path(dvc).exists():
        raise EnvironmentProblem(
            "dvc is not installed",
            hint="install the build toolchain: pip install 'skuforge[pipeline]' (an agent-only install lacks dvc)",
        )
    if not (root / ".dvc").is_dir():
        raise InputError(f"{root} is not a DVC repository", hint="run `git init && dvc init` in the project root")
    refuse_merge_conflicts(root)
    return dvc


# The files dvc reads, and how to get past a merge conflict in each.
DVC_FILES = {
    "dvc.lock": f"{MERGE_CONFLICT_FIX}; or delete dvc.lock and run `skuforge repro` again to rebuild it (dvc "
    "reruns the stages whose outputs it cannot restore from its cache)",
    "dvc.yaml": f"{MERGE_CONFLICT_FIX}, then run again",
    "params.yaml": f"{MERGE_CONFLICT_FIX}, then run again",
}


def refuse_merge_conflicts(root: Path) -> None:
    """MalformedFile (exit 2) naming the file and line when a dvc.lock, dvc.yaml or params.yaml still
    holds a git merge conflict: dvc would fail on it with a parse error that does not say so."""
    per_sku = [p for pattern in ("*/dvc.lock", "*/run/dvc.lock") for p in sorted((root / PIPELINES_DIR).glob(pattern))]
    for path in [*(root / name for name in DVC_FILES), *per_sku]:
        fix = DVC_FILES[path.name]
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue  # missing or unreadable: dvc says which
        conflict = merge_conflict(path, text)
        if conflict:
            raise MalformedFile(conflict, hint=fix)


# `dvc status`'s last answer and the state of the workspace it answered for (.dvc/tmp: DVC's own
# git-ignored scratch folder): a read-only `repro --dry`, or a no-op `repro`, on an unchanged
# workspace answers from it in milliseconds instead of a multi-second dvc start.
STATUS_MEMO = Path(".dvc") / "tmp" / "skuforge-status.json"
# The files whose change can change dvc's answer besides the stages' own deps and outs.
_DVC_FILES = ("dvc.yaml", "dvc.lock", ".dvcignore")
_PROJECT_FILES = ("dvc.yaml", "dvc.lock", "params.yaml", ".dvcignore", ".dvc/config", ".dvc/config.local")


def _stat_line(root: Path, path: Path) -> str:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return f"{path.relative_to(root)}\0-\n"
    return f"{path.relative_to(root)}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n"


class _Linked(Exception):
    """A symbolic link under a locked path: its target can change with the link's own stat unchanged."""


def _walk(root: Path, path: Path, out: list[str]) -> None:
    if path.is_symlink():
        raise _Linked(path)
    out.append(_stat_line(root, path))
    if path.is_dir():
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            _walk(root, Path(entry.path), out)


def workspace_state(root: Path) -> str | None:
    """A digest of everything `dvc status` reads: the pipeline files, params.yaml, DVC's config and
    ignore files, and (size, mtime, inode) of every file under each path a lock records as a
    dependency or output, and the dvc that answers. DVC itself trusts (size, mtime, inode) to skip
    re-hashing a file, so the same state gives the same answer. None (dvc decides) when a lock cannot
    be read, or names a path outside the project or holding a symbolic link."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    files = [root / name for name in _PROJECT_FILES]
    pipelines = root / PIPELINES_DIR
    if pipelines.is_dir():
        files += sorted(p for p in pipelines.rglob("*") if p.name in _DVC_FILES)
    recorded: set[str] = set()
    for lock in (f for f in files if f.name == "dvc.lock" and f.is_file()):
        try:
            doc = yaml.load(lock.read_text(encoding="utf-8"), Loader=loader)  # noqa: S506 (a safe loader)
            for stage in (doc or {}).get("stages", {}).values():
                recorded.update(str(e["path"]) for kind in ("deps", "outs") for e in stage.get(kind) or [])
        except (OSError, ValueError, yaml.YAMLError, AttributeError, KeyError, TypeError):
            return None
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    lines = [_stat_line(root, f) for f in files] + [f"dvc\0{dvc}\0{_stat_line(Path(dvc).parent, Path(dvc))}"]
    for rel in sorted(recorded):
        path = (root / rel).resolve()
        if root.resolve() not in (path, *path.parents):  # a lock naming a path outside: dvc decides
            return None
        try:
            _walk(root, root / rel, lines)
        except _Linked:
            return None
    return hashlib.sha256("".join(lines).encode()).hexdigest()


class ProjectStatus:
    """One `dvc status` of the whole project, started at once and read when needed.

    `dvc repro T1 T2 ...` re-reads dvc.yaml and dvc.lock once per target, which makes a no-op
    run slow with many SKUs; one status call answers "is anything to do?" at the cost of one
    read, and runs while skuforge checks the host. When the workspace is as it was at the last
    answer (``workspace_state``), that answer is reused and dvc does not start.
    """

    def __init__(self, root: Path):
        self.root = root
        self.key = workspace_state(root)
        self.proc: subprocess.Popen[str] | None = None
        self._status: dict[str, Any] | None = self._remembered()
        self.reused = self._status is not None
        if not self.reused:
            self.proc = subprocess.Popen(
                [_dvc(root), "status", "--json"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )

    def _remembered(self) -> dict[str, Any] | None:
        if self.key is None:
            return None
        try:
            memo = json.loads((self.root / STATUS_MEMO).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        ok = isinstance(memo, dict) and memo.get("state") == self.key and isinstance(memo.get("status"), dict)
        return memo["status"] if ok else None

    def cancel(self) -> None:
        """Stop the status run: what it reads changed since it started. DVC is asked to stop (Ctrl-C)
        and killed only when it does not; either way it may have died between truncating its
        rwlock file and writing it again, which every later dvc call would refuse as corrupted."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=CANCEL_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
            drop_torn_rwlock(self.root)
        self._status = None

    def changes(self) -> dict[str, Any] | None:
        """Stage address -> what DVC found changed, for every stage it would run; None when the
        status could not be read."""
        if self.proc is not None and self.proc.returncode is None:
            out, _ = self.proc.communicate()
            try:
                status = json.loads(out) if self.proc.returncode == 0 else None
            except ValueError:
                status = None
            self._status = status if isinstance(status, dict) else None
            # remembered only when nothing changed while dvc looked
            if self._status is not None and self.key is not None and workspace_state(self.root) == self.key:
                with contextlib.suppress(OSError):  # a read-only .dvc/tmp: the next run asks dvc again
                    atomic_write_json(self.root / STATUS_MEMO, {"state": self.key, "status": self._status})
        return self._status

    def stale(self, stages: set[str]) -> list[str] | None:
        """Which of ``stages`` DVC would run; None when the status could not be read."""
        status = self.changes()
        return None if status is None else sorted(set(status) & stages)


def drop_torn_rwlock(root: Path) -> bool:
    """Remove ``.dvc/tmp/rwlock`` when it is not JSON (a dvc process stopped mid-write: DVC rewrites the
    file in place and refuses to start while it is torn); DVC makes a missing one afresh. A
    readable file is left alone: its locks may be another process's. Returns whether it removed one."""
    path = root / ".dvc" / "tmp" / "rwlock"
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return True
    return False


class DvcFailed(SkuforgeError):
    """``dvc repro`` failed; carries the exit code of the stage command that failed.

    ``stage_failed`` is true when stage commands failed (their outcome records say why) and dvc
    itself did not: the caller can then show the matrix instead of this message.
    """

    stage_failed = False


# How long dvc gets to stop its stage command and write its lock after Ctrl-C.
INTERRUPT_GRACE_S = 10.0
# How long a cancelled `dvc status` gets to stop after Ctrl-C before it is killed.
CANCEL_GRACE_S = 5.0


def run_dvc_repro(
    root: Path, dvc_targets: list[str], force: bool = False, dry: bool = False, keep_going: bool = False
) -> None:
    """Run ``dvc repro`` (``dvc status`` when ``dry``), its output passed on to stderr; DvcFailed when it fails.

    With ``keep_going`` dvc runs every stage whose upstream did not fail. dvc runs in its own process
    group: on Ctrl-C or SIGTERM this passes SIGINT to the group (dvc and the stage command unwind,
    removing their temporaries), escalates to SIGTERM and SIGKILL after INTERRUPT_GRACE_S each, ends
    any process left under it, then raises the KeyboardInterrupt on.
    """
    dvc = _dvc(root)
    # `dvc repro --dry` hashes dependencies that no stage has made yet and fails in a new
    # project; `dvc status` answers "what would run" without that.
    cmd = (
        [dvc, "status", "--with-deps", *dvc_targets]
        if dry
        else [dvc, "repro", *(["--force"] if force else []), *(["--keep-going"] if keep_going else []), *dvc_targets]
    )
    # its own process group: on Ctrl-C or SIGTERM (to this process alone or to the terminal's group)
    # the whole tree under dvc is stopped on purpose, stage commands and their workers included
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
        preexec_fn=_sigint_default,
    )
    tail: list[str] = []
    exits: list[str] = []  # dvc's "failed to run: ..., exited with N" lines, however early they came
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = redact(line)
            sys.stderr.write(line)
            tail = (tail + [line])[-50:]
            if "exited with" in line:
                exits.append(line)
        returncode = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (processes.Terminated)
        sys.stderr.write(redact(stop_group(proc, INTERRUPT_GRACE_S)))
        raise
    if returncode != 0:
        # a stage that failed early in a long run is far above the tail: its exit line is kept apart
        raise dvc_failure(root, returncode, "".join([line for line in exits if line not in tail] + tail))


def _sigint_default() -> None:
    """In dvc's process: SIGINT's default action, so the SIGINT this process forwards stops it even
    when a shell started skuforge in the background with SIGINT ignored (children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def dvc_failure(root: Path, returncode: int, text: str) -> DvcFailed:
    """Why ``dvc`` exited with ``returncode`` after printing ``text``, with the exit code to pass on."""
    text = _ANSI.sub("", text)
    killed = _signal(returncode)
    if killed:  # OOM killer, a CI timeout, kill -9: nothing in dvc.yaml to fix
        return _failed(
            f"dvc was killed by {killed} (exit {returncode}) before it finished",
            3,
            "something stopped it from outside (out of memory? a CI timeout?): run `skuforge repro` "
            "again; the stages that finished are kept",
        )
    if "Unable to acquire lock" in text or "is being blocked by" in text:
        lock, holder = _lock_holder(root, text)
        return _failed(
            f"another dvc process is running in this workspace ({holder}): dvc could not take {lock}",
            3,
            f"wait for it to finish (or stop it), then run again; if no such process is running, "
            f"remove {lock} and run again",
        )
    code = re.findall(r"exited with (-?\d+)", text)
    if code:  # a stage command failed: pass its exit code on
        statuses = [int(c) for c in code]
        killed = next((k for k in map(_signal, statuses) if k), None)
        if killed in CRASH_SIGNALS:  # the stage's own process broke (a native library), nothing outside
            err = _failed(
                f"dvc failed: {_first_error(text)}: the stage crashed ({killed}, in native code)",
                70,
                "a compiler or runtime library crashed inside the stage: run the stage command alone "
                "(dvc.yaml) with -v to see where, and report it with the model; the other pairs' "
                "outcomes are in the matrix",
            )
            err.stage_failed = True
            return err
        if killed:
            err = _failed(
                f"dvc failed: {_first_error(text)}: the stage was killed by {killed}",
                3,
                "something stopped it from outside (out of memory? a CI timeout?): run `skuforge repro` "
                "again; the stages that finished are kept",
            )
            err.stage_failed = True
            return err
        worst = max(s if s in (1, 2, 3, 4) else 70 for s in statuses)
        err = _failed(f"dvc failed: {_first_error(text)}", worst, "the failing stage's own message is above")
        err.stage_failed = True
        return err
    if _first_error(text, None) is None and re.search(
        r"dvc\.yaml|dvc\.lock|params\.yaml|is invalid", _first_lines(text, 1)
    ):
        # dvc's parse errors come without the ERROR prefix, their explanation below the first line
        return _failed(f"dvc failed: {_first_lines(text)}", 2, _refused_hint(text))
    if _first_error(text, None) is None:  # no ERROR line: dvc itself broke; its own last words say why
        return _failed(
            f"dvc exited with {returncode}: {_last_lines(text) or 'no output'}",
            3,
            f"run `dvc repro` in {root} to see dvc's whole output; `dvc doctor` checks its installation",
        )
    # dvc refused the pipeline itself (dvc.yaml, params.yaml, missing dependency)
    return _failed(f"dvc failed: {_first_error(text)}", 2, _refused_hint(text))


def _refused_hint(text: str) -> str:
    """What to do when dvc refused a file: dvc.lock is dvc's own record, rebuilt when deleted."""
    if "dvc.lock" in text and "dvc.yaml" not in text and "params.yaml" not in text:
        return "dvc.lock is dvc's record of the last run: delete it and run `skuforge repro` again to rebuild it"
    return "fix dvc.yaml / params.yaml as dvc says"


def _failed(message: str, exit_code: int, hint: str) -> DvcFailed:
    err = DvcFailed(message, hint=hint)
    err.exit_code = exit_code
    return err


# signals a process sends itself when it breaks (abort(), a bad memory access), not sent from outside
CRASH_SIGNALS = frozenset({"SIGABRT", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE"})


def _signal(status: int) -> str | None:
    """The signal's name when ``status`` says a process died of one (-9 from Python, 137 from a shell)."""
    number = -status if status < 0 else status - 128 if 128 < status < 128 + 65 else 0
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return None


def _lock_holder(root: Path, text: str) -> tuple[Path, str]:
    """The lock dvc could not take and who holds it (pid and command line), as far as it can be told."""
    tmp = root / ".dvc" / "tmp"
    blocked = re.findall(r"\(PID (\d+)\): (.+)", text)  # the rwlock's own words
    if blocked:
        return tmp / "rwlock", ", ".join(f"pid {pid}: {cmd.strip()}" for pid, cmd in blocked)
    lock = tmp / "lock"
    try:  # zc.lockfile writes " <pid>\n" into the lock it holds
        pid = int(lock.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return lock, "its pid is not recorded"
    try:
        cmd = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
    except OSError:
        cmd = ""
    cmd = cmd if len(cmd) <= 200 else cmd[:200] + "…"
    return lock, f"pid {pid}: {redact(cmd)}" if cmd else f"pid {pid}"


# colour codes and the carriage returns of progress bars, so "ERROR" is found at a line's start
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def _last_lines(text: str, count: int = 3) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " / ".join(lines[-count:])


def _first_lines(text: str, count: int = 4) -> str:
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    return " / ".join(lines[:count])


def _first_error(text: str, default: str | None = "") -> str | None:
    """dvc's first ERROR line with the lines that explain it (up to three); without one, ``default``
    (by default dvc's last lines: never a bare "see above" when above may be empty)."""
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("ERROR"):
            more = []
            for nxt in lines[i + 1 : i + 4]:
                if not nxt or nxt.startswith(("ERROR", "WARNING", "Running stage", "Having any troubles")):
                    break
                more.append(nxt)
            return " / ".join([line.removeprefix("ERROR:").strip(), *more])
    if default == "":
        return _last_lines(text) or "no output"
    return default


# --- outcome records: what a stage command's failure was, where DVC does not look -------------


def clear_outcomes(registry: Registry, dvc_targets: list[str]) -> None:
    """Forget the recorded failures of every stage the targets depend on: the run about to start
    records them again where they still fail (a stage dvc skips as up to date has succeeded)."""
    for name in upstream_stages(registry, dvc_targets):
        stage, item, sku = parse_address(name)
        if item is None:
            clear_outcome(registry.root, stage)
        elif stage in MODEL_STAGES:
            clear_outcome(registry.root, stage, item)
        elif stage in (*PAIR_STAGES, EMULATE_STAGE) and sku is not None:
            clear_outcome(registry.root, stage, item, sku)
