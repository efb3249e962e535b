"""This host's peak FP32 compute and memory bandwidth, measured once and cached per host.

Compute: the best of a few large single-precision matmuls through numpy's BLAS on all usable cores
and on one core (threadpoolctl, or a subprocess with the BLAS thread variables at 1), and the
nominal peak where the CPU flags and clock give it. Bandwidth: a STREAM-like triad
(``a = b + s·c``) and copy over arrays far larger than the last-level cache, best of a few runs,
counted as STREAM does (bytes read and written by the kernel, no write-allocate traffic).

The cache key is what decides the figures: the CPU model and flags, the usable cores, and the
numpy and BLAS versions. The file is ``<cache dir>/peaks-<key>.json``, the cache dir
``$SKUFORGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/skuforge``, else ``~/.cache/skuforge``.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from pipeline.core.env import SKUFORGE_CACHE_DIR, process_environment
from pipeline.core.io import atomic_write_json, read_json, sha256_json
from pipeline.core.paths import cache_dir
from pipeline.host import probe
from pipeline.results.reports import Result

log = logging.getLogger(__name__)

ENV_CACHE_DIR = SKUFORGE_CACHE_DIR.name
"""Folder of skuforge's per-host caches (the peaks); default ``$XDG_CACHE_HOME/skuforge`` or ``~/.cache/skuforge``."""

ARRAY_MB = 128  # per bandwidth array, at least; 4x the last-level cache where that is larger
_BLOCK = 1 << 17  # triad elements per step: the temporary (512 KB) stays in cache
_BLAS_THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
# FP32 lanes of one FMA instruction, by the widest vector flag the CPU reports (x86: needs "fma")
_FMA_LANES = (("avx512f", 16), ("fma", 8), ("asimd", 4))


class ComputePeaks(Result):
    all_cores: float
    one_core: float
    nominal: float | None = None
    nominal_basis: str | None = None
    matmul_n: int


class BandwidthPeaks(Result):
    triad: float
    memcopy: float
    triad_one_core: float
    array_mb: int


class Peaks(Result):
    key: str
    host: dict[str, Any]
    measured_at: str
    seconds: float
    one_core_method: Literal["threadpoolctl", "subprocess"]
    compute_gflops: ComputePeaks
    bandwidth_gbs: BandwidthPeaks


def _blas() -> str:
    import numpy as np

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')}"
    except (TypeError, KeyError):  # numpy < 1.25 has no mode="dicts"
        return "unknown"


def host_key() -> tuple[str, dict[str, Any]]:
    """The cache key and what it is made of (flags as their hash, to keep the record short)."""
    import numpy as np

    cpu = probe.cpu_info()
    basis = {
        "cpu_model": cpu["model"],
        "flags": cpu["flags"],
        "usable_cores": probe.usable_cores(),
        "numpy": np.__version__,
        "blas": _blas(),
    }
    record = {k: v for k, v in basis.items() if k != "flags"} | {"flags_sha256": sha256_json(cpu["flags"])}
    return sha256_json(basis)[:16], record


def cache_file(key: str | None = None) -> Path:
    return cache_dir() / f"peaks-{key or host_key()[0]}.json"


def host_peaks(refresh: bool = False) -> Peaks:
    """This host's peaks: from the cache, else measured (``refresh``: always) and cached."""
    key, _ = host_key()
    path = cache_file(key)
    if not refresh and path.is_file():
        try:
            cached = Peaks.model_validate(read_json(path))
            if cached.key == key:
                return cached
            log.info("peaks cache %s is for host key %s, not %s: measuring", path, cached.key, key)
        except (ValueError, ValidationError) as exc:
            log.warning("peaks cache %s is unreadable (%s): measuring again", path, str(exc).splitlines()[0])
    peaks = measure()
    atomic_write_json(path, peaks.to_json())
    return peaks


# --- measuring ----------------------------------------------------------------------------------


def _matmul_size(cores: int) -> int:
    """A matmul that BLAS runs near its peak, about 0.1 to 0.3 s at a few tens of GFLOP/s per
    core, in multiples of 256: 1536 on one or two cores, growing with the cube root of the cores."""
    return min(8192, 256 * round(6 * (max(cores, 2) / 2) ** (1 / 3)))


