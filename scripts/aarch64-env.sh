# Sourced by scripts/test-aarch64.sh and scripts/release.sh: sets up cross-building
# for aarch64-unknown-linux-gnu on a Debian 12 x86-64 machine whose only network is
# Debian's mirrors, and defines `aarch64_cargo`.
#
# rustup cannot fetch the aarch64 standard library here, so this uses Debian's
# bookworm-security Rust (rustc-web / cargo-web 1.96, a compiler as new as the
# project's) with the arm64 build of its standard library, unpacked from the .deb
# (installing it would pull an arm64 LLVM), plus Debian's cross linker and qemu-user.
#
# `+fp16`: candle's `gemm-f16` writes half-precision FMLA in inline assembly without
# enabling the feature, which Debian's LLVM refuses. It lets LLVM use FP16
# arithmetic, which f32 code does not: release.sh checks that the binary runs on a
# Cortex-A53 model, which has none.

AARCH64_TARGET=aarch64-unknown-linux-gnu
AARCH64_TARGET_DIR=target/aarch64/$AARCH64_TARGET
AARCH64_RUSTFLAGS="-C target-feature=+fp16"

aarch64_setup() {
    local rustlib=/usr/lib/rustlib/$AARCH64_TARGET sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null \
        || [ ! -x /usr/bin/cargo ] || ! /usr/bin/rustc --version | grep -q '^rustc 1\.9'; then
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
            rustc-web cargo-web gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user file \
            >/dev/null
    fi
    if [ ! -d "$rustlib" ]; then
        dpkg --print-foreign-architectures | grep -qx arm64 || $sudo dpkg --add-architecture arm64
        $sudo apt-get update -qq
        local scratch
        scratch=$(mktemp -d)
        (cd "$scratch" && apt-get download -qq \
            "libstd-rust-web-dev:arm64=$(dpkg-query -W -f='${Version}' rustc-web)")
        dpkg-deb -x "$scratch"/libstd-rust-web-dev_*_arm64.deb "$scratch/x"
        $sudo cp -r "$scratch/x$rustlib" "$rustlib"
        rm -rf "$scratch"
    fi
}

# Debian's cargo for the aarch64 target, in its own target directory so that the
# host's builds (rustup's compiler) are left alone.
aarch64_cargo() {
    RUSTC=/usr/bin/rustc CARGO_TARGET_DIR=target/aarch64 \
        CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
        CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="${CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS:-$AARCH64_RUSTFLAGS}" \
        /usr/bin/cargo "$1" --target "$AARCH64_TARGET" "${@:2}"
}

aarch64_setup
