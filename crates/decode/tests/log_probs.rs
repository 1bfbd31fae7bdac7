//! Token log-probabilities of SmolLM2: teacher forcing against the
//! incremental decode, and token bytes against the text they spell.

use std::path::Path;

use candle_core::Tensor;
use qforge_decode::Decoder;
use qforge_decode::sampling::{continuation_log_probs, sample, token_log_prob};
use qforge_model::{Activations, LanguageModel, Logits};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn smollm2() -> LanguageModel {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/smollm2-135m-instruct-q4_1.gguf");
    LanguageModel::load(&path).expect("scripts/fetch-models.sh fetches SmolLM2")
}

/// How a decode feeds the model one token at a time.
#[derive(Clone, Copy, Debug)]
enum Feed {
    /// `forward` with a cache, as `generate` without the INT8 decoder.
    Forward,
    /// The batched `step`, as the server's engine (a batch of one).
    Step,
    /// The allocation-free INT8 `Decoder`, as `generate` (all-INT8 only).
    Decoder,
}

/// Samples `n` tokens after `prompt` one decode step at a time, with each
/// token's log-probability as the step saw it.
fn decode(
    lm: &LanguageModel,
    prompt: &[u32],
    n: usize,
    temperature: f64,
    feed: Feed,
) -> (Vec<u32>, Vec<f64>) {
    let mut cache = lm.model.new_cache();
    let mut rng = StdRng::seed_from_u64(11);
    let (mut tokens, mut log_probs) = (Vec::new(), Vec::new());
    let flat = |logits: Tensor| logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut row = flat(
        lm.model
            .forward(&[prompt.to_vec()], Some(&mut cache), None, Logits::Last)
            .unwrap(),
    );
    let mut decoder = match feed {
        Feed::Decoder => {
            assert!(Decoder::supports(&lm.model), "every linear INT8");
            Some(Decoder::new(2).unwrap())
        }
        Feed::Forward | Feed::Step => None,
    };
    for _ in 0..n {
        let token = sample(&row, Some(temperature), &mut rng).unwrap();
        log_probs.push(token_log_prob(&row, Some(temperature), token, 0).log_prob);
        tokens.push(token);
        row = match (feed, decoder.as_mut()) {
            (Feed::Forward, _) => flat(
                lm.model
                    .forward(&[vec![token]], Some(&mut cache), None, Logits::Last)
                    .unwrap(),
            ),
            (Feed::Step, _) => flat(lm.model.step(&mut [&mut cache], &[token], None).unwrap()),
            (Feed::Decoder, Some(decoder)) => decoder
                .step(&lm.model, &mut [&mut cache], &[token], None)
                .unwrap()
                .to_vec(),
            (Feed::Decoder, None) => unreachable!("the decoder is made above"),
        };
    }
    (tokens, log_probs)
}

fn int8(mut lm: LanguageModel) -> LanguageModel {
    lm.model = lm
        .model
        .with_linears(|_, layer| layer.to_int8(Activations::Dynamic))
        .unwrap();
    lm
}

/// The largest difference of two runs' log-probabilities, and where.
fn worst(a: &[f64], b: &[f64]) -> (usize, f64) {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold((0, 0.0), |w, (i, d)| if d > w.1 { (i, d) } else { w })
}

#[test]
fn teacher_forced_log_probs_equal_the_decodes_own() {
    let fp = smollm2();
    let prompt = fp
        .text
        .tokenizer
        .encode("The capital of France is")
        .unwrap();
    // Long enough for the matrix products' blocking to change with the
    // number of rows (it did from 17 on).
    let n = 70;
    // FP32 linears are candle's matrix products, whose sums group
    // differently for 1 row and for 75: close, not equal.
    for feed in [Feed::Forward, Feed::Step] {
        let (tokens, stepped) = decode(&fp, &prompt, n, 0.8, feed);
        let forced = continuation_log_probs(&fp.model, &prompt, &tokens, Some(0.8)).unwrap();
        let (at, by) = worst(&stepped, &forced);
        assert!(by < 1e-4, "fp32 {feed:?}, token {at}: off by {by}");
    }
    // INT8 linears sum exactly per row, attention is per query and the
    // decoder's norms are candle's: the same bits however the tokens are fed.
    let lm = int8(fp);
    for feed in [Feed::Forward, Feed::Step, Feed::Decoder] {
        let (tokens, stepped) = decode(&lm, &prompt, n, 0.8, feed);
        let forced = continuation_log_probs(&lm.model, &prompt, &tokens, Some(0.8)).unwrap();
        assert_eq!(stepped, forced, "int8 {feed:?}");
        assert!(stepped.iter().all(|&l| l <= 0.0 && l.is_finite()));
    }
}

#[test]
fn teacher_forcing_needs_a_prompt_and_scores_nothing_for_nothing() {
    let lm = smollm2();
    assert!(continuation_log_probs(&lm.model, &[], &[1, 2], None).is_err());
    assert!(
        continuation_log_probs(&lm.model, &[1, 2], &[], None)
            .unwrap()
            .is_empty()
    );
}

#[test]
fn token_bytes_spell_the_text_even_inside_a_character() {
    let lm = smollm2();
    let tokenizer = &lm.text.tokenizer;
    let text = "Grüße, 世界 🦀 <|im_end|>\n\ttabs";
    let ids = tokenizer.encode(text).unwrap();
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&id| tokenizer.token_bytes(id))
        .collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), text);
    // The crab is four bytes the vocabulary has no single token for: some
    // token holds part of a character.
    assert!(
        ids.iter()
            .any(|&id| std::str::from_utf8(&tokenizer.token_bytes(id)).is_err()),
        "no token split a character: {ids:?}"
    );
}