def _gemm_gflops(n: int, repeats: int = 3, deadline: float = math.inf) -> float:
    """Best FP32 matmul rate of ``repeats`` runs (after a warm-up) in GFLOP/s."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty((n, n), np.float32)
    np.matmul(a, b, out=c)
    best = math.inf
    for i in range(repeats):
        if i and time.perf_counter() > deadline:
            break
        start = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def _one_core_gflops(n: int, repeats: int, deadline: float) -> tuple[float, Literal["threadpoolctl", "subprocess"]]:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        threadpool_limits = None
    if threadpool_limits is not None:
        with threadpool_limits(limits=1, user_api="blas"):
            return _gemm_gflops(n, repeats, deadline), "threadpoolctl"
    # BLAS reads its thread count once, at load: a fresh interpreter with the variables at 1
    env = dict(process_environment()) | dict.fromkeys(_BLAS_THREAD_VARS, "1")
    root = str(Path(__file__).resolve().parents[2])
    code = (
        f"import sys; sys.path.insert(0, {root!r}); from pipeline.host.peaks import _gemm_gflops; "
        f"print(_gemm_gflops({n}, {repeats}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return float(done.stdout.strip().splitlines()[-1]), "subprocess"


class _Stream:
    """STREAM-like kernels over three arrays of ``elements`` floats, far larger than the caches;
    each thread works on its own slice (numpy releases the GIL inside its loops)."""

    def __init__(self, elements: int, threads: int):
        import mmap

        import numpy as np

        self.np, self.n = np, elements
        # plain anonymous mappings: numpy asks for transparent huge pages, whose first touch can
        # stall seconds in the kernel's compaction on a busy host (3.6 s against 0.6 s for 256 MB)
        self.a, self.b, self.c = (np.frombuffer(mmap.mmap(-1, elements * 4), np.float32) for _ in range(3))
        bounds = [(elements * i // threads, elements * (i + 1) // threads) for i in range(threads)]

        def fill(part: int) -> None:  # first touch, on every thread
            lo, hi = bounds[part]
            self.a[lo:hi], self.b[lo:hi], self.c[lo:hi] = 0.0, 1.0, 1.0

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fill, range(threads)))

    def best_gbs(self, kernel: str, threads: int, repeats: int, deadline: float) -> float:
        """Best rate (GB/s) of ``repeats`` runs after a warm-up, as STREAM counts bytes (triad:
        read b and c, write a; copy: read b, write a)."""
        np, a, b, c = self.np, self.a, self.b, self.c
        bounds = [(self.n * i // threads, self.n * (i + 1) // threads) for i in range(threads)]
        temps = [np.empty(_BLOCK, np.float32) for _ in range(threads)]

        def triad(part: int) -> None:
            lo, hi = bounds[part]
            tmp = temps[part]
            for s in range(lo, hi, _BLOCK):
                e = min(s + _BLOCK, hi)
                np.multiply(c[s:e], np.float32(3.0), out=tmp[: e - s])
                np.add(b[s:e], tmp[: e - s], out=a[s:e])

        def copy(part: int) -> None:
            lo, hi = bounds[part]
            np.copyto(a[lo:hi], b[lo:hi])

        run, arrays = {"triad": (triad, 3), "copy": (copy, 2)}[kernel]
        best = math.inf
        with ThreadPoolExecutor(threads) as pool:
            for i in range(repeats + 1):  # the first run is a warm-up
                if i > 1 and time.perf_counter() > deadline:
                    break
                start = time.perf_counter()
                list(pool.map(run, range(threads)))
                if i:
                    best = min(best, time.perf_counter() - start)
        return arrays * self.n * 4 / best / 1e9


def nominal_gflops(
    cores: int, flags: frozenset[str] | None = None, mhz: float | None = None
) -> tuple[float | None, str | None]:
    """cores × FP32 lanes per FMA × 2 × GHz, and how it was made; None where the flags or the
    clock do not give it."""
    flags = probe.cpu_features() if flags is None else flags
    mhz = probe.cpu_max_mhz() if mhz is None else mhz
    lanes = next((n for flag, n in _FMA_LANES if flag in flags), None)
    if lanes is None or not mhz:
        return None, None
    return (
        cores * lanes * 2 * mhz / 1e3,
        f"{cores} cores × {lanes} FP32 lanes per FMA × 2 × {mhz / 1e3:.3g} GHz "
        "(one FMA port per core: cores with two peak at twice this)",
    )


def measure(budget_s: float = 10.0) -> Peaks:
    """Measure this host's peaks now: a few seconds on an idle host, about ``budget_s`` on a
    loaded one (repeats stop when their share of it is spent)."""
    started = time.perf_counter()
    cores = probe.usable_cores()
    key, record = host_key()
    n = _matmul_size(cores)
    # each step repeats until its share of the budget is spent (at least a warm-up and one run)
    all_cores = _gemm_gflops(n, 3, started + 0.25 * budget_s)
    one_core, method = _one_core_gflops(_matmul_size(1), 3, started + 0.5 * budget_s)
    mem_available = (probe.device_state().get("memory_available_mb") or 4096) * 2**20
    stream = _Stream(int(min(max(ARRAY_MB << 20, 4 * (probe.llc_bytes() or 0)), mem_available / 8)) // 4, cores)
    triad = stream.best_gbs("triad", cores, 5, started + 0.7 * budget_s)
    memcopy = stream.best_gbs("copy", cores, 5, started + 0.8 * budget_s)
    triad_one = stream.best_gbs("triad", 1, 3, started + 0.9 * budget_s) if cores > 1 else triad
    nominal, basis = nominal_gflops(cores)
    seconds = time.perf_counter() - started
    log.info(
        "measured this host's peaks in %.1f s: %.1f GFLOP/s (%d cores), %.1f GB/s", seconds, all_cores, cores, triad
    )
    return Peaks(
        key=key,
        host=record,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        seconds=round(seconds, 2),
        one_core_method=method,
        compute_gflops=ComputePeaks(
            all_cores=all_cores, one_core=one_core, nominal=nominal, nominal_basis=basis, matmul_n=n
        ),
        bandwidth_gbs=BandwidthPeaks(
            triad=triad, memcopy=memcopy, triad_one_core=triad_one, array_mb=stream.n * 4 >> 20
        ),
    )
