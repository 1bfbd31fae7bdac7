//! The decode step's linear layers: which thread sums what, for a pass of
//! one to three layers over a batch's rows.

use std::cell::RefCell;
use std::ops::Range;

use qforge_kernels::gemm::{PANEL, SPLIT_CHANNELS_MIN_PANELS_PER_THREAD};
use qforge_kernels::{Int8Linear, Team};

use super::passes::FirstFailure;
use qforge_model::Result;

/// Up to this many rows a layer with few panels is split by inputs (every
/// thread sums an equal share of every panel's inputs for all rows, the
/// shares added in the epilogue): a step that is mostly weight reads then
/// reads each byte once. Beyond it the work is mostly multiply-adds and
/// every thread takes whole rows, each turning a panel's sums into outputs
/// while they are in cache.
const SPLIT_INPUTS_MAX_ROWS: usize = 16;

/// Quantized inputs and raw sums of the rows one thread projects.
#[derive(Default)]
struct RowScratch {
    inputs: Vec<u8>,
    scales: Vec<f32>,
    sums: Vec<i32>,
}
thread_local! {
    static ROWS: RefCell<RowScratch> = RefCell::default();
}

/// Runs a step's INT8 layers on a [`Team`] (see [`SPLIT_INPUTS_MAX_ROWS`]):
/// the layers that read the same input (q, k and v; gate and up) go in one
/// parallel pass, their input quantized once where their activations agree.
pub(super) struct Projector {
    pub(super) team: Team,
    /// Quantized inputs and their scales, one slot per layer of a pass (a
    /// layer whose activations match the first layer's reuses slot 0).
    inputs: [Vec<u8>; 3],
    scales: [Vec<f32>; 3],
    /// Raw sums of a split by inputs, `[thread][layer][panel][row][PANEL]`.
    sums: Vec<i32>,
}

/// Which input slot layer `j` of a pass reads.
fn slot(layers: &[&Int8Linear], j: usize) -> usize {
    let shares = j > 0 && layers[j].activations() == layers[0].activations();
    if shares { 0 } else { j }
}

impl Projector {
    pub(super) fn new(threads: usize) -> Result<Self> {
        let team = Team::new(threads).map_err(|e| {
            qforge_formats::Error::Unsupported(format!("starting the decode threads: {e}"))
        })?;
        Ok(Self {
            team,
            inputs: Default::default(),
            scales: Default::default(),
            sums: Vec::new(),
        })
    }

    /// `outputs[j] = layers[j](x)` for up to three layers of one input of
    /// `rows` rows.
    pub(super) fn project(
        &mut self,
        rows: usize,
        x: &[f32],
        layers: &[&Int8Linear],
        outputs: &mut [&mut [f32]],
    ) -> Result<()> {
        let threads = self.team.threads();
        let lone_wide = matches!(layers, [layer]
            if layer.packed().panels() >= SPLIT_CHANNELS_MIN_PANELS_PER_THREAD * threads);
        if rows > SPLIT_INPUTS_MAX_ROWS {
            return self.project_by_rows(rows, x, layers, outputs);
        }
        for (j, layer) in layers.iter().enumerate() {
            if slot(layers, j) == j {
                layer.quantize(x, rows, &mut self.inputs[j], &mut self.scales[j])?;
            }
        }
        let part_len: usize = layers
            .iter()
            .map(|l| l.packed().panels() * rows * PANEL)
            .sum();
        let inputs = &self.inputs;
        let parts = if lone_wide {
            // Many panels (lm_head): each thread streams a contiguous range
            // of them, its sums in place.
            self.sums.resize(part_len, 0);
            let packed = layers[0].packed();
            let groups = packed.groups_per_panel();
            self.team
                .run_chunks(&mut self.sums, rows * PANEL, |start, sums| {
                    let first = start / (rows * PANEL);
                    let panels = first..first + sums.len() / (rows * PANEL);
                    packed.raw_sums(&inputs[0], rows, panels, 0..groups, sums);
                });
            1
        } else {
            self.sums.resize(threads * part_len, 0);
            self.team
                .run_chunks(&mut self.sums, part_len, |start, part| {
                    let thread = start / part_len;
                    let mut at = 0;
                    for (j, layer) in layers.iter().enumerate() {
                        let packed = layer.packed();
                        let len = packed.panels() * rows * PANEL;
                        packed.raw_sums(
                            &inputs[slot(layers, j)],
                            rows,
                            0..packed.panels(),
                            packed.group_share(threads, thread),
                            &mut part[at..at + len],
                        );
                        at += len;
                    }
                });
            threads
        };
        let mut at = 0;
        for (j, (layer, y)) in layers.iter().zip(outputs.iter_mut()).enumerate() {
            let scales = &self.scales[slot(layers, j)];
            layer.dequantize(&self.sums[at..], parts, part_len, scales, y);
            at += layer.packed().panels() * rows * PANEL;
        }
        Ok(())
    }

    /// [`Self::project`] with every thread taking whole rows: it quantizes
    /// them, and for each panel sums them and writes their outputs.
    fn project_by_rows(
        &mut self,
        rows: usize,
        x: &[f32],
        layers: &[&Int8Linear],
        outputs: &mut [&mut [f32]],
    ) -> Result<()> {
        let width = layers[0].shape().1;
        let failure = FirstFailure::new();
        let pass = |share: Range<usize>, outputs: &mut [&mut [f32]]| {
            ROWS.with_borrow_mut(|scratch| {
                let x = &x[share.start * width..share.end * width];
                for (j, (layer, y)) in layers.iter().zip(outputs.iter_mut()).enumerate() {
                    let reuse = j > 0 && slot(layers, j) == 0;
                    if !reuse {
                        let quantized = layer.quantize(
                            x,
                            share.len(),
                            &mut scratch.inputs,
                            &mut scratch.scales,
                        );
                        if quantized.is_err() {
                            failure.note(quantized);
                            return;
                        }
                    }
                    let packed = layer.packed();
                    scratch.sums.resize(share.len() * PANEL, 0);
                    for panel in 0..packed.panels() {
                        packed.raw_sums(
                            &scratch.inputs,
                            share.len(),
                            panel..panel + 1,
                            0..packed.groups_per_panel(),
                            &mut scratch.sums,
                        );
                        layer.dequantize_panel(panel, &scratch.sums, &scratch.scales, y);
                    }
                }
            });
        };
        match outputs {
            [a] => self.team.run_rows(rows, [&mut **a], |share, [a]| {
                pass(share, &mut [a]);
            }),
            [a, b] => self
                .team
                .run_rows(rows, [&mut **a, &mut **b], |share, [a, b]| {
                    pass(share, &mut [a, b]);
                }),
            [a, b, c] => {
                self.team
                    .run_rows(rows, [&mut **a, &mut **b, &mut **c], |share, [a, b, c]| {
                        pass(share, &mut [a, b, c])
                    })
            }
            _ => unreachable!("a pass projects one to three layers"),
        }
        failure.into_result()
    }
}
