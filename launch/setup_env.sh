#!/usr/bin/env bash
# Create ./.venv (if missing) and install this checkout into it, editable, with the dev extra.
# Idempotent: re-running does nothing unless pyproject.toml changed. Used by both quick-start
# commands (launch/quickstart.sh, tests/run.sh).
#   PYTHON=python3.12 bash launch/setup_env.sh     # pick the interpreter
#   TORCH_SPEC="torch==2.9.1" bash launch/setup_env.sh   # pick the torch build to install
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${TORCH_SPEC:-}" ]; then spec=$TORCH_SPEC
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then spec="torch"
  else spec="torch==2.13.0"  # no GPU: a pinned release (a CPU build where the machine provides one)
  fi
  echo "[setup] installing $spec"
  "${PIP[@]}" "$spec"
fi
stamp="$VENV/.flashgpt-installed"
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing the project (editable) and its dependencies"
  "${PIP[@]}" -e ".[dev]"
  echo "$want" > "$stamp"
fi
