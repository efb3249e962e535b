"""benchmarks/speedup.py's own logic: the samples its selection compares (per-round CPU time or
per-call wall time) and the copy of a checked-in TVM tuning database, which must pass the checks
a build makes. No tuning here: the database is the example's checked-in one."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from pipeline.project.config import load_registry

ROOT = Path(__file__).resolve().parents[2]
SKU, MODEL = "x86_tvm_fp32", "digits_cnn"  # the example's tuned pair: its database is checked in
HAS_TVM = importlib.util.find_spec("tvm") is not None

sys.path.insert(0, str(ROOT / "benchmarks"))
import speedup  # noqa: E402


def busy() -> None:
    """About 2 ms of CPU."""
    end = time.process_time() + 0.002
    while time.process_time() < end:
        pass


def test_cpu_objective_compares_per_round_cpu_time_per_call():
    rounds = 3
    timings = speedup.measure({"busy": busy, "sleeps": lambda: time.sleep(0.002)}, seconds=0.3, rounds=rounds)
    cpu = speedup.selection_samples(timings, "cpu")
    wall = speedup.selection_samples(timings, "wall")
    assert {k: len(v) for k, v in cpu.items()} == {"busy": rounds, "sleeps": rounds}  # one sample per round
    assert wall is timings.wall and len(wall["sleeps"]) > rounds  # one sample per call
    # a call that sleeps costs wall time and next to no CPU: the two objectives rank it differently
    assert min(wall["sleeps"]) >= 2.0
    assert max(cpu["sleeps"]) < min(cpu["busy"]) / 2
    assert min(cpu["busy"]) >= 1.9  # at least the 2 ms each call spends
    # the mean per call over all rounds is the rounds' CPU time over their calls
    total, calls = timings.cpu_total["busy"]
    assert timings.cpu_ms["busy"] == pytest.approx(total / calls)


def test_an_unknown_objective_is_refused_with_the_known_ones():
    timings = speedup.Timings({}, {}, {})
    with pytest.raises(ValueError, match="cpu, wall"):
        speedup.selection_samples(timings, "p99")


@pytest.fixture
def database(tmp_path: Path) -> Path:
    """A copy of the example's checked-in database, as benchmarks/tuning/<sku>/<model>/ holds one."""
    folder = tmp_path / "tuning" / SKU / MODEL
    shutil.copytree(ROOT / "caches" / SKU / MODEL, folder)
    return folder


@pytest.mark.skipif(not HAS_TVM, reason="apache-tvm is not installed: the database's key cannot be checked")
def test_a_database_that_passes_the_build_checks_is_copied_with_only_its_listed_files(database, tmp_path):
    spec = load_registry(ROOT / "params.yaml").sku(SKU)
    (database / ".notes.swp").write_text("an editor's file")
    dest = tmp_path / "project" / "caches" / SKU / MODEL
    dest.parent.mkdir(parents=True)
    assert speedup.checked_in_database(SKU, MODEL, tmp_path / "tuning") == database
    trials = speedup.install_database(database, dest, SKU, MODEL, spec)
    index = json.loads((database / "cache.json").read_text())
    assert trials == index["trials"]
    listed = {f["path"] for f in index["files"]}
    assert {p.name for p in dest.iterdir()} == listed | {"cache.json"}
    for name in listed:
        assert (dest / name).read_bytes() == (database / name).read_bytes()


@pytest.mark.skipif(not HAS_TVM, reason="apache-tvm is not installed: the database's key cannot be checked")
def test_a_database_whose_file_differs_from_its_index_digest_is_refused(database, tmp_path):
    spec = load_registry(ROOT / "params.yaml").sku(SKU)
    records = database / "database_tuning_record.json"
    data = bytearray(records.read_bytes())
    data[-2] = ord("0") if data[-2] != ord("0") else ord("1")  # same size, other content
    records.write_bytes(bytes(data))
    dest = tmp_path / "project" / "caches" / SKU / MODEL
    dest.parent.mkdir(parents=True)
    with pytest.raises(speedup.DatabaseRefused, match="differs from its sha256"):
        speedup.install_database(database, dest, SKU, MODEL, spec)
    assert not dest.exists()  # nothing copied


def test_no_database_where_the_folder_has_no_index(tmp_path):
    (tmp_path / SKU / MODEL).mkdir(parents=True)
    assert speedup.checked_in_database(SKU, MODEL, tmp_path) is None
