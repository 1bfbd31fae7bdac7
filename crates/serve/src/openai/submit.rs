//! The engine's side of a checked request: one engine request carrying
//! every choice (choice `i` draws with `seed + i`), sent to the arm the
//! rollout picks, and, when the rollout samples it, the FP shadow that
//! scores INT8's tokens afterwards.
//!
//! Apart from the handlers because this is where a request becomes the
//! engine's and the rollout's business: seeds, arms and the shadow
//! comparison, none of which the response shapes need to know.

use std::sync::Arc;

use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tokio::sync::oneshot;

use super::MAX_CHOICES;
use super::check::Checked;
use crate::engine::{Event, Finished, Replay, Request, Script, Sibling};
use crate::rollout::Arm;
use crate::state::{AppState, Backend, LanguageBackend};

/// Hands a checked request to the engine of `arm` (with the FP shadow
/// replaying its first choice when the rollout says so) and counts the
/// answer; gives each choice's events and the admission notice, or `None`
/// when the engine has stopped.
pub(super) fn submit(
    state: &Arc<AppState>,
    lm: &LanguageBackend,
    checked: Checked,
    number: u64,
    arm: Arm,
) -> Option<(Vec<UnboundedReceiver<Event>>, oneshot::Receiver<u64>)> {
    // Choice `i` draws with `seed + i`; an unseeded request's choices take
    // seeds no other request's choices take.
    let seed = checked
        .seed
        .unwrap_or(number.wrapping_mul(MAX_CHOICES as u64));
    let (events, receiver) = unbounded_channel();
    let mut receivers = vec![receiver];
    let siblings = (1..checked.choices as u64)
        .map(|i| {
            let (events, receiver) = unbounded_channel();
            receivers.push(receiver);
            Sibling {
                seed: seed.wrapping_add(i),
                events,
                finished: None,
            }
        })
        .collect();
    let (admitted, admission) = oneshot::channel();
    let request = Request {
        prompt: checked.prompt,
        max_tokens: checked.max_tokens,
        ignore_eos: checked.ignore_eos,
        temperature: checked.temperature,
        seed,
        stop: checked.stop,
        log_probs: checked.log_probs,
        forced: None,
        events,
        finished: None,
        admitted: Some(admitted),
        siblings,
    };
    let request = if arm == Arm::Int8 && lm.rollout.shadow_this() {
        let (finished, int8) = oneshot::channel();
        let shadowed = Request {
            // The comparison needs INT8's log-probs, asked for or not
            // (unasked, the response spells none).
            log_probs: Some(request.log_probs.unwrap_or(0)),
            finished: Some(finished),
            ..request
        };
        tokio::spawn(shadow(Arc::clone(state), shadowed.script(), int8));
        shadowed
    } else {
        request
    };
    if !lm.engine(arm).submit(request) {
        return None;
    }
    lm.rollout.count_answer(arm);
    Some((receivers, admission))
}

/// Once INT8 has answered a request, has the FP reference score INT8's
/// tokens on the same prompt (teacher forcing, same seed): at each position
/// whether FP's own draw is INT8's token counts toward the agreement, and
/// |log π_int8 − log π_fp| of the token goes to
/// `qforge_logprob_mismatch` (and its windowed mean, which raises
/// `qforge_logprob_mismatch_alert`). The client never waits for it.
async fn shadow(lm: Arc<AppState>, script: Script, int8: oneshot::Receiver<Finished>) {
    let Backend::Language(backend) = &lm.backend else {
        return;
    };
    let Some(fp) = &backend.fp else { return };
    // No timeout: both runs end (max_tokens bounds them) or their engine
    // lets go of them. A timeout cut the comparison of every long
    // completion, so the rollout never judged those.
    let Ok(int8) = int8.await else { return };
    let Replay {
        request: scoring,
        events: _keep_open,
        finished: scored,
    } = script.scoring(int8.tokens.clone());
    if !fp.submit(scoring) {
        return;
    }
    let Ok(fp) = scored.await else { return };
    if fp.version != int8.version {
        // A reload came between the two runs: they are not one model's
        // INT8 and FP twins.
        return;
    }
    let agreements: Vec<bool> = int8
        .tokens
        .iter()
        .zip(&fp.chosen)
        .map(|(ours, theirs)| ours == theirs)
        .collect();
    backend.rollout.record_agreement(&agreements);
    let gaps: Vec<f64> = int8
        .log_probs
        .iter()
        .zip(&fp.log_probs)
        .map(|(ours, theirs)| (ours - theirs).abs())
        .collect();
    backend.rollout.record_logprob_mismatches(&gaps);
}
