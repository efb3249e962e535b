"""This host's peaks: measured once (through the CLI), cached per host key, remeasured on request; the
INT8 peak measured through ONNX Runtime and its nominal figure from the CPU flags."""

from __future__ import annotations

import json
import math

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
            int8_gops=ComputePeaks(all_cores=4.0, one_core=2.0, matmul_n=512),
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


def test_a_cache_without_the_int8_peak_is_measured_again(cache, monkeypatch):
    """A file written before the INT8 peak, even at this host's key, is measured again, never read
    with the FP32 figures standing in for INT8 ones."""
    calls = []
    monkeypatch.setattr(peaks, "measure", fake(calls))
    old = fake([])().to_json()
    del old["int8_gops"]
    cache.mkdir()
    atomic_write_json(peaks.cache_file(), old)
    measured = peaks.host_peaks()
    assert len(calls) == 1 and measured.int8_gops.all_cores == 4.0
    assert "int8_gops" in json.loads(peaks.cache_file().read_text())  # the new figures replaced it
    assert peaks.host_peaks() == measured and len(calls) == 1


def test_the_key_of_an_older_format_differs(monkeypatch):
    """The format is part of the key: an older skuforge's file (format 1) has another name."""
    now, record = peaks.host_key()
    monkeypatch.setattr(peaks, "FORMAT", 1)
    assert peaks.host_key()[0] != now and record["format"] == 2


def test_key_changes_with_the_flags_and_cores(cache, monkeypatch):
    monkeypatch.setenv("SKUFORGE_FAKE_CPU_FLAGS", "avx2 fma")
    avx2, _ = peaks.host_key()
    monkeypatch.setenv("SKUFORGE_FAKE_CPU_FLAGS", "avx2 fma avx512f")
    avx512, record = peaks.host_key()
    assert avx2 != avx512 and peaks.cache_file(avx2) != peaks.cache_file(avx512)
    monkeypatch.setattr(peaks.probe, "usable_cores", lambda: 1)
    assert peaks.host_key()[0] != avx512
    assert {"format", "cpu_model", "usable_cores", "numpy", "blas", "onnxruntime", "flags_sha256"} == set(record)


def test_xdg_cache_home_is_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv(peaks.ENV_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peaks.cache_dir() == tmp_path / "skuforge"


def test_nominal_peak_from_flags_and_clock():
    assert peaks.nominal_gflops(2, frozenset({"avx2", "fma"}), 2500.0)[0] == 2 * 8 * 2 * 2.5
    assert peaks.nominal_gflops(4, frozenset({"avx512f", "fma"}), 2000.0)[0] == 4 * 16 * 2 * 2.0
    assert peaks.nominal_gflops(2, frozenset({"sse2"}), 2500.0) == (None, None)
    assert peaks.nominal_gflops(2, frozenset({"avx2", "fma"}), 0.0) == (None, None)  # no clock reported


@pytest.mark.parametrize(
    "flags, macs, instruction",
    [
        # the best dot product the flags allow wins: VNNI over AVX-512BW over AVX2
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}, 64, "AVX-512 VNNI vpdpbusd"),
        ({"avx2", "fma", "avx_vnni"}, 32, "AVX-VNNI vpdpbusd"),
        ({"avx2", "fma", "avx512f", "avx512bw"}, 32, "AVX-512BW vpmaddubsw+vpmaddwd"),
        ({"avx2", "fma"}, 16, "AVX2 vpmaddubsw+vpmaddwd"),
        ({"asimd", "asimddp"}, 16, "Arm dot product sdot"),
        ({"asimd", "asimddp", "i8mm"}, 32, "Arm I8MM smmla"),
    ],
)
def test_nominal_int8_peak_from_the_dot_product_the_flags_allow(flags, macs, instruction):
    value, basis = peaks.nominal_int8_gops(4, frozenset(flags), 2500.0)
    assert value == 4 * macs * 2 * 2.5
    assert basis.startswith(f"4 cores × {macs} 8-bit multiply-adds per cycle ({instruction}: ")
    # at least twice the FP32 FMA rate of the same vector width (AVX2: 2x; VNNI, sdot: 4x)
    fp32 = peaks.nominal_gflops(4, frozenset(flags), 2500.0)[0]
    assert fp32 is not None and value >= 2 * fp32


@pytest.mark.parametrize("flags", [{"sse2", "sse4_2"}, {"asimd"}, set()])
def test_no_nominal_int8_peak_without_a_dot_product(flags):
    assert peaks.nominal_int8_gops(4, frozenset(flags), 2500.0) == (None, None)
    assert peaks.nominal_int8_gops(4, frozenset({"avx2"}), 0.0) == (None, None)  # no clock reported


def test_int8_peak_is_measured_through_onnxruntime():
    one = peaks.int8_gops(1, repeats=3, seconds=1.0)
    assert one > 0 and math.isfinite(one)
    # plausible for any CPU from a phone to a server, loaded or not (the integer GEMM ran, and ran once
    # per call: a rate far above the flags' nominal would mean the work was skipped)
    nominal = peaks.nominal_int8_gops(1)[0]
    assert 0.5 < one < (4 * nominal if nominal else 20000)


def test_probe_peaks_measures_once_then_reads_the_cache(cache, monkeypatch, tmp_path):
    # a project of one ONNX Runtime SKU: the probe's SKU checks would import every compiler stack
    models.write_project(tmp_path / "project", {"m": models.conv_bn_spec()}, {"cpu": models.ort_sku()})
    done = skuforge("runner", "probe", "--peaks", cwd=tmp_path / "project")
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout)["peaks"]
    compute, int8, memory = measured["compute_gflops"], measured["int8_gops"], measured["bandwidth_gbs"]
    # plausible for any CPU from a phone to a server, loaded or not
    assert 0.5 < compute["one_core"] < 5000 and 0.5 < compute["all_cores"] < 100000
    assert 0.5 < int8["one_core"] < 20000 and 0.5 < int8["all_cores"] < 400000 and int8["matmul_n"] == 512
    assert (int8["nominal"] is None) == (int8["nominal_basis"] is None)
    assert 0.3 < memory["triad"] < 5000 and 0.3 < memory["memcopy"] < 5000 and 0.3 < memory["triad_one_core"] < 5000
    assert compute["nominal"] is None or compute["nominal"] > 1
    # how long it took is a figure of this host's load, not a claim (measure's budget bounds its repeats)
    assert measured["seconds"] > 0 and measured["key"] == peaks.host_key()[0]
    assert Peaks.model_validate(json.loads(peaks.cache_file().read_text())).to_json() == measured

    monkeypatch.setattr(peaks, "measure", lambda budget_s=10.0: pytest.fail("the cache was not used"))
    assert peaks.host_peaks().to_json() == measured
