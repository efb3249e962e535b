"""The per-SKU pipeline files, rendered from the registry, and the .dvcignore files that hide from
DVC the SKUs this host cannot build (or can only build).

dvc.yaml holds the stages run once per project, example and model. The (model, SKU) stages live in
one folder per SKU, so that a host can hide a SKU from DVC with a .dvcignore (DVC collects every
dvc.yaml in the workspace and honours a .dvcignore inside a subfolder):

- ``pipelines/<sku>/dvc.yaml``: build, which any host that can build the SKU runs;
- ``pipelines/<sku>/run/dvc.yaml``: validate, bench, manifest and publish, which need the target;
- ``pipelines/<sku>/emulated/dvc.yaml`` (an aarch64 CPU SKU, pipeline/backends/emulated): emulate,
  which an x86-64 host with QEMU runs instead of the target's stages.

Each stage runs at the project root (``wdir``), so its command and its paths in the lock are those
of a root stage. Each file has its own dvc.lock next to it: the SKU's CI job writes it. The files are
deterministic and committed, like the workflows; `skuforge repro` renders them before it runs dvc
(a no-op when current) and `skuforge config validate` says when they are stale.

``hide_from_dvc`` writes the git-ignored ``.dvcignore`` files: after `skuforge repro`, ``dvc status``
and ``dvc repro -P`` see only what this host runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.io import atomic_write_bytes
from pipeline.engine.hostcheck import can_emulate
from pipeline.engine.matrix import PAIR_STAGES, PIPELINES_DIR, RUN_STAGES, SkuStatus, emulated_file, pipeline_file
from pipeline.project.config import Registry

# The first line of every rendered file: what render removes when its SKU is gone, and nothing else.
HEADER = "# Rendered from params.yaml by `skuforge repro` (pipeline/ops/pipelines.py): do not edit."
IGNORE_HEADER = "# Written by `skuforge repro` for this host (git-ignored):"

_BUILD = """\
[[header]]
# The stages of SKU [[sku]] every host that can build it runs; pipelines/[[sku]]/run/dvc.yaml holds
# those that need the target. Each runs at the project root (wdir), as dvc.yaml's stages do.
stages:
  build:
    foreach: [[models]]
    do:
      wdir: ../..
      cmd: skuforge build --model '${item}' --sku '[[sku]]'
      deps:
        - build/config/${item}-[[sku]].json
        - build/${item}/prepared
        - build/${item}/data
        - build/${item}/calibration
        # read only when skus.[[sku]].bisect.fix_during_build judges the engine during the build
        - build/${item}/reference
      outs:
        - build/${item}/[[sku]]/engine
        - build/${item}/[[sku]]/build.json
        # timing caches / tuning logs: read and updated by the build, checked into git
        - caches/[[sku]]/${item}:
            persist: true
            cache: false
