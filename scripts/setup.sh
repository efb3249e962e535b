#!/usr/bin/env bash
# Set up a machine for skuforge: a virtualenv in .venv with the package and the extras a task needs,
# and the system parts beyond pip some SKUs need. A device needs only `pip install 'skuforge[agent]'`.
#
#   scripts/setup.sh                  a developer machine: what `skuforge repro` on the example needs
#                                     (pipeline,examples,openvino,iree,tvm,litert; Vulkan; the LiteRT converter)
#   scripts/setup.sh --test           plus the test tools (the test extra, Debian's Chromium)
#   scripts/setup.sh --extras LIST    exactly these extras, comma-separated (a CI job: pipeline for the
#                                     registry check, assemble and promote; agent for rollout; a SKU's job
#                                     pipeline[,examples][,<its backend's extra>]: pipeline/ci/render.py)
#   scripts/setup.sh --with LIST      system parts, comma-separated: vulkan (Mesa's software Vulkan driver,
#                                     apt), chromium (apt), system-site-packages (a Jetson's JetPack TensorRT),
#                                     cross-aarch64 (Debian's gcc-aarch64-linux-gnu: an aarch64 TVM SKU built
#                                     on an x86 host; the developer set adds it when params.yaml has one),
#                                     emulation (Debian's qemu-user-static and an aarch64 Python with the
#                                     runtimes, ~/.cache/skuforge/emulation-aarch64-*: an x86 host validates
#                                     the aarch64 CPU SKUs' engines under QEMU; --test adds it)
#
# Implied by the extras: `examples` installs PyTorch's CPU wheel first (PyPI's Linux x86-64 torch is the
# CUDA build), `litert` makes the LiteRT converter's own environment, `test` adds chromium.
# SKUFORGE_SETUP_DRY_RUN=1 prints each install command (`+ ...`) instead of running it: tests/ci replays
# the workflows' setup steps with it to check what each job installs.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="pipeline,examples,openvino,iree,tvm,litert"
with=""
with_set=false
test=false
while [ $# -gt 0 ]; do
  case "$1" in
    --test) test=true; shift ;;
    --extras) extras="${2?--extras needs a comma-separated list}"; shift 2 ;;
    --with) with="${2?--with needs a comma-separated list (it may be empty)}"; with_set=true; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown argument: $1 (see scripts/setup.sh --help)" >&2; exit 2 ;;
  esac
done
has() { case ",$1," in *",$2,"*) return 0 ;; *) return 1 ;; esac; }
# the developer set (no --extras) gets the Vulkan device unless --with says otherwise
if ! $with_set && [ "$extras" = "pipeline,examples,openvino,iree,tvm,litert" ]; then
  with="vulkan"
  # an aarch64 TVM SKU in the registry (a SKU block with both keys) is cross-compiled on an x86 host
  if [ "$(uname -m)" = x86_64 ] && [ -f params.yaml ] && awk '
      /^  [A-Za-z0-9_.-]+:[[:space:]]*$/ { if (tvm && arm) found = 1; tvm = arm = 0 }
      /^    backend:[[:space:]]*tvm/ { tvm = 1 }
      /^    target:.*arch:[[:space:]]*aarch64/ { arm = 1 }
      END { exit !(found || (tvm && arm)) }' params.yaml; then
    with="$with,cross-aarch64"
  fi
  # an aarch64 SKU (any backend) is validated on an x86 host under QEMU user-mode emulation
  if [ "$(uname -m)" = x86_64 ] && [ -f params.yaml ] && grep -Eq '^    target:.*arch:[[:space:]]*aarch64' params.yaml; then
    with="$with,emulation"
  fi
fi
if $test; then
  extras="${extras:+$extras,}test"
  with="${with:+$with,}chromium"
  if [ "$(uname -m)" = x86_64 ] && ! has "$with" emulation; then
    with="$with,emulation"
  fi
