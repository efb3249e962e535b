"""This host's peak FP32 and INT8 compute and memory bandwidth, measured once and cached per host.

FP32 compute: the best of a few large single-precision matmuls through numpy's BLAS on all usable
cores and on one core (threadpoolctl, or a subprocess with the BLAS thread variables at 1), and the
nominal peak where the CPU flags and clock give it. INT8 compute: the best of a few u8 × s8 → s32
matmuls through ONNX Runtime's ``MatMulInteger`` (its integer GEMM picks the host's dot-product
kernels: AVX2, AVX-VNNI, AVX-512 VNNI, Arm sdot/i8mm), on all usable cores and on one, counted as
``2·M·N·K`` ops, and the nominal INT8 peak from the dot-product instruction the flags allow.
Bandwidth: a STREAM-like triad (``a = b + s·c``) and copy over arrays far larger than the
last-level cache, best of a few runs, counted as STREAM does (bytes read and written by the kernel,
no write-allocate traffic).

The cache key is what decides the figures: the CPU model and flags, the usable cores, the numpy,
BLAS and ONNX Runtime versions, and the format of the figures (``FORMAT``: a cache written before
the INT8 peak has another key, so it is measured again, never read without it). The file is
``<cache dir>/peaks-<key>.json``, the cache dir ``$SKUFORGE_CACHE_DIR``, else
``$XDG_CACHE_HOME/skuforge``, else ``~/.cache/skuforge``.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from pipeline.core.env import SKUFORGE_CACHE_DIR, process_environment
from pipeline.core.errors import EnvironmentProblem
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
# 8-bit multiply-adds per cycle of one vector port, by the best dot-product instruction the flags
# allow: a VNNI vpdpbusd or an Arm sdot/smmla is one instruction; without VNNI, x86 needs two
# multiplies (vpmaddubsw, then vpmaddwd) per 4-byte group
INT8_MACS = (
    ("avx512_vnni", 64, "AVX-512 VNNI vpdpbusd"),
    ("avx_vnni", 32, "AVX-VNNI vpdpbusd"),
    ("avx512bw", 32, "AVX-512BW vpmaddubsw+vpmaddwd"),
    ("avx2", 16, "AVX2 vpmaddubsw+vpmaddwd"),
    ("i8mm", 32, "Arm I8MM smmla"),
    ("asimddp", 16, "Arm dot product sdot"),
)
FORMAT = 2  # of the cached figures: 2 added int8_gops
_INT8_K = 512  # the INT8 matmul: 512 rows of u8 per thread times a 512 × 512 s8 weight, in the caches
_ORT_DISTS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml")


class ComputePeaks(Result):
    all_cores: float
    one_core: float
    nominal: float | None = None
    nominal_basis: str | None = None
    matmul_n: int = Field(description="the matmul: FP32 n × n × n; INT8 (n · threads) × n × n")


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
    compute_gflops: ComputePeaks = Field(description="FP32 matmul, GFLOP/s")
    int8_gops: ComputePeaks = Field(description="u8 × s8 → s32 matmul (ONNX Runtime MatMulInteger), GOP/s")
    bandwidth_gbs: BandwidthPeaks


def _blas() -> str:
    import numpy as np

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')}"
    except (TypeError, KeyError):  # numpy < 1.25 has no mode="dicts"
        return "unknown"


def _onnxruntime() -> str | None:
    """The installed ONNX Runtime's version, without importing it (the key is made on every read)."""
    for dist in _ORT_DISTS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def host_key() -> tuple[str, dict[str, Any]]:
    """The cache key and what it is made of (flags as their hash, to keep the record short)."""
    import numpy as np

    cpu = probe.cpu_info()
    basis = {
        "format": FORMAT,
        "cpu_model": cpu["model"],
        "flags": cpu["flags"],
        "usable_cores": probe.usable_cores(),
        "numpy": np.__version__,
        "blas": _blas(),
        "onnxruntime": _onnxruntime(),
    }
    record = {k: v for k, v in basis.items() if k != "flags"} | {"flags_sha256": sha256_json(cpu["flags"])}
    return sha256_json(basis)[:16], record


def cache_file(key: str | None = None) -> Path:
    return cache_dir() / f"peaks-{key or host_key()[0]}.json"


def _cached(path: Path, key: str) -> Peaks | None:
    """The figures cached for ``key`` at ``path``; None, saying why, where there are none to trust."""
    if not path.is_file():
        return None
    try:
        data = read_json(path)
        if isinstance(data, dict) and "compute_gflops" in data and "int8_gops" not in data:
            log.info("peaks cache %s predates the INT8 peak: measuring again", path)
            return None
        cached = Peaks.model_validate(data)
    except (ValueError, ValidationError) as exc:
        log.warning("peaks cache %s is unreadable (%s): measuring again", path, str(exc).splitlines()[0])
        return None
    if cached.key != key:
        log.info("peaks cache %s is for host key %s, not %s: measuring", path, cached.key, key)
        return None
    return cached


