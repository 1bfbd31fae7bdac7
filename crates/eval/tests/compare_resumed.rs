//! The comparison the guard ranks layers by, resumed from the reference's
//! kept hidden states, is the whole comparison bit for bit, on a small
//! random model in a Hugging Face directory.

#[path = "../../model/tests/support/tiny_llama.rs"]
mod tiny_llama;

use qforge_eval::{ReferenceLogProbs, compare_from, compare_to, perplexity};
use qforge_model::Llama;
use tiny_llama::{one_input_int8, tiny_model};

#[test]
fn a_comparison_resumed_at_a_layer_is_the_whole_comparison() {
    let dir = tiny_model("compare-resumed");
    let model = Llama::from_hf_dir(&dir).unwrap();
    let tokens: Vec<u32> = (0..19).map(|i| (i * 5 % 96) as u32).collect();
    let reference = ReferenceLogProbs::keeping_states(&model, &tokens, tokens.len()).unwrap();
    // The reference's perplexity, read from what it kept, is the one a
    // forward of it gives, bit for bit.
    let forward = perplexity(&model, &tokens, tokens.len()).unwrap();
    assert_eq!(reference.perplexity(), forward.perplexity);
    for point in ["model.layers.1.mlp.down_proj", "lm_head"] {
        let changed = one_input_int8(&model, point);
        let layer = Llama::layer_of(point).unwrap_or(model.config().num_layers);
        let whole = compare_to(&changed, &reference, &tokens).unwrap();
        assert!(whole.kl_divergence > 0.0, "{point} changed nothing");
        assert_eq!(
            compare_from(&changed, &reference, &tokens, layer).unwrap(),
            whole,
            "{point}"
        );
        assert_eq!(whole.reference_perplexity, forward.perplexity, "{point}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
