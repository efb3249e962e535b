"""This host's peaks: measured once (through the CLI), cached per host key, remeasured on request."""

from __future__ import annotations

import json

import models
import pytest
from test_runner_cli import skuforge

from pipeline.core.io import atomic_write_json
from pipeline.host import peaks
from pipeline.host.peaks import BandwidthPeaks, ComputePeaks, Peaks


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(peaks.ENV_CACHE_DIR, str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake(calls: list) -> callable:
    def measure(budget_s: float = 10.0) -> Peaks:
        calls.append(1)
        key, host = peaks.host_key()
        return Peaks(
            key=key,
            host=host,
            measured_at="2026-01-01T00:00:00+00:00",
            seconds=0.1,
            one_core_method="threadpoolctl",
            compute_gflops=ComputePeaks(all_cores=float(len(calls)), one_core=1.0, matmul_n=2048),
            bandwidth_gbs=BandwidthPeaks(triad=1.0, memcopy=1.0, triad_one_core=1.0, array_mb=256),
        )

    return measure


def test_second_call_reads_the_cache(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(peaks, "measure", fake(calls))
    first = peaks.host_peaks()
    assert peaks.host_peaks() == first and len(calls) == 1
    key, _ = peaks.host_key()
    assert peaks.cache_file() == cache / f"peaks-{key}.json" and peaks.cache_file().is_file()
    assert peaks.host_peaks(refresh=True).compute_gflops.all_cores == 2.0 and len(calls) == 2
    assert peaks.host_peaks().compute_gflops.all_cores == 2.0 and len(calls) == 2  # the refreshed figures were cached


def test_unreadable_cache_is_measured_again(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(peaks, "measure", fake(calls))
    cache.mkdir()
    peaks.cache_file().write_text("{not json")
    assert peaks.host_peaks().key == peaks.host_key()[0] and len(calls) == 1
    atomic_write_json(peaks.cache_file(), {"key": "other"})
    peaks.host_peaks()
    assert len(calls) == 2


def test_key_changes_with_the_flags_and_cores(cache, monkeypatch):
    monkeypatch.setenv("SKUFORGE_FAKE_CPU_FLAGS", "avx2 fma")
    avx2, _ = peaks.host_key()
    monkeypatch.setenv("SKUFORGE_FAKE_CPU_FLAGS", "avx2 fma avx512f")
    avx512, record = peaks.host_key()
    assert avx2 != avx512 and peaks.cache_file(avx2) != peaks.cache_file(avx512)
    monkeypatch.setattr(peaks.probe, "usable_cores", lambda: 1)
    assert peaks.host_key()[0] != avx512
    assert {"cpu_model", "usable_cores", "numpy", "blas", "flags_sha256"} == set(record)


def test_xdg_cache_home_is_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv(peaks.ENV_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peaks.cache_dir() == tmp_path / "skuforge"


def test_nominal_peak_from_flags_and_clock():
    assert peaks.nominal_gflops(2, frozenset({"avx2", "fma"}), 2500.0)[0] == 2 * 8 * 2 * 2.5
    assert peaks.nominal_gflops(4, frozenset({"avx512f", "fma"}), 2000.0)[0] == 4 * 16 * 2 * 2.0
    assert peaks.nominal_gflops(2, frozenset({"sse2"}), 2500.0) == (None, None)
    assert peaks.nominal_gflops(2, frozenset({"avx2", "fma"}), 0.0) == (None, None)  # no clock reported


def test_probe_peaks_measures_once_then_reads_the_cache(cache, monkeypatch, tmp_path):
    # a project of one ONNX Runtime SKU: the probe's SKU checks would import every compiler stack
    models.write_project(tmp_path / "project", {"m": models.conv_bn_spec()}, {"cpu": models.ort_sku()})
    done = skuforge("runner", "probe", "--peaks", cwd=tmp_path / "project")
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout)["peaks"]
    compute, memory = measured["compute_gflops"], measured["bandwidth_gbs"]
    # plausible for any CPU from a phone to a server, loaded or not
    assert 0.5 < compute["one_core"] < 5000 and 0.5 < compute["all_cores"] < 100000
    assert 0.3 < memory["triad"] < 5000 and 0.3 < memory["memcopy"] < 5000 and 0.3 < memory["triad_one_core"] < 5000
    assert compute["nominal"] is None or compute["nominal"] > 1
    # how long it took is a figure of this host's load, not a claim (measure's budget bounds its repeats)
    assert measured["seconds"] > 0 and measured["key"] == peaks.host_key()[0]
    assert Peaks.model_validate(json.loads(peaks.cache_file().read_text())).to_json() == measured

    monkeypatch.setattr(peaks, "measure", lambda budget_s=10.0: pytest.fail("the cache was not used"))
    assert peaks.host_peaks().to_json() == measured
