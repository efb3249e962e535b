"""Shared test set-up: ``import models`` finds the tiny ONNX model builders in tests/models.py; this
host's peaks are seeded (no test measures them but the tests of the measuring); IREE's cached devices
are released after each module."""

from __future__ import annotations

import gc
import os
import sys
import zipfile
from pathlib import Path

import pytest

from pipeline.backends import litert_converter
from pipeline.core.env import SKUFORGE_EMULATION_DIR
from pipeline.core.io import atomic_write_json
from pipeline.core.paths import cache_dir
from pipeline.host import peaks

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


# Tests that share an expensive module- or session-scoped fixture, by group: under `-n` (xdist's --dist
# load) a group runs on one worker, which makes the fixture once instead of once on every worker that
# gets one of its tests, and runs the tests in their order, as one process does (a module's tests may
# build on what the ones before left in its project). A group lists node id prefixes: modules, or tests
# of one. The groups go out first, in this order (the longest first, measured), then each other test
# to the next free worker. (xdist's own --dist loadgroup does not group under pytest 9: it marks the
# groups in a node attribute pytest no longer reads.)
ONE_WORKER = {
    "tvm": ("tests/backends/test_tvm.py",),  # every tuning in one process
    "tvm_rpc": ("tests/backends/test_tvm_rpc.py",),  # one tracker and its two servers for the module
    "dvc_pipeline": ("tests/integration/test_dvc_pipeline.py",),  # a chain of module fixtures: repro thrice
    "matrix": ("tests/test_matrix.py",),  # skuforge repro of four models under DVC
    "digits": ("tests/examples/test_digits.py",),  # trains the example model
    "exporter_verdicts": ("tests/test_exporter_verdicts.py",),  # one INT8 recognizer build serves three tests
    # the `server` fixture: a real `mlflow server`, started once per process; the module's projects
    "mlflow_server": (
        "tests/registry/test_mlflow_server.py",
        "tests/registry/test_planted_slowdown.py",
        "tests/rollout/test_release_mlflow.py",
        "tests/security/test_secrets_errors.py::test_token_and_password_with_a_live_server",
        "tests/security/test_secrets_errors.py::test_https_to_a_plain_http_server_is_not_retried",
    ),
    "corpus": ("tests/test_corpus.py",),  # a prepared project per corpus model
    "embedded": ("tests/registry/test_embedded.py",),  # publishes in order into the module's project
    "consistency": ("tests/test_consistency.py",),
    "reproducible": ("tests/test_reproducible.py",),
    "evidence": ("tests/security/test_evidence.py",),
    "report": ("tests/test_report.py",),
    "iree": ("tests/backends/test_iree.py",),  # compiles two models for five SKUs
    "rollout_cli": ("tests/rollout/test_cli.py",),
    "rollout_agent": ("tests/rollout/test_agent.py",),
    "exporter_shapes": ("tests/test_exporter_shapes.py",),  # PyTorch exports, TorchScript and dynamo
    "bench_method": ("tests/stages/test_bench_method.py",),
    "host_targets": ("tests/backends/test_host_targets.py",),  # three IREE compiles
    "stages": ("tests/stages/test_stages.py",),
    "contract": ("tests/backends/test_contract.py",),  # an engine per stack (TVM and IREE compiles)
    "openvino": ("tests/backends/test_openvino.py",),  # compiles two models at two precisions
    "rollout_controller": ("tests/rollout/test_controller.py",),
    "dvc_metrics": ("tests/integration/test_dvc_metrics.py",),
    "roofline": ("tests/test_roofline.py",),
}


