#!/usr/bin/env bash
# Replays the server attacks of issues 18 and 55 against `qforge serve` on 127.0.0.1 and prints
# a table: attack, expected, observed, pass/fail (exit 1 when a row fails).
#
#   scripts/attack.sh                  # builds and uses target/release/qforge
#   QFORGE=path/to/qforge scripts/attack.sh   # any build, an older one included
#   scripts/attack.sh --only web_page,huge_reward   # some attacks (attack.py's names)
#
# It serves the bundled CartPole policy quantized to an INT8 artifact (or, where the
# accuracy guard refuses it on this CPU, the policy directory itself), one fresh server
# per attack, each on a free loopback port. Attacks: slowloris (trickled headers), an
# idle-connection flood at a lowered descriptor limit (ulimit -n 256 for the server),
# SIGTERM while clients trickle, oversized and stalled bodies, unauthenticated /metrics,
# a feedback flood from one session and a burst from 40, a reward of 1e308, a web page's
# text/plain, form and foreign-Origin posts to a server without a token, the arm an
# unquantized policy's answers name, and (on the
# SmolLM2 GGUF, when scripts/fetch-models.sh has fetched it)
# a chat message that writes a system turn or a role. Then, outside the server
# (scripts/attack_offline.py, on a redis-server of its own when one is installed): a
# results entry no worker can follow, a result appended without the cluster key, a worker
# holding another key, Redis frozen under a worker's --outage-limit, and an artifact whose
# weight scale was set to 1e-40 with its manifest rewritten. Every attack is bounded in
# connections and time; the whole run is cut at 10 minutes. Needs python3 (standard
# library only).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
QFORGE=${QFORGE:-$ROOT/target/release/qforge}
if [[ ! -x $QFORGE ]]; then
    echo "attack.sh: building $QFORGE" >&2
    cargo build --release --locked -p qforge-cli --manifest-path "$ROOT/Cargo.toml" >&2
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/qforge-attack-XXXXXX")
trap 'rm -rf "$WORK"' EXIT

MODEL=$ROOT/fixtures/policies/cartpole
if (cd "$WORK" && "$QFORGE" quantize -o artifact --json >quantize.json 2>quantize.err); then
    MODEL=$WORK/artifact
    echo "attack.sh: serving the INT8 CartPole artifact" >&2
else
    echo "attack.sh: qforge quantize refused CartPole here ($(tail -1 "$WORK/quantize.err" | cut -c1-120)…); serving the policy directory" >&2
fi

LANGUAGE_MODEL=$ROOT/models/smollm2-135m-instruct-q4_1.gguf
[[ -f $LANGUAGE_MODEL ]] || LANGUAGE_MODEL=
timeout 600 python3 "$ROOT/scripts/attack.py" "$QFORGE" "$MODEL" ${LANGUAGE_MODEL:+"$LANGUAGE_MODEL"} "$@"
