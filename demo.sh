#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the CPU demo. Extra arguments go to
# `grpolab train` (e.g. ./demo.sh max_steps=50).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec .venv/bin/grpolab train "$@"
