//! Times GPTQ's solver once on one layer input of a given width: the
//! factorization and inverse (`Gptq::new`), then the rounding of a
//! `[rows, width]` weight (`Gptq::round`). For widths too large for the
//! criterion bench's ten samples, as Llama-3-8B's `down_proj` input
//! (14 336) is: one factorization there takes most of a minute.
//!
//! The Hessian is the Kac–Murdock–Szegő matrix `0.9^|i−j|` (positive
//! definite, built in a moment); the solver does the same arithmetic
//! whatever the values, so its time is that of a real layer's.
//!
//! Run: `cargo run --release -p qforge-quant --example gptq_solve -- 14336 4096`

use std::time::Instant;

use qforge_quant::gptq::{Gptq, GptqOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: gptq_solve WIDTH ROWS";
    let width: usize = args.next().ok_or(usage)?.parse()?;
    let rows: usize = args.next().ok_or(usage)?.parse()?;
    let hessian: Vec<f64> = (0..width * width)
        .map(|at| 0.9f64.powi((at / width).abs_diff(at % width) as i32))
        .collect();
    let started = Instant::now();
    let solver = Gptq::new(hessian, width, &GptqOptions::default())?;
    let factor = started.elapsed().as_secs_f64();
    let weight: Vec<f32> = (0..rows * width)
        .map(|at| ((at * 7_919) % 1_000) as f32 * 1e-4 - 0.05)
        .collect();
    let started = Instant::now();
    let rounded = solver.round(&weight, rows)?;
    let round = started.elapsed().as_secs_f64();
    let threads = rayon::current_num_threads();
    println!(
        "width {width}, {rows} rows, {threads} threads: factorization and inverse {factor:.2} s, rounding {round:.2} s ({} int8 values)",
        rounded.values.len()
    );
    Ok(())
}
