"""`scripts/rl_loop.py` end to end on a short run: the learner's rollouts come from
`qforge serve`, and after every update the new weights go through `qforge requantize`
(frozen scales) and `POST /admin/reload`. The script itself refuses an `/v1/act` answer
from any model version but the one it just reloaded, so finishing means every update's
rollouts came from that update's weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QFORGE = os.environ.get("QFORGE", str(ROOT / "target/release/qforge"))


def test_int8_rollouts_follow_every_weight_sync(tmp_path):
    updates = 4
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/rl_loop.py"), "--qforge", QFORGE,
         "--modes", "fp,int8-tis", "--seeds", "1", "--updates", str(updates),
         "--episodes", "4", "--out", str(tmp_path)],
        capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| int8-tis |" in out.stdout
    results = {r["mode"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    fp, int8 = results["fp"], results["int8-tis"]
    assert len(int8["returns"]) == len(int8["sync_ms"]) == updates
    # Every sync changed some int8 weights: the served policy moved with the learner.
    assert all(0 < share <= 1 for share in int8["changed_share"]), int8["changed_share"]
    # The learner's own samples have no gap; the served INT8 policy's log-probs
    # (what /v1/act returned for its sampled actions) differ from the learner's
    # FP log-probs, but by far less than a nat.
    assert max(fp["logprob_mismatch"]) < 1e-9, fp["logprob_mismatch"]
    assert all(0 < gap < 0.1 for gap in int8["logprob_mismatch"]), int8["logprob_mismatch"]
    assert (tmp_path / "returns.svg").read_text().startswith("<svg")
