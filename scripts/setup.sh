#!/usr/bin/env bash
# Create (or reuse) .venv and install kvlayout into it, editable, with the test and bench extras; one line per
# phase.  torch is installed first and pinned: the native extension is built against it (hence
# --no-build-isolation), and a plain `pip install torch` could pull a multi-GB CUDA build.  The extension is
# rebuilt only when torch_ext/, setup.py, torch or the build choices changed (setup.py keeps their fingerprint
# in kvlayout/_C.build-stamp; KVLAYOUT_REBUILD=1 rebuilds anyway).  PYTHON picks the interpreter for a new venv
# (default python3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
started=$SECONDS
say() { printf 'setup: %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
    say "creating the virtual environment .venv (${PYTHON:-python3.11})"
    "${PYTHON:-python3.11}" -m venv .venv
else
    say "reusing the virtual environment .venv"
fi

say "torch==$TORCH_VERSION (pinned: the native extension is built against it; the first time, a large download)"
.venv/bin/pip install -q "torch==$TORCH_VERSION"
.venv/bin/pip install -q "setuptools>=64" wheel

# What setup.py will decide about the native extension, said before pip hides setup.py's own output.
native=$(.venv/bin/python -c '
import runpy
current, why = runpy.run_path("setup.py", run_name="kvlayout_setup")["native_status"]()
print(("current " if current else "stale ") + why)')
case "$native" in
    current*) say "kvlayout, editable, with its dependencies and the test and bench extras; native extension not rebuilt: ${native#current }" ;;
    *) say "kvlayout, editable, with its dependencies and the test and bench extras; building the native extension (${native#stale }; about 2 minutes on 2 cores)" ;;
esac
# test: pytest (with xdist: the tests run one worker per core), hypothesis, ruff (the lint .ci/run runs);
# bench: matplotlib, for the PNG plots of `kvlayout bench`
phase=$SECONDS
.venv/bin/pip install -q --no-build-isolation -e '.[test,bench]'
say "installed in $((SECONDS - phase)) s"

say "done in $((SECONDS - started)) s; from now on \`.venv/bin/python -m pytest -q -n auto\` alone runs the tests (run this script again after pulling changes to torch_ext/, setup.py or pyproject.toml)"