def host_peaks(refresh: bool = False) -> Peaks:
    """This host's peaks: from the cache, else measured (``refresh``: always) and cached."""
    key, _ = host_key()
    path = cache_file(key)
    cached = None if refresh else _cached(path, key)
    if cached is not None:
        return cached
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


def int8_gops(threads: int, repeats: int = 30, seconds: float = 0.5) -> float:
    """Best u8 × s8 → s32 matmul rate (GOP/s, ``2·M·N·K``) of ``repeats`` runs after a warm-up, or
    of those that fit in ``seconds`` (at least one), through ONNX Runtime's MatMulInteger on
    ``threads`` threads: ``512·threads`` rows against a constant 512 × 512 weight (prepacked, as an
    engine's is), each thread's rows in its caches. A run is milliseconds: many fit even where the
    steps before overran their share of the budget, so a busy neighbour's moment is not the peak."""
    import numpy as np

    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as exc:
        raise EnvironmentProblem(
            f"the INT8 peak is measured through ONNX Runtime and onnx, and {exc.name} is not installed",
            hint="install the build toolchain: scripts/setup.sh (pip install 'skuforge[pipeline]')",
        ) from exc
    rows, k = _INT8_K * threads, _INT8_K
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.integers(-128, 128, (k, k), dtype=np.int8), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])],
        "int8_peak",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [rows, k])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"a": rng.integers(0, 256, (rows, k), dtype=np.uint8)}
    session.run(None, feeds)
    best, deadline = math.inf, time.perf_counter() + seconds
    for i in range(repeats):
        if i and time.perf_counter() > deadline:
            break
        start = time.perf_counter()
        session.run(None, feeds)
        best = min(best, time.perf_counter() - start)
    return 2 * rows * k * k / best / 1e9


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


def nominal_int8_gops(
    cores: int, flags: frozenset[str] | None = None, mhz: float | None = None
) -> tuple[float | None, str | None]:
    """cores × 8-bit multiply-adds per cycle of the best dot-product instruction the flags allow
    (``INT8_MACS``) × 2 × GHz, and how it was made; None where the flags or the clock do not give it."""
    flags = probe.cpu_features() if flags is None else flags
    mhz = probe.cpu_max_mhz() if mhz is None else mhz
    found = next(((flag, macs, what) for flag, macs, what in INT8_MACS if flag in flags), None)
    if found is None or not mhz:
        return None, None
    flag, macs, what = found
    return (
        cores * macs * 2 * mhz / 1e3,
        f"{cores} cores × {macs} 8-bit multiply-adds per cycle ({what}: {flag}) × 2 × {mhz / 1e3:.3g} GHz "
        "(one vector port per core: cores with two peak at twice this)",
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
    # the INT8 runs are milliseconds: a slice of their own, however long the steps before took
    int8_all = int8_gops(cores, 30, 0.05 * budget_s)
    int8_one = int8_gops(1, 30, 0.05 * budget_s) if cores > 1 else int8_all
    mem_available = (probe.device_state().get("memory_available_mb") or 4096) * 2**20
    stream = _Stream(int(min(max(ARRAY_MB << 20, 4 * (probe.llc_bytes() or 0)), mem_available / 8)) // 4, cores)
    triad = stream.best_gbs("triad", cores, 5, started + 0.7 * budget_s)
    memcopy = stream.best_gbs("copy", cores, 5, started + 0.8 * budget_s)
    triad_one = stream.best_gbs("triad", 1, 3, started + 0.9 * budget_s) if cores > 1 else triad
    nominal, basis = nominal_gflops(cores)
    int8_nominal, int8_basis = nominal_int8_gops(cores)
    seconds = time.perf_counter() - started
    log.info(
        "measured this host's peaks in %.1f s: %.1f GFLOP/s FP32, %.1f GOP/s INT8 (%d cores), %.1f GB/s",
        seconds,
        all_cores,
        int8_all,
        cores,
        triad,
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
        int8_gops=ComputePeaks(
            all_cores=int8_all,
            one_core=int8_one,
            nominal=int8_nominal,
            nominal_basis=int8_basis,
            matmul_n=_INT8_K,
        ),
        bandwidth_gbs=BandwidthPeaks(
            triad=triad, memcopy=memcopy, triad_one_core=triad_one, array_mb=stream.n * 4 >> 20
        ),
    )
