#!/usr/bin/env bash
# Pin the device state before benchmarks, then print the resulting state as JSON
# (`skuforge runner probe --json`) so the job log and the benchmark record what was measured on.
#
#   runners/pin-device-state.sh [--nvpmodel-mode N]      (Jetson: default 0, MAXN on AGX Orin)
#
# Jetson: `nvpmodel -m N` and `jetson_clocks`. Other Linux: CPU governor "performance" through
# /sys (or cpupower). Each step is optional: when the tool is absent or not permitted (needs root),
# it says so and goes on; the probe shows the state actually in force. Run from the project root
# (the probe reads params.yaml to list the SKUs this host can build and run).
set -uo pipefail

mode=0
while [ $# -gt 0 ]; do
  case "$1" in
    --nvpmodel-mode) mode="${2:?--nvpmodel-mode needs a value}"; shift 2 ;;
    -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "pin-device-state: unknown argument: $1" >&2; exit 2 ;;
  esac
done

note() { echo "pin-device-state: $*" >&2; }
unpinned=0

if [ -f /etc/nv_tegra_release ]; then
  if ! command -v nvpmodel >/dev/null 2>&1; then
    note "nvpmodel not found: power mode not pinned"; unpinned=$((unpinned + 1))
  elif nvpmodel -m "$mode" >&2; then
    note "nvpmodel mode $mode set"
  else
    note "nvpmodel -m $mode failed (needs root): power mode not pinned"; unpinned=$((unpinned + 1))
  fi
  if ! command -v jetson_clocks >/dev/null 2>&1; then
    note "jetson_clocks not found: clocks not pinned"; unpinned=$((unpinned + 1))
  elif jetson_clocks >&2; then
    note "jetson_clocks applied (clocks at maximum)"
  else
    note "jetson_clocks failed (needs root): clocks not pinned"; unpinned=$((unpinned + 1))
  fi
else
  govs=(/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor)
  if [ ! -e "${govs[0]}" ]; then
    note "no cpufreq governor on this host (a VM or container): CPU frequency not pinned"
    unpinned=$((unpinned + 1))
  elif [ -w "${govs[0]}" ]; then
    failed=0
    for g in "${govs[@]}"; do echo performance > "$g" 2>/dev/null || failed=1; done
    if [ "$failed" = 0 ]; then note "CPU governor set to performance"; else
      note "could not set the governor on every CPU"; unpinned=$((unpinned + 1)); fi
  elif command -v cpupower >/dev/null 2>&1 && cpupower frequency-set -g performance >/dev/null 2>&1; then
    note "CPU governor set to performance (cpupower)"
  else
    note "CPU governor not pinned: $(cat "${govs[0]}") stays (writing it needs root)"
    unpinned=$((unpinned + 1))
  fi
fi
note "$unpinned step(s) not pinned; the state in force follows"

# The probe is the record; its exit code is this script's (pinning steps are best effort).
if command -v skuforge >/dev/null 2>&1; then
  exec skuforge runner probe --json
fi
exec python3 -c 'import sys; from pipeline.cli import main; sys.exit(main(sys.argv[1:]))' runner probe --json
