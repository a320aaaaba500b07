#!/usr/bin/env bash
# Create (or reuse) .venv and install kvlayout into it, editable, with its test extras.
# torch is installed first and pinned: the native extension is built against it
# (hence --no-build-isolation), and a plain `pip install torch` could pull a
# multi-GB CUDA build.  PYTHON picks the interpreter for a new venv (default python3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3.11}" -m venv .venv
fi
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q "setuptools>=64" wheel
# the test extra brings pytest (with xdist: the tests run one worker per core), hypothesis and ruff
# (the lint .ci/run runs)
.venv/bin/pip install -q --no-build-isolation -e '.[test]'
