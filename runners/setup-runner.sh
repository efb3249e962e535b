#!/usr/bin/env bash
# Register this machine as an ephemeral self-hosted GitHub Actions runner for one runner class.
#
#   RUNNER_TOKEN=<registration token> REPO_URL=https://github.com/ORG/REPO \
#     runners/setup-runner.sh --class x86-cpu-avx2 [--runner-dir ~/actions-runner] [--name NAME]
#
# The registration token comes from the environment only (Settings > Actions > Runners > New, or
# `gh api -X POST repos/ORG/REPO/actions/runners/registration-token`); it is passed to the
# runner's config.sh and never written anywhere by this script. The labels come from
# runners/classes.yaml. The runner must already be unpacked in --runner-dir (download it from
# https://github.com/actions/runner/releases as GitHub's "New runner" page shows; pin the version).
# --ephemeral: the runner takes one job and unregisters, so every job starts from a clean state;
# run this script again (e.g. from a systemd unit) to take the next one.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
class=""
runner_dir="${RUNNER_DIR:-${HOME:-.}/actions-runner}"
name="$(uname -n)-$$"
classes="$here/classes.yaml"

usage() { sed -n '2,6p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --class) class="${2:?--class needs a value}"; shift 2 ;;
    --runner-dir) runner_dir="${2:?--runner-dir needs a value}"; shift 2 ;;
    --name) name="${2:?--name needs a value}"; shift 2 ;;
    --classes) classes="${2:?--classes needs a value}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "setup-runner: unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done

if [ -z "${RUNNER_TOKEN:-}" ]; then
  echo "setup-runner: error: RUNNER_TOKEN is not set (the runner registration token)" >&2
  echo "  hint: export RUNNER_TOKEN from 'gh api -X POST repos/ORG/REPO/actions/runners/registration-token --jq .token'" >&2
  exit 2
fi
if [ -z "${REPO_URL:-}" ]; then
  echo "setup-runner: error: REPO_URL is not set (e.g. https://github.com/ORG/REPO)" >&2
  exit 2
fi
if [ -z "$class" ]; then
  echo "setup-runner: error: give --class NAME (a class in $classes)" >&2
  exit 2
fi

# Labels from the registry: skuforge when installed, else a python one-liner over the YAML.
if command -v skuforge >/dev/null 2>&1; then
  labels="$(skuforge runner labels --class "$class" --classes "$classes")"
else
  labels="$(python3 -c 'import sys, yaml; c = yaml.safe_load(open(sys.argv[1]))["classes"]; n = sys.argv[2]
if n not in c: sys.exit(f"setup-runner: error: unknown runner class {n!r}; known: {sorted(c)}")
print(",".join(c[n]["labels"]))' "$classes" "$class")"
fi

if [ ! -x "$runner_dir/config.sh" ]; then
  echo "setup-runner: error: no GitHub Actions runner in $runner_dir (config.sh missing)" >&2
  echo "  hint: unpack the runner release there (github.com/actions/runner/releases) or pass --runner-dir" >&2
  exit 3
fi

echo "setup-runner: registering $name for $REPO_URL with labels $labels (ephemeral)"
cd "$runner_dir"
# The token goes on config.sh's command line (its documented interface), not into a file.
./config.sh --unattended --ephemeral --replace \
  --url "$REPO_URL" --token "$RUNNER_TOKEN" \
  --name "$name" --labels "$labels" --no-default-labels
unset RUNNER_TOKEN
exec ./run.sh
