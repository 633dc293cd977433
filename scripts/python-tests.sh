#!/usr/bin/env bash
# The nccl_ep Python package's unit tests (python/): a venv, `pip install ./python`, epflow's
# libnccl_ep.so built (cargo build -p epflow-nccl-ep-abi) and loaded through EPFLOW_LIB, then
# python/tests/run_unit.py, whose last line is `N passed, N failed, N skipped`.
# No GPU needed. Env: EPFLOW_LIB (use this library, skip the build), PYTHON (default python3),
# EPFLOW_PY_VENV (default $CARGO_TARGET_DIR/python-venv).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
venv="${EPFLOW_PY_VENV:-$target/python-venv}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "python-tests: creating the venv $venv"
    "$py" -m venv "$venv"
fi
echo "python-tests: pip install $root/python"
# Build isolation fetches setuptools>=61; offline, the venv's own setuptools builds it.
if ! "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$root/python"; then
    echo "python-tests: retrying without build isolation (offline?)"
    "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps --no-build-isolation "$root/python"
fi
# pip builds in the source tree: leave it as it was.
rm -rf "$root/python/build/lib" "$root/python/build/bdist."* "$root/python/nccl_ep.egg-info"

if [ -z "${EPFLOW_LIB:-}" ]; then
    echo "python-tests: cargo build -p epflow-nccl-ep-abi"
    (cd "$root" && cargo build --quiet -p epflow-nccl-ep-abi)
    export EPFLOW_LIB="$target/debug/libnccl_ep.so"
fi
echo "python-tests: EPFLOW_LIB=$EPFLOW_LIB"
if [ ! -f "$EPFLOW_LIB" ]; then
    echo "python-tests: $EPFLOW_LIB does not exist"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
fi

# From an empty directory, so that `import nccl_ep` is the installed package.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
NCCL_EP_REQUIRE_LIBRARY=1 NCCL_EP_HEADER="$root/crates/nccl-ep-abi/include/nccl_ep.h" "$venv/bin/python" "$root/python/tests/run_unit.py"