def pytest_xdist_make_scheduler(config, log):
    """--dist load (what -n gives): the ONE_WORKER groups first, each one unit of work for one worker,
    then each other test to the next free worker (xdist's LoadScopeScheduling, its units reordered).
    Another --dist gets xdist's own scheduler."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    rank = {group: i for i, group in enumerate(ONE_WORKER)}

    class OneWorkerGroups(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            for group, prefixes in ONE_WORKER.items():
                if nodeid.startswith(prefixes):
                    return group
            return nodeid

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the groups in ONE_WORKER's order; the rest keep the collection order
                self.ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: rank.get(unit[0], len(rank)))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return OneWorkerGroups(config, log)


@pytest.fixture(autouse=True, scope="session")
def _developer_key_in_tmp(tmp_path_factory):
    """Publish signs with a developer key made on first use: keep it out of the real home."""
    if "SKUFORGE_KEY_DIR" not in os.environ:
        os.environ["SKUFORGE_KEY_DIR"] = str(tmp_path_factory.mktemp("skuforge-keys"))
    yield


@pytest.fixture(autouse=True, scope="session")
def _seeded_host_peaks(tmp_path_factory):
    """The roofline divides by this host's peak compute and bandwidth, which pipeline.host.peaks measures
    (seconds of all cores) the first time a process asks and caches per host key in
    ``$SKUFORGE_CACHE_DIR``. Tests get a cache folder of their own holding fixed figures for this host's
    key, so no test measures (and none writes the developer's cache) but the tests of the measuring,
    which point the variable elsewhere."""
    folder = tmp_path_factory.mktemp("skuforge-cache")
    key, host = peaks.host_key()
    seeded = peaks.Peaks(
        key=key,
        host=host,
        measured_at="2026-01-01T00:00:00+00:00",
        seconds=0.0,
        one_core_method="threadpoolctl",
        compute_gflops=peaks.ComputePeaks(all_cores=100.0, one_core=50.0, matmul_n=1536),
        int8_gops=peaks.ComputePeaks(all_cores=300.0, one_core=150.0, matmul_n=512),
        bandwidth_gbs=peaks.BandwidthPeaks(triad=20.0, memcopy=20.0, triad_one_core=10.0, array_mb=128),
    )
    atomic_write_json(folder / f"peaks-{key}.json", seeded.to_json())
    with pytest.MonkeyPatch.context() as mp:
        # the LiteRT converter's environment stays where setup made it (the default follows the cache folder)
        mp.setenv(litert_converter.ENV_VAR, str(litert_converter.env_dir()))
        mp.setenv(SKUFORGE_EMULATION_DIR.name, str(cache_dir()))  # and so do the aarch64 environments
        mp.setenv(peaks.ENV_CACHE_DIR, str(folder))
        yield folder


@pytest.fixture(autouse=True, scope="module")
def _release_iree_devices():
    """IREE keeps every device it opens for the life of the process (iree.runtime.system_setup), and an
    idle lavapipe Vulkan device keeps two threads spinning: most of a core of this worker, for every
    test after it. Released after each module (the module's own fixtures are torn down first)."""
    yield
    setup = sys.modules.get("iree.runtime.system_setup")
    devices = getattr(setup, "_GLOBAL_DEVICES_BY_URI", None)
    if devices:
        devices.clear()
        gc.collect()


@pytest.fixture(scope="session")
def zip_bomb(tmp_path_factory) -> Path:
    """A real zip bomb: an .npz of about 1 MiB whose member 'x.npy' (a valid float32 header) inflates to
    1 GiB of zeros, about 1000-fold. The deflate stream is made once, not by deflating 1 GiB (3 s): a
    full flush after each 16 MiB of zeros restarts the stream from an empty history, so every chunk
    after the first deflates to the same bytes, which are written out 63 times."""
    import io
    import struct
    import zlib

    from numpy.lib import format as npy

    header = io.BytesIO()
    inflated, chunk = 1 << 30, bytes(1 << 24)
    npy.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (inflated // 4, 1)})
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate, as a zip member holds it
    first = deflate.compress(header.getvalue() + chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    repeat = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    assert deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH) == repeat  # the history really restarts
    data = first + repeat * (inflated // len(chunk) - 1) + deflate.flush()
    crc = zlib.crc32(header.getvalue())
    for _ in range(inflated // len(chunk)):
        crc = zlib.crc32(chunk, crc)
    size, name = len(header.getvalue()) + inflated, b"x.npy"
    common = struct.pack("<HHHHHIII", 20, 0, zipfile.ZIP_DEFLATED, 0, 0x21, crc, len(data), size)
    local = b"PK\x03\x04" + common + struct.pack("<HH", len(name), 0) + name
    central = b"PK\x01\x02" + struct.pack("<H", 20) + common + struct.pack("<HHHHHII", len(name), 0, 0, 0, 0, 0, 0)
    central += name
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, len(central), len(local) + len(data), 0)
    path = tmp_path_factory.mktemp("bomb") / "bomb.npz"
    path.write_bytes(local + data + central + end)
    with zipfile.ZipFile(path) as archive:  # a well-formed archive, as the loader will see it
        info = archive.getinfo("x.npy")
        assert (info.file_size, info.compress_size, info.CRC) == (size, len(data), crc)
    return path


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One real `mlflow server` on loopback per test process (see registry_helpers.Server)."""
    from registry_helpers import MLFLOW, Server

    if not MLFLOW.is_file():
        pytest.skip(f"no mlflow executable next to {sys.executable} (pip install mlflow)")
    srv = Server(tmp_path_factory.mktemp("mlflow_server"))
    srv.start(new_port_if_taken=True)
    yield srv
    srv.stop()
