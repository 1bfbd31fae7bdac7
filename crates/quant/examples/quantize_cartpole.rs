//! Quantizes the bundled CartPole policy with the library alone: the default
//! recipe, calibration on this machine's cores, the guard, and the artifact.
use std::path::Path;

use qforge_quant::{Inputs, Pipeline, QuantRecipe};
use qforge_runner::EmbeddedExecutor;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let policy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/cartpole");
    let inputs = Inputs::new(&policy, policy.join("rollouts.jsonl"));
    let executor = EmbeddedExecutor::per_core();
    let quantized = Pipeline::new(QuantRecipe::default(), &executor)?.run(&inputs, &mut ())?;
    let out = std::env::temp_dir().join("qforge-cartpole-int8");
    std::fs::create_dir_all(&out)?;
    quantized.write(&out)?;
    println!("accepted: {}, written to {out:?}", quantized.accepted());
    Ok(())
}
