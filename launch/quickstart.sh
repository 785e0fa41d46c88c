#!/usr/bin/env bash
# Quick start on any machine (no GPU needed): set up ./.venv, then train the tiny GPT on the shipped
# corpus. Extra arguments are config overrides, e.g. `bash launch/quickstart.sh train.max_steps=50`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup_env.sh
exec .venv/bin/python launch/train.py --config tiny_cpu.yaml "$@"
