#!/usr/bin/env bash
# The linters CI runs before the tests (.ci/run; README "Run the linters and the tests"). Needs the
# test extras in PATH (scripts/setup.sh --test, then PATH="$PWD/.venv/bin:$PATH"). Configuration:
# [tool.ruff], [tool.importlinter] and [tool.mypy] in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

ruff check pipeline tests benchmarks scripts
ruff format --check pipeline tests benchmarks scripts
# the layers of pipeline/, the compiler stacks apart, an argument parser that loads no library
lint-imports
# the whole package: [tool.mypy] files
mypy pipeline