"""

_RUN = """\
[[header]]
# The stages of SKU [[sku]] that need the target itself: a host that can only build the SKU hides
# this file (.dvcignore) and the SKU's runner runs them. Each runs at the project root (wdir).
stages:
  validate:
    foreach: [[models]]
    do:
      wdir: ../../..
      cmd: skuforge validate --model '${item}' --sku '[[sku]]'
      deps:
        - build/config/${item}-[[sku]].json
        - build/${item}/[[sku]]/engine
        - build/${item}/[[sku]]/build.json
        - build/${item}/data
        - build/${item}/reference
        # a failing engine is bisected: rebuilt from the prepared model (and calibration table)
        - build/${item}/prepared
        - build/${item}/calibration
      # outputs.npz: the engine's golden outputs, which `skuforge compare` sets against every other SKU's
      outs:
        - build/${item}/[[sku]]/validate.json
        - build/${item}/[[sku]]/outputs.npz

  bench:
    foreach: [[models]]
    do:
      wdir: ../../..
      cmd: skuforge bench --model '${item}' --sku '[[sku]]'
      deps:
        - build/config/${item}-[[sku]].json
        - build/${item}/[[sku]]/engine
        - build/${item}/[[sku]]/build.json
        - build/${item}/[[sku]]/validate.json
        - build/${item}/data/golden.npz
        - build/${item}/data/golden.raw.npz
      # plain outputs, not stage `metrics:`/`plots:`: dvc.yaml's top-level sections read the
      # git-tracked copies the manifest stage writes (docs/metrics.md)
      outs:
        - build/${item}/[[sku]]/timeline.csv
        - build/${item}/[[sku]]/bench.json
        - build/${item}/[[sku]]/latency.csv

  manifest:
    foreach: [[models]]
    do:
      wdir: ../../..
      cmd: skuforge manifest --model '${item}' --sku '[[sku]]'
      deps:
        - build/config/${item}-[[sku]].json
        - build/${item}/prepared/prepare.json
        - build/${item}/data/data.json
        - build/${item}/calibration
        - build/${item}/[[sku]]/build.json
        - build/${item}/[[sku]]/validate.json
        - build/${item}/[[sku]]/bench.json
        - build/${item}/[[sku]]/latency.csv
        - build/${item}/[[sku]]/timeline.csv
      # persist: the stage reads the manifest already there and keeps its benchmark figures when the
      # new run's lie within their intervals (docs/benchmarks.md), so it must not be deleted first.
      # metrics/: the git-tracked figures `dvc metrics` and `dvc plots` read (docs/metrics.md)
      outs:
        - manifests/${item}/[[sku]].json:
            cache: false
            persist: true
        - metrics/bench/${item}/[[sku]].json:
            cache: false
            persist: true
        - metrics/latency_cdf/${item}/[[sku]].csv:
            cache: false
            persist: true
        - metrics/timeline/${item}/[[sku]].csv:
            cache: false
            persist: true

  # An MLflow run and a registered version per engine, keyed by the manifest digest (idempotent).
  # publish.json is a local receipt (store, run, version): not cached, and `persist` keeps DVC's
  # run cache from restoring it without contacting the store.
  publish:
    foreach: [[models]]
    do:
      wdir: ../../..
      cmd: skuforge publish --model '${item}' --sku '[[sku]]'
      deps:
        - build/config/${item}-[[sku]].json
        - manifests/${item}/[[sku]].json
        - build/${item}/[[sku]]/engine
        - build/${item}/[[sku]]/build.json
        - build/${item}/[[sku]]/validate.json
        - build/${item}/[[sku]]/bench.json
        - build/${item}/[[sku]]/latency.csv
        - build/${item}/[[sku]]/timeline.csv
      outs:
        - build/${item}/[[sku]]/publish.json:
            cache: false
            persist: true
"""


_EMULATED = """\
[[header]]
# SKU [[sku]]'s engines validated under QEMU user-mode emulation on an x86-64 host (its aarch64 CPU):
# outputs judged by the same gates, never timings, into emulate.json (the device's validate.json is
# its runner's). Hidden (.dvcignore) on a host that does not emulate the SKU. Runs at the project root.
stages:
  emulate:
    foreach: [[models]]
    do:
      wdir: ../../..
      cmd: skuforge emulate --model '${item}' --sku '[[sku]]'
      deps:
        - build/config/${item}-[[sku]].json
        - build/${item}/[[sku]]/engine
        - build/${item}/[[sku]]/build.json
        - build/${item}/data
        - build/${item}/reference
      outs:
        - build/${item}/[[sku]]/emulate.json
        - build/${item}/[[sku]]/emulate_outputs.npz
