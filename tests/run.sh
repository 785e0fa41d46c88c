#!/usr/bin/env bash
# The test command (README, and .ci/run runs exactly this): set up ./.venv, then run the whole suite.
# GPU tests skip without CUDA. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup_env.sh
exec .venv/bin/python -m pytest -q tests "$@"
