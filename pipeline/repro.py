"""Which (model, SKU) pairs this host builds, running ``dvc repro`` for them, and a summary of
the manifests."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Registry
from .errors import EnvironmentProblem, InputError, SkuforgeError
from .redact import redact
from .runner.check import host_problems


@dataclass
class SkuStatus:
    sku: str
    backend: str
    precision: str
    target: str
    runner_labels: list[str]
    buildable: bool
    runnable: bool = False
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def sku_statuses(registry: Registry) -> list[SkuStatus]:
    out = []
    for name, spec in registry.skus.items():
        build = host_problems(registry, name, "build")
        run = host_problems(registry, name, "run")
        out.append(SkuStatus(sku=name, backend=spec.backend, precision=spec.precision,
                             target=f"{spec.target.arch}/{spec.target.device}/{spec.target.os}",
                             runner_labels=spec.runner_labels, buildable=not build, runnable=not run,
                             problems=list(dict.fromkeys(build + run))))
    return out


def targets(registry: Registry, models: list[str] | None, skus: list[str] | None,
            publish: bool = True) -> tuple[list[str], list[SkuStatus]]:
    """dvc targets for this host, and the SKUs it cannot take all the way.

    A SKU this host can build and run goes to its publish stage (its manifest with
    ``publish=False``); one it can only build (a cross-compiled engine) goes to its build stage,
    and its runner validates, benches and publishes it.
    """
    for m in models or []:
        registry.model(m)
    for s in skus or []:
        registry.sku(s)
    statuses = [s for s in sku_statuses(registry) if not skus or s.sku in skus]
    wanted_models = models or list(registry.models)
    last = PAIR_STAGES[-1] if publish else "manifest"
    out = [f"{last if s.runnable else 'build'}@{m}-{s.sku}" for m in wanted_models for s in statuses if s.buildable]
    return out, [s for s in statuses if not (s.buildable and s.runnable)]


# Stage families of dvc.yaml (tests/test_paths.py keeps them in step with it).
GLOBAL_STAGES = ("config",)
EXAMPLE_STAGES = ("export",)
MODEL_STAGES = ("prepare", "data", "reference", "calibrate")
PAIR_STAGES = ("build", "validate", "bench", "manifest", "publish")


def upstream_stages(registry: Registry, dvc_targets: list[str]) -> set[str]:
    """The dvc.yaml stages the targets depend on, targets included."""
    names: set[str] = set(GLOBAL_STAGES) | {f"{s}@{e}" for s in EXAMPLE_STAGES for e in registry.examples}
    for target in dvc_targets:
        stage, _, pair = target.partition("@")
        model, sku = next((m, pair[len(m) + 1:]) for m in registry.models if pair.startswith(f"{m}-"))
        names |= {f"{s}@{model}" for s in MODEL_STAGES}
        names |= {f"{s}@{model}-{sku}" for s in PAIR_STAGES[: PAIR_STAGES.index(stage) + 1]}
    return names


def _dvc(root: Path) -> str:
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    if not Path(dvc).exists():
        raise EnvironmentProblem("dvc is not installed", hint="pip install dvc (it comes with skuforge)")
    if not (root / ".dvc").is_dir():
        raise InputError(f"{root} is not a DVC repository", hint="run `git init && dvc init` in the project root")
    return dvc


class ProjectStatus:
    """One `dvc status` of the whole project, started at once and read when needed.

    `dvc repro T1 T2 ...` re-reads dvc.yaml and dvc.lock once per target, which makes a no-op
    run slow with many SKUs; one status call answers "is anything to do?" at the cost of one
    read, and runs while skuforge checks the host.
    """

    def __init__(self, root: Path):
        self.proc = subprocess.Popen([_dvc(root), "status", "--json"], cwd=root, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)

    def stale(self, stages: set[str]) -> list[str] | None:
        """Which of ``stages`` DVC would run; None when the status could not be read."""
        out, _ = self.proc.communicate()
        try:
            status = json.loads(out) if self.proc.returncode == 0 else None
        except ValueError:
            status = None
        return None if status is None else sorted(set(status) & stages)


class DvcFailed(SkuforgeError):
    """``dvc repro`` failed; carries the exit code of the stage command that failed."""


def run_dvc_repro(root: Path, dvc_targets: list[str], force: bool = False, dry: bool = False) -> None:
    dvc = _dvc(root)
    # `dvc repro --dry` hashes dependencies that no stage has made yet and fails in a new
    # project; `dvc status` answers "what would run" without that.
    cmd = [dvc, "status", "--with-deps", *dvc_targets] if dry else [dvc, "repro", *(["--force"] if force else []), *dvc_targets]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = redact(line)
        sys.stderr.write(line)
        tail = (tail + [line])[-50:]
    returncode = proc.wait()
    if returncode != 0:
        raise dvc_failure(root, returncode, "".join(tail))


def dvc_failure(root: Path, returncode: int, text: str) -> DvcFailed:
    """Why ``dvc`` exited with ``returncode`` after printing ``text``, with the exit code to pass on."""
    killed = _signal(returncode)
    if killed:  # OOM killer, a CI timeout, kill -9: nothing in dvc.yaml to fix
        return _failed(f"dvc was killed by {killed} (exit {returncode}) before it finished", 3,
                       "something stopped it from outside (out of memory? a CI timeout?): run `skuforge repro` "
                       "again; the stages that finished are kept")
    if "Unable to acquire lock" in text or "is being blocked by" in text:
        lock, holder = _lock_holder(root, text)
        return _failed(f"another dvc process is running in this workspace ({holder}): dvc could not take {lock}", 3,
                       f"wait for it to finish (or stop it), then run again; if no such process is running, "
                       f"remove {lock} and run again")
    code = re.findall(r"exited with (-?\d+)", text)
    if code:  # a stage command failed: pass its exit code on
        status = int(code[-1])
        killed = _signal(status)
        if killed:
            return _failed(f"dvc failed: {_first_error(text)}: the stage was killed by {killed}", 3,
                           "something stopped it from outside (out of memory? a CI timeout?): run `skuforge repro` "
                           "again; the stages that finished are kept")
        return _failed(f"dvc failed: {_first_error(text)}", status if status in (1, 2, 3, 4) else 70,
                       "the failing stage's own message is above")
    if _first_error(text, None) is None:  # no ERROR line: dvc itself broke; its own last words say why
        return _failed(f"dvc exited with {returncode}: {_last_lines(text) or 'no output'}", 3,
                       f"run `dvc repro` in {root} to see dvc's whole output; `dvc doctor` checks its installation")
    # dvc refused the pipeline itself (dvc.yaml, params.yaml, missing dependency)
    return _failed(f"dvc failed: {_first_error(text)}", 2, "fix dvc.yaml / params.yaml as dvc says above")


def _failed(message: str, exit_code: int, hint: str) -> DvcFailed:
    err = DvcFailed(message, hint=hint)
    err.exit_code = exit_code
    return err


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


def _last_lines(text: str, count: int = 3) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " / ".join(lines[-count:])


def _first_error(text: str, default: str | None = "see the output above") -> str | None:
    for line in text.splitlines():
        if line.startswith("ERROR"):
            return line.removeprefix("ERROR: ").strip()
    return default


def summary(registry: Registry) -> list[dict[str, Any]]:
    """One row per manifest present: gate results, metric deltas, latency."""
    from .manifest import load_manifest
    from .paths import Layout

    rows = []
    out = Layout(registry.root)
    for model in registry.models:
        for sku in registry.skus:
            path = out.manifest(model, sku)
            if not path.is_file():
                continue
            m = load_manifest(path)
            receipt = out.report(model, sku, "publish")  # the MLflow version this checkout published
            try:
                published = json.loads(receipt.read_text()) if receipt.is_file() else {}
            except ValueError:
                published = {}
            metrics = {x.split: x for x in m.correctness.metrics}
            rows.append({
                "model": model, "sku": sku, "backend": m.backend, "precision": m.precision,
                "passed": m.correctness.passed, "build_s": m.build.seconds,
                "layers": len(m.layers), "fused_layers": sum(1 for layer in m.layers if len(layer.fused_from) > 1),
                "max_abs_error": max((o.max_abs_error for o in m.correctness.outputs), default=None),
                **{f"{k}_reference": v.reference for k, v in metrics.items()},
                **{f"{k}_delta": v.delta for k, v in metrics.items()},
                "p50_ms": m.benchmark.engine_only.p50_ms, "p99_ms": m.benchmark.engine_only.p99_ms,
                "e2e_p50_ms": m.benchmark.end_to_end.p50_ms, "throughput_per_s": m.benchmark.throughput_per_s,
                "digest": m.digest[:12],
                "mlflow": f"v{published['version']}" if published.get("digest") == m.digest else None,
            })
    return rows
