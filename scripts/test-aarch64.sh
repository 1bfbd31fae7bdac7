#!/usr/bin/env bash
# qforge on aarch64, under emulation (qemu-aarch64, user mode), on an x86-64 machine:
#
# 1. qforge-core's and qforge-kernels' tests, cross-built, on two CPU models:
#    `max` (NEON, dotprod and i8mm: every Arm tier runs its exact-sums tests) and
#    `cortex-a53` (Armv8.0, base NEON only: the fallbacks are what run).
# 2. The CartPole INT8 artifact, quantized on this machine, run by the aarch64
#    `qforge` on three CPU models (one per GEMM tier): `qforge act` prints the same bytes as the x86-64
#    build (actions and head outputs), and `qforge serve` answers `/v1/act` with
#    the same answers as the x86-64 server.
# 3. SmolLM2 on the INT8 engine (`qforge eval perplexity`, 62 tokens): the same
#    perplexity to the last bit with the i8mm tier (`max`) and base NEON
#    (`cortex-a53`). Against x86-64 it may differ in the last digits: the integer
#    sums are equal, but SiLU's exp and RoPE's sin/cos come from each platform's libm.
#
# Cross-building is set up by scripts/aarch64-env.sh (Debian's Rust and cross
# linker, qemu-user). Three minutes on 2 cores once built; building takes longer
# (the aarch64 `qforge` alone took 6 minutes here with some dependencies built).
#
# `--kernels` runs step 1 alone: what scripts/test.sh runs, about 3 minutes from
# nothing installed (set-up 30 s, build 110 s, the tests 45 s).
set -euo pipefail
cd "$(dirname "$0")/.."
KERNELS_ONLY=false
case "${1:-}" in
    --kernels) KERNELS_ONLY=true ;;
    "") ;;
    *) echo "usage: $0 [--kernels]" >&2; exit 2 ;;
esac
source scripts/aarch64-env.sh

step() { printf '\n==> %s\n' "$*"; }
SYSROOT=/usr/aarch64-linux-gnu
# `max` has every Arm extension, `cortex-a53` none (Armv8.0); `cortex-a76` has
# dotprod but not i8mm, so the artifact also runs on the middle tier.
TEST_CPUS=(max cortex-a53)
# What each test CPU model has: the tests check that the probe finds it, so no
# tier is skipped on `max` unnoticed.
declare -A CPU_FEATURES=([max]=neon,dotprod,i8mm [cortex-a53]=neon)
RUN_CPUS=(max cortex-a76 cortex-a53)

# The tests build the crates' dev-dependencies, among them the peers the benches
# compare against (candle, rten, criterion), which no test runs: compiled without
# optimisation they build in half the time. What the tests do run (random numbers,
# proptest, rayon, hashes) stays optimised, or the tests take twice as long.
TEST_PROFILE=(--config 'profile.test.package."*".opt-level=0')
for package in rand rand_core rand_chacha rand_distr ppv-lite86 proptest rand_xorshift \
    rayon rayon-core crossbeam-deque crossbeam-epoch crossbeam-utils libm sha2 crc32fast; do
    TEST_PROFILE+=(--config "profile.test.package.$package.opt-level=2")
done
for cpu in "${TEST_CPUS[@]}"; do
    step "aarch64 kernel tests under qemu-aarch64 -cpu $cpu"
    QFORGE_EXPECT_CPU_FEATURES=${CPU_FEATURES[$cpu]} \
        CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu -L $SYSROOT" \
        aarch64_cargo test --locked -p qforge-core -p qforge-kernels --lib --tests "${TEST_PROFILE[@]}"
done
if $KERNELS_ONLY; then
    exit 0
fi

step "qforge for aarch64, and the CartPole INT8 artifact quantized on x86-64"
aarch64_cargo build --locked --profile test -p qforge-cli
cargo build --locked --profile test -p qforge-cli
HOST=target/debug/qforge
ARM="$AARCH64_TARGET_DIR/debug/qforge"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$HOST" quantize -o "$work/cartpole-int8" --json >/dev/null
OBSERVATIONS=fixtures/policies/cartpole/rollouts.jsonl
act() { "$@" act --model "$work/cartpole-int8" --observations "$OBSERVATIONS" --json; }
act "$HOST" >"$work/x86.json"

for cpu in "${RUN_CPUS[@]}"; do
    emulated="qemu-aarch64 -cpu $cpu -L $SYSROOT $ARM"
    step "qforge act and serve on aarch64 ($cpu: $($emulated info --json | python3 -c \
        'import json, sys; print(json.load(sys.stdin)["tiers"]["gemm"])') GEMM)"
    act $emulated >"$work/$cpu.json"
    cmp "$work/x86.json" "$work/$cpu.json"
    echo "qforge act: $(wc -c <"$work/x86.json") bytes of actions and outputs, the same as x86-64's"
    python3 scripts/serve_same_answers.py "$OBSERVATIONS" \
        --reference "$HOST serve --model $work/cartpole-int8" \
        --candidate "$emulated serve --model $work/cartpole-int8"
done

step "SmolLM2 int8-dynamic perplexity: the i8mm and base NEON tiers agree exactly"
scripts/fetch-models.sh
head -c 600 fixtures/text/eval.txt >"$work/text.txt"
perplexity() {
    "$@" eval perplexity --model models/smollm2-135m-instruct-q4_1.gguf --text "$work/text.txt" \
        --ctx 64 --precision int8-dynamic --json
}
perplexity "$HOST" >"$work/ppl-x86.json"
for cpu in max cortex-a53; do
    perplexity qemu-aarch64 -cpu "$cpu" -L "$SYSROOT" "$ARM" >"$work/ppl-$cpu.json"
done
cmp "$work/ppl-max.json" "$work/ppl-cortex-a53.json"
python3 - "$work" <<'PY'
import json, sys
ppl = {name: json.load(open(f"{sys.argv[1]}/ppl-{name}.json"))["perplexity"]
       for name in ("x86", "max")}
print(f"perplexity on aarch64 {ppl['max']!r} (both tiers), x86-64 {ppl['x86']!r}, "
      f"relative difference {abs(ppl['max'] / ppl['x86'] - 1):.1e}")
PY
