#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need (a Python
# venv with the peers qforge is checked against, redis-server), then checks formatting, runs
# clippy with warnings denied, the Rust tests, and the Python cross-checks.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

# A fresh clone builds once: incremental caches would only take disk (CI's is
# shared and has run out before).
if [ -n "${CI:-}" ]; then
    export CARGO_INCREMENTAL=0
fi
# What a run takes at its peak: target/ about 3 GB, the venv 0.3 GB, the Python
# tests' scratch 0.9 GB. Shown first, so a run that fills the disk says so.
df -h . "${TMPDIR:-/tmp}"

step "python venv with test peers (tests/python/requirements.txt)"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt

step "redis-server for the cluster tests (Debian package redis-server)"
# The tests start their own servers on free loopback ports; only the binary is
# needed. The package's own service is not started.
if ! command -v redis-server >/dev/null; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi
redis-server --version

step "model fixtures (scripts/fetch-models.sh)"
scripts/fetch-models.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "house rules (scripts/house_rules.py): short functions, no import cycle"
python3 scripts/house_rules.py

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked

step "aarch64: the kernels' tiers under qemu-aarch64 (scripts/test-aarch64.sh --kernels)"
# Cross-built with Debian's Rust and cross linker, run on an Armv8.0 CPU model and on
# one with every extension; scripts/test-aarch64.sh without --kernels also runs the
# aarch64 `qforge` (CartPole through act and serve, SmolLM2's perplexity).
scripts/test-aarch64.sh --kernels
if [ -n "${CI:-}" ]; then
    # Nothing after reads the cross build (0.6 GB); CI's disk is shared.
    rm -rf target/aarch64
fi

step "the Python package (python/): its extension module"
# The module a wheel of python/ holds (maturin builds the same crate), built with the
# test profile and the targets cargo test selected, so the workspace's features unify
# as they did there and only the module itself compiles (`-p qforge-python` alone
# unified them differently and rebuilt 77 crates, 2 min 43 s in CI); then put where
# Python finds it.
PYO3_BUILD_EXTENSION_MODULE=1 cargo build --locked --workspace --profile test --lib --tests
mkdir -p target/python
ln -sf ../debug/libqforge.so target/python/qforge.abi3.so

# `cargo test` built target/debug/qforge with the test profile (optimised, debug
# assertions on), so the cross-checks reuse it instead of a second, release build.
step "python cross-checks against ONNX Runtime, and the Python package against the CLI"
# Scratch directories kept only for failed tests: pytest's default keeps the last
# three runs' whole, 0.7 GB each (a SmolLM2 export), on CI's shared disk.
QFORGE="$PWD/target/debug/qforge" PYTHONPATH="$PWD/target/python" \
    .venv/bin/python -m pytest -q --durations=8 -o tmp_path_retention_policy=failed tests/python
