#!/usr/bin/env bash
# Builds the release binaries: a statically linked, stripped `qforge` for x86-64 and
# for aarch64 (Linux), with their SHA-256 sums, in target/dist/:
#
#   qforge-VERSION-x86_64-linux   qforge-VERSION-aarch64-linux   SHA256SUMS
#
# Static, so that one file runs on any Linux of its architecture (a Raspberry Pi OS,
# a Jetson's L4T, Amazon Linux on Graviton) with nothing installed beside it.
#
# Linked against glibc's static libraries (`-C target-feature=+crt-static`), not
# musl: Rust's standard library for the musl targets comes only from rustup, which
# cannot reach its servers from here, and Debian ships none. What static glibc
# costs: resolving a host name (`--cluster redis://redis-host:6379`) loads glibc's
# NSS modules at run time, which must then be the glibc the binary was linked with
# (Debian 12's 2.36); IP addresses (`redis://10.0.0.5:6379`, `--addr 0.0.0.0:8000`)
# need nothing.
#
# The aarch64 binary is cross-built with Debian's Rust and cross linker, as
# scripts/test-aarch64.sh sets them up, and smoke-tested under qemu-aarch64 on a
# Cortex-A53 model (Armv8.0, the oldest CPU it supports) with no aarch64 libraries
# given to it: a static binary needs none.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/aarch64-env.sh

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
DIST=target/dist
mkdir -p "$DIST"
STATIC="-C target-feature=+crt-static"

echo "==> x86_64-unknown-linux-gnu (static)"
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="$STATIC" \
    cargo build --release --locked --target x86_64-unknown-linux-gnu -p qforge-cli
cp target/x86_64-unknown-linux-gnu/release/qforge "$DIST/qforge-$VERSION-x86_64-linux"
strip "$DIST/qforge-$VERSION-x86_64-linux"

echo "==> aarch64-unknown-linux-gnu (static)"
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="$AARCH64_RUSTFLAGS $STATIC" \
    aarch64_cargo build --release --locked -p qforge-cli
cp "$AARCH64_TARGET_DIR/release/qforge" "$DIST/qforge-$VERSION-aarch64-linux"
aarch64-linux-gnu-strip "$DIST/qforge-$VERSION-aarch64-linux"

echo "==> smoke test: each binary runs alone"
"$DIST/qforge-$VERSION-x86_64-linux" info
qemu-aarch64 -cpu cortex-a53 "$DIST/qforge-$VERSION-aarch64-linux" info

(cd "$DIST" && sha256sum "qforge-$VERSION-x86_64-linux" "qforge-$VERSION-aarch64-linux" > SHA256SUMS)
echo "==> $DIST"
for binary in "$DIST/qforge-$VERSION-x86_64-linux" "$DIST/qforge-$VERSION-aarch64-linux"; do
    printf '%s  %s bytes  %s\n' "$(basename "$binary")" "$(stat -c %s "$binary")" \
        "$(file -b "$binary" | grep -o 'stati[^,]*')"
done
cat "$DIST/SHA256SUMS"