"""


def pipeline_files(registry: Registry) -> dict[str, str]:
    """Relative path -> text of every per-SKU pipeline file: one pair per SKU some model selects,
    listing only those models (Registry.pairs). SKU and model names obey the registry's name rule,
    so they go in as they are; the model list is JSON, which YAML reads as a flow list."""
    models: dict[str, list[str]] = {}
    for model, sku in registry.pairs():
        models.setdefault(sku, []).append(model)
    files = {}
    for sku, names in models.items():
        templates = [(_BUILD, pipeline_file(sku, False)), (_RUN, pipeline_file(sku, True))]
        if can_emulate(registry.skus[sku]):
            templates.append((_EMULATED, emulated_file(sku)))
        for template, name in templates:
            text = template.replace("[[header]]", HEADER).replace("[[sku]]", sku)
            files[name] = text.replace("[[models]]", json.dumps(names))
    return files


@dataclass
class PipelinesResult:
    files: list[str]  # every rendered file, relative to the project root
    differ: list[str]  # rendered files stale or missing on disk
    removed: list[str]  # rendered files of SKUs the registry no longer builds

    @property
    def current(self) -> bool:
        return not self.differ and not self.removed

    def to_json(self) -> dict[str, Any]:
        return {"files": self.files, "differ": self.differ, "removed": self.removed}


def render_pipelines(registry: Registry, check: bool = False) -> PipelinesResult:
    """Write the per-SKU pipeline files under the project root and remove the rendered files of
    SKUs no model selects any more (their dvc.lock stays: it is the SKU's record). Files already
    current are not touched, so a second run leaves git clean. With ``check`` nothing is written."""
    root = registry.root
    files = pipeline_files(registry)
    differ = []
    for name, text in files.items():
        path = root / name
        if path.is_file() and path.read_bytes() == text.encode():
            continue
        differ.append(name)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, text.encode())
    removed = []
    globs = ("*/dvc.yaml", "*/run/dvc.yaml", "*/emulated/dvc.yaml")
    for path in sorted(p for pattern in globs for p in root.glob(f"{PIPELINES_DIR}/{pattern}")):
        name = path.relative_to(root).as_posix()
        if name not in files and _rendered(path):
            removed.append(name)
            if not check:
                path.unlink()
    return PipelinesResult(list(files), differ, removed)


def move_pair_locks(registry: Registry) -> list[str]:
    """Move the (model, SKU) entries a root dvc.lock of the one-file layout holds (``build@<m>-<s>``)
    into the SKU's own locks (``build@<m>`` in pipelines/<s>/dvc.lock): the stages, their commands
    and paths are the same, so nothing re-runs for the move. An entry the SKU's lock already holds
    is newer there and wins. Returns the entries moved."""
    import yaml

    root_lock = registry.root / "dvc.lock"
    try:
        doc = yaml.safe_load(root_lock.read_text())
    except (OSError, yaml.YAMLError):
        return []  # none, or broken: dvc says which
    stages = doc.get("stages") if isinstance(doc, dict) else None
    if not isinstance(stages, dict):
        return []
    names = {f"{stage}@{m}-{s}": (stage, m, s) for m, s in registry.pairs() for stage in PAIR_STAGES}
    moving = [name for name in stages if name in names]
    if not moving:
        return []
    locks: dict[Path, dict[str, Any]] = {}
    for name in moving:
        stage, model, sku = names[name]
        lock = registry.root / Path(pipeline_file(sku, stage in RUN_STAGES)).with_name("dvc.lock")
        if lock not in locks:
            try:
                loaded = yaml.safe_load(lock.read_text()) if lock.is_file() else None
            except yaml.YAMLError:
                return []  # leave all as they are: dvc names the broken file
            locks[lock] = loaded if isinstance(loaded, dict) else {"schema": doc.get("schema", "2.0"), "stages": {}}
        locks[lock].setdefault("stages", {}).setdefault(f"{stage}@{model}", stages[name])
    for lock, content in locks.items():
        lock.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(lock, yaml.safe_dump(content, sort_keys=False).encode())
    doc["stages"] = {name: entry for name, entry in stages.items() if name not in names}
    atomic_write_bytes(root_lock, yaml.safe_dump(doc, sort_keys=False).encode())
    return moving


def _rendered(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.readline().rstrip("\n") == HEADER
    except OSError:
        return False


def hide_from_dvc(registry: Registry, statuses: list[SkuStatus]) -> tuple[list[str], bool]:
    """Write ``pipelines/<sku>/.dvcignore`` for each SKU this host cannot build, and
    ``pipelines/<sku>/run/.dvcignore`` for each it can build but not run; remove them where it can.
    DVC then leaves those stages out of ``dvc status`` and ``dvc repro -P`` here: they are another
    runner's. ``statuses``: every SKU's (sku_statuses). Returns the .dvcignore files in place, and
    whether any was written or removed (what DVC sees changed)."""
    root = registry.root
    hidden, changed = [], False
    for status in statuses:
        folder = root / PIPELINES_DIR / status.sku
        why = " ".join("; ".join(status.problems).split()) or "not for this host"  # one comment line
        places = (
            (folder, not status.buildable),
            (folder / "run", status.buildable and not status.runnable),
            (folder / "emulated", status.buildable and not status.emulated),
        )
        for place, hide in places:
            ignore = place / ".dvcignore"
            if hide and place.is_dir():
                needs = f"a runner with labels [{', '.join(status.runner_labels)}]"
                text = f"{IGNORE_HEADER} {why}; its stages run on {needs}\n*\n"
                if not ignore.is_file() or ignore.read_text(errors="replace") != text:
                    atomic_write_bytes(ignore, text.encode())
                    changed = True
                hidden.append(ignore.relative_to(root).as_posix())
            elif ignore.is_file() and ignore.read_text(errors="replace").startswith(IGNORE_HEADER):
                ignore.unlink()
                changed = True
    return hidden, changed
