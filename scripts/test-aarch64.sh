#!/usr/bin/env bash
# Cross-builds qforge-core's and qforge-kernels' tests for aarch64-unknown-linux-gnu
# and runs them under qemu-aarch64 (user-mode emulation, `-cpu max`), on a Debian 12
# x86-64 machine with no network but Debian's mirrors.
#
# rustup cannot fetch the aarch64 standard library here, so this uses Debian's
# bookworm-security Rust (rustc-web / cargo-web 1.96, a compiler as new as the
# project's) with the arm64 build of its standard library, unpacked from the .deb
# (installing it would pull an arm64 LLVM), plus Debian's cross linker and qemu-user.
#
# `+fp16`: candle's `gemm-f16` (a dev-dependency of the kernels' tests) writes
# half-precision FMLA in inline assembly without enabling the feature, which Debian's
# LLVM refuses; every Armv8.2 CPU (Raspberry Pi 5, Jetson Orin, Graviton 2+) has it.
#
# About 5 minutes on 2 cores: 3.5 to build, 1.5 to run under emulation. Not part of
# scripts/test.sh yet: the suite has no room for it in its time budget.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
RUSTLIB=/usr/lib/rustlib/$TARGET

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null \
    || [ ! -x /usr/bin/cargo ] || ! /usr/bin/rustc --version | grep -q '^rustc 1\.9'; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rustc-web cargo-web \
        gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null
fi
if [ ! -d "$RUSTLIB" ]; then
    dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
    apt-get update -qq
    scratch=$(mktemp -d)
    (cd "$scratch" && apt-get download -qq "libstd-rust-web-dev:arm64=$(dpkg-query -W -f='${Version}' rustc-web)")
    dpkg-deb -x "$scratch"/libstd-rust-web-dev_*_arm64.deb "$scratch/x"
    cp -r "$scratch/x$RUSTLIB" "$RUSTLIB"
    rm -rf "$scratch"
fi

export RUSTC=/usr/bin/rustc
export CARGO_TARGET_DIR=target/aarch64
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+fp16"
/usr/bin/cargo test --locked --target "$TARGET" -p qforge-core -p qforge-kernels --lib --tests
