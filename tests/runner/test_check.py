"""Host versus SKU: architecture, CPU features, toolchain pins; the host probe."""

from __future__ import annotations

import models
import onnxruntime

from pipeline.engine.hostcheck import host_problems, toolchain_problems
from pipeline.host import probe
from pipeline.project.config import parse_registry


def registry(**sku):
    return parse_registry(models.one_sku_params(**sku))


def test_toolchain_pins():
    assert toolchain_problems({"onnxruntime": f"=={onnxruntime.__version__}"}) == []
    assert toolchain_problems({"onnxruntime": "<1.0"}) == [
        f"onnxruntime {onnxruntime.__version__} is installed, the SKU pins <1.0"
    ]
    assert toolchain_problems({"skuforge-no-such-package": ">=1"}) == [
        "skuforge-no-such-package is not installed (the SKU pins >=1)"
    ]
    (problem,) = toolchain_problems({"onnxruntime": "one point twenty"})
    assert "not a PEP 440 version specifier" in problem


def test_host_problems():
    assert host_problems(registry(), "s") == []
    assert host_problems(registry(target={"arch": probe.host_arch(), "cpu_features": ["no_such_flag"]}), "s") == [
        "needs CPU features ['no_such_flag'] this host lacks"
    ]


def test_missing_execution_provider_is_reported():
    problems = host_problems(registry(options={"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]}), "s")
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        assert problems == []
    else:
        assert problems and "CUDAExecutionProvider" in problems[0]


def test_probe_describes_the_host():
    host = probe.host()
    assert host["arch"] == probe.host_arch() and host["os"] == probe.host_os()
    assert host["cpu_cores"] >= 1 and host == probe.host()  # deterministic on one machine
    state = probe.device_state()
    assert {"governor", "cpu_mhz", "load_average", "memory_available_mb", "temperatures_c"} <= set(state)
    mem = probe.rss_mb()
    assert mem["rss"] > 0 and mem["peak_rss"] >= mem["rss"]