fi
for part in ${with//,/ }; do
  has "vulkan,chromium,system-site-packages,cross-aarch64,emulation" "$part" || {
    echo "setup: unknown --with part '$part' (known: vulkan, chromium, system-site-packages, cross-aarch64, emulation)" >&2
    exit 2
  }
done

dry="${SKUFORGE_SETUP_DRY_RUN:-}"
run() {
  if [ -n "$dry" ]; then
    echo "+ $*"
  else
    "$@"
  fi
}

# apt-get as root only; elsewhere say what is missing (the tests that need it skip and say why).
apt_install() {  # PACKAGE CHECK_PATH WHY
  if [ -z "$dry" ] && ls $2 >/dev/null 2>&1; then
    return 0
  fi
  if [ -n "$dry" ] || { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }; then
    run apt-get update -qq
    DEBIAN_FRONTEND=noninteractive run apt-get install -y -qq "$1"
  else
    echo "setup: $1 is not installed ($3; install it as root)" >&2
  fi
}

# lavapipe (Mesa's software Vulkan driver): without it the Vulkan SKUs are reported as not
# buildable here, which is correct but leaves them untested.
if has "$with" vulkan; then
  apt_install mesa-vulkan-drivers "/usr/share/vulkan/icd.d/lvp_icd.*.json" "the IREE Vulkan SKU needs a Vulkan device"
fi
# Debian's Chromium for the HTML report's browser test (tests/test_report.py; playwright's own
# browser download is not used).
if has "$with" chromium; then
  apt_install chromium /usr/bin/chromium "the HTML report's browser test needs it"
fi

# Debian's aarch64 cross GCC: TVM links a library for an aarch64 SKU with it (without it the SKU is
# not buildable on an x86 host, and says so).
if has "$with" cross-aarch64; then
  apt_install gcc-aarch64-linux-gnu /usr/bin/aarch64-linux-gnu-gcc "an aarch64 TVM SKU is cross-compiled with it"
fi

# QEMU's user-mode emulator: an aarch64 Python runs the aarch64 CPU SKUs' engines on an x86 host
# (validated under emulation, never benchmarked); its environment is made below, after the venv.
if has "$with" emulation; then
  apt_install qemu-user-static /usr/bin/qemu-aarch64-static "the aarch64 SKUs' engines are validated under it"
fi

venv=(python3 -m venv .venv)
has "$with" system-site-packages && venv+=(--system-site-packages)
if [ -n "$dry" ] || ! [ -x .venv/bin/python ]; then
  run "${venv[@]}"
fi
run .venv/bin/pip install --quiet --upgrade pip
if has "$extras" examples; then
  # the pin is the examples extra's (pyproject.toml)
  torch="$(grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"' | head -n 1)"
  # PyTorch's CPU index where it answers (a GitHub runner, a developer machine); a host that cannot
  # reach it (a mirror-only CI machine: pip would retry every package for minutes) takes the pin
  # from its configured index or wheel folder. SKUFORGE_TORCH_INDEX overrides the index ("" = pip's own).
  torch_index="${SKUFORGE_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
  if [ -n "$torch_index" ] && [ -z "$dry" ] && ! python3 - "$torch_index" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5).close()
except Exception:
    sys.exit(1)
PY
  then
    echo "setup: $torch_index does not answer: torch from pip's configured index" >&2
    torch_index=""
  fi
  run .venv/bin/pip install --quiet "${torch:?no torch pin in pyproject.toml}" ${torch_index:+--index-url "$torch_index"}
fi
run .venv/bin/pip install --quiet -e ".[$extras]"
# pip compiles the packages it installs but not an editable install's own source. Compiled once here,
# skuforge's modules load from __pycache__ (ignored by git) in every skuforge and DVC stage process,
# about 0.2 s of CPU less per process. Without it each process compiles them again wherever
# PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines). A module edited later is compiled as usual.
run .venv/bin/python -m compileall -q pipeline

# The LiteRT converter (onnx2tf and the TensorFlow it pins) in its own environment, outside the
# repository (~/.cache/skuforge/litert-converter-<lock hash>; once per requirements.lock).
if has "$extras" litert; then
  run .venv/bin/python -m pipeline.backends.litert_converter
fi

# The aarch64 environment run under QEMU: Debian's arm64 Python unpacked (no system change) and the
# runtimes' aarch64 wheels at this venv's versions (~/.cache/skuforge/emulation-aarch64-<hash>).
if has "$with" emulation && { [ -n "$dry" ] || [ -x /usr/bin/qemu-aarch64-static ]; }; then
  # a download that fails leaves the aarch64 SKUs "built only" here, saying why, not a broken setup
  run .venv/bin/python -m pipeline.host.emulation ||
    echo "setup: the aarch64 environment was not made: the aarch64 SKUs stay built only on this host" >&2
fi
