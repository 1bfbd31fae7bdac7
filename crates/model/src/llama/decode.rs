//! The decode step of models whose linear layers all run on the INT8
//! engine: one step advances any number of sequences, each on its own
//! [`KvCache`], as plain loops over buffers that grow to the largest batch
//! and are then reused, so a step allocates nothing once warm.
//!
//! Every linear layer is one u8 × i8 GEMM over all the sequences' rows
//! (one read of the weights serves the whole batch), attention runs for
//! every sequence and head in one parallel pass that reads each sequence's
//! cache where it lies, and every pass runs on a [`Team`] of threads.
//!
//! A sequence's logits do not depend on the batch it runs in: the INT8
//! layers are exact integer sums with per-row scales whatever the split,
//! and the norms, rotary embedding and attention of a row read that row
//! alone, in a fixed order. That is what keeps a rollout's behaviour
//! log-probabilities reproducible however the engine batched it.
//!
//! Measured motivation: at one token per step the linear layers of SmolLM2
//! took ≈ 3.8 ms of a 13.9 ms candle step; the rest was per-op overhead of the
//! norms, rotary embedding and attention, each op allocating its result.

use std::cell::RefCell;
use std::ops::Range;

use candle_core::{DType, Storage, Tensor};
use qforge_kernels::attention::{KeyValues, Queries, attend, reserve};
use qforge_kernels::gemm::{PANEL, SPLIT_CHANNELS_MIN_PANELS_PER_THREAD};
use qforge_kernels::{Int8Linear, Team};

use super::{KvCache, Layer, Llama, RotatedInput, Rotations};
use crate::error::{Error, Result};
use crate::linear::Linear;
use crate::observe::Observer;

/// Up to this many rows a layer with few panels is split by inputs (every
/// thread sums an equal share of every panel's inputs for all rows, the
/// shares added in the epilogue): a step that is mostly weight reads then
/// reads each byte once. Beyond it the work is mostly multiply-adds and
/// every thread takes whole rows, each turning a panel's sums into outputs
/// while they are in cache.
const SPLIT_INPUTS_MAX_ROWS: usize = 16;

/// The first error a parallel pass's threads met, for the caller.
struct FirstFailure(std::sync::OnceLock<qforge_kernels::Error>);

impl FirstFailure {
    fn new() -> Self {
        Self(std::sync::OnceLock::new())
    }

    /// Keeps `result`'s error if it is the first.
    fn note<T>(&self, result: qforge_kernels::Result<T>) {
        if let Err(error) = result {
            let _ = self.0.set(error);
        }
    }

    fn into_result(self) -> Result<()> {
        match self.0.into_inner() {
            Some(error) => Err(error.into()),
            None => Ok(()),
        }
    }
}

/// Quantized inputs and raw sums of the rows one thread projects.
#[derive(Default)]
struct RowScratch {
    inputs: Vec<u8>,
    scales: Vec<f32>,
    sums: Vec<i32>,
}

thread_local! {
    static ROWS: RefCell<RowScratch> = RefCell::default();
    /// One query group's heads, rotated for its position.
    static QUERIES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs a step's INT8 layers on a [`Team`] (see [`SPLIT_INPUTS_MAX_ROWS`]):
/// the layers that read the same input (q, k and v; gate and up) go in one
/// parallel pass, their input quantized once where their activations agree.
struct Projector {
    team: Team,
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
    fn new(threads: usize) -> Result<Self> {
        let team = Team::new(threads)
            .map_err(|e| Error::Unsupported(format!("starting the decode threads: {e}")))?;
        Ok(Self {
            team,
            inputs: Default::default(),
            scales: Default::default(),
            sums: Vec::new(),
        })
    }

    /// `outputs[j] = layers[j](x)` for up to three layers of one input of
    /// `rows` rows.
    fn project(
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

/// The INT8 layers of one decoder layer, in forward order.
struct Int8Layer<'m> {
    q: &'m Int8Linear,
    k: &'m Int8Linear,
    v: &'m Int8Linear,
    o: &'m Int8Linear,
    gate: &'m Int8Linear,
    up: &'m Int8Linear,
    down: &'m Int8Linear,
}

fn int8(linear: &Linear) -> Option<&Int8Linear> {
    match linear {
        Linear::Int8(layer) => Some(layer),
        _ => None,
    }
}

impl<'m> Int8Layer<'m> {
    fn of(layer: &'m Layer) -> Option<Self> {
        Some(Self {
            q: int8(&layer.q_proj)?,
            k: int8(&layer.k_proj)?,
            v: int8(&layer.v_proj)?,
            o: int8(&layer.o_proj)?,
            gate: int8(&layer.gate_proj)?,
            up: int8(&layer.up_proj)?,
            down: int8(&layer.down_proj)?,
        })
    }
}

/// An f32 tensor's values where they lie (no copy): the storage guard and
/// the range of its values.
struct F32View<Guard> {
    storage: Guard,
    range: Range<usize>,
}

impl F32View<()> {
    fn of(tensor: &Tensor) -> Result<F32View<impl std::ops::Deref<Target = Storage> + '_>> {
        let (storage, layout) = tensor.storage_and_layout();
        let range = layout
            .contiguous_offsets()
            .map(|(start, end)| start..end)
            .ok_or_else(|| Error::Unsupported("a strided tensor in the decode step".into()))?;
        Ok(F32View { storage, range })
    }
}

impl<Guard: std::ops::Deref<Target = Storage>> F32View<Guard> {
    fn values(&self) -> Result<&[f32]> {
        let Storage::Cpu(cpu) = &*self.storage else {
            return Err(Error::Unsupported("a tensor off the CPU".into()));
        };
        Ok(&cpu.as_slice::<f32>()?[self.range.clone()])
    }
}

/// Rows of every batch's activations, grown to the largest batch.
#[derive(Default)]
struct Buffers {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attended: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    out: Vec<f32>,
    logits: Vec<f32>,
    /// Each row's position in its sequence.
    positions: Vec<usize>,
    /// Each row's sequence.
    sequences: Vec<usize>,
    /// Each sequence's first row.
    first_rows: Vec<usize>,
    /// The final norm's output at each sequence's last row.
    last: Vec<f32>,
}

/// Sizes `buffer` to `len` values, allocating only to grow.
fn fit(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buffer.resize(len, 0.0);
    buffer
}

/// Advances sequences of all-INT8 models one token per step (see the
/// module docs). It holds threads and scratch only: the model and each
/// sequence's cache are the caller's, passed to every step.
pub struct Decoder {
    projector: Projector,
    buffers: Buffers,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("threads", &self.projector.team.threads())
            .finish()
    }
}

impl Decoder {
    /// A decoder whose steps run on `threads` threads (the caller's one of them).
    pub fn new(threads: usize) -> Result<Self> {
        Ok(Self {
            projector: Projector::new(threads)?,
            buffers: Buffers::default(),
        })
    }

    /// Whether `model` can step here: every linear layer, lm_head
    /// included, on the INT8 engine and the embedding, norms and rotary
    /// tables in f32 (the tensor forward serves the others).
    pub fn supports(model: &Llama) -> bool {
        let f32 = |t: &Tensor| t.dtype() == DType::F32;
        f32(&model.embed_tokens)
            && f32(&model.norm)
            && f32(&model.cos)
            && f32(&model.sin)
            && int8(&model.lm_head).is_some()
            && model.layers.iter().all(|layer| {
                Int8Layer::of(layer).is_some()
                    && f32(&layer.input_norm)
                    && f32(&layer.post_attention_norm)
            })
    }

    /// Feeds `tokens[i]` at the next position of the sequence cached in
    /// `caches[i]` and returns the logits there, `[n, vocab]` row by row.
    /// Every linear input is handed to `observer`. A failed step leaves the
    /// caches' committed positions as they were.
    pub fn step(
        &mut self,
        model: &Llama,
        caches: &mut [&mut KvCache],
        tokens: &[u32],
        observer: Option<&mut dyn Observer>,
    ) -> Result<&[f32]> {
        if tokens.len() != caches.len() {
            return Err(Error::Shape(format!(
                "a step needs one token per sequence: {} tokens for {} caches",
                tokens.len(),
                caches.len()
            )));
        }
        self.advance(model, caches, tokens, Chunks::One, observer)
    }

    /// Feeds each sequence a chunk of tokens, in one pass: sequence `i`
    /// (cached in `caches[i]`) takes the next `lengths[i]` tokens of `tokens`
    /// (the chunks in turn) at its next positions, each attending its own
    /// cache up to itself, as a prefill does. Returns the logits of each
    /// chunk's last position, `[n, vocab]`. Prompt chunks and decode tokens
    /// (chunks of one) share the pass, so the weights are read once for all.
    pub fn step_chunks(
        &mut self,
        model: &Llama,
        caches: &mut [&mut KvCache],
        tokens: &[u32],
        lengths: &[usize],
        observer: Option<&mut dyn Observer>,
    ) -> Result<&[f32]> {
        if lengths.len() != caches.len()
            || lengths.contains(&0)
            || lengths.iter().sum::<usize>() != tokens.len()
        {
            return Err(Error::Shape(format!(
                "chunks of {lengths:?} tokens (at least one each) for {} caches and {} tokens",
                caches.len(),
                tokens.len()
            )));
        }
        self.advance(model, caches, tokens, Chunks::Given(lengths), observer)
    }

    fn advance(
        &mut self,
        model: &Llama,
        caches: &mut [&mut KvCache],
        tokens: &[u32],
        chunks: Chunks<'_>,
        mut observer: Option<&mut dyn Observer>,
    ) -> Result<&[f32]> {
        let c = model.config();
        let (n, rows) = (caches.len(), tokens.len());
        prepare(model, caches, tokens, chunks)?;
        let b = &mut self.buffers;
        b.place(caches, chunks);
        let d = c.hidden_size;
        {
            let table = F32View::of(&model.embed_tokens)?;
            let table = table.values()?;
            for (row, &token) in fit(&mut b.x, rows * d).chunks_exact_mut(d).zip(tokens) {
                let at = token as usize * d;
                row.copy_from_slice(&table[at..at + d]);
            }
        }
        let (cos, sin) = (F32View::of(&model.cos)?, F32View::of(&model.sin)?);
        let pass = Pass {
            rows,
            eps: c.rms_norm_eps as f32,
            rope: Rope {
                cos: cos.values()?,
                sin: sin.values()?,
                half: c.head_dim / 2,
            },
            rotations: &model.rotations,
            attention: AttentionShape {
                heads: c.num_heads,
                group: c.num_heads / c.num_kv_heads,
                dim: c.head_dim,
                scale: 1.0 / (c.head_dim as f32).sqrt(),
            },
        };
        b.fit_rows(c, rows);
        for (i, layer) in model.layers.iter().enumerate() {
            decoder_layer(
                &mut self.projector,
                b,
                &pass,
                caches,
                (i, layer),
                &mut observer,
            )?;
        }
        let norm = F32View::of(&model.norm)?;
        normalize(
            &mut self.projector.team,
            pass.norm(norm.values()?, RotatedInput::Head, &b.out),
            &mut b.x,
            &mut b.h,
        )?;
        if let Some(observer) = observer {
            observer.observe("lm_head", &b.h, d)?;
        }
        // Logits at each chunk's last position only.
        b.last.clear();
        for (s, &first) in b.first_rows.iter().enumerate() {
            let row = first + chunks.length(s) - 1;
            b.last.extend_from_slice(&b.h[row * d..(row + 1) * d]);
        }
        let lm_head = int8(&model.lm_head).expect("checked by supports");
        let logits = fit(&mut b.logits, n * c.vocab_size);
        self.projector
            .project(n, &b.last, &[lm_head], &mut [logits])?;
        for (s, cache) in caches.iter_mut().enumerate() {
            cache.len += chunks.length(s);
        }
        Ok(&b.logits[..n * c.vocab_size])
    }
}

/// Refuses what a pass cannot run (no sequence, a model off the INT8
/// engine, a token outside the vocabulary, a position past the context, a
/// cache of another model) and makes room in each cache for its chunk.
fn prepare(
    model: &Llama,
    caches: &mut [&mut KvCache],
    tokens: &[u32],
    chunks: Chunks<'_>,
) -> Result<()> {
    if caches.is_empty() {
        return Err(Error::Shape("a step needs at least one sequence".into()));
    }
    if !Decoder::supports(model) {
        return Err(Error::Unsupported(
            "the INT8 decode step needs every linear layer on the INT8 engine and f32 norms".into(),
        ));
    }
    model.check_vocabulary(tokens)?;
    if let Some(longest) = caches
        .iter()
        .enumerate()
        .map(|(s, k)| k.len + chunks.length(s))
        .max()
    {
        model.check_positions(longest)?;
    }
    for (s, cache) in caches.iter_mut().enumerate() {
        model.check_cache(cache)?;
        let needed = cache.len + chunks.length(s);
        if needed > cache.capacity {
            cache.grow_to(needed.max(2 * cache.capacity));
        }
    }
    Ok(())
}

impl Buffers {
    /// Each row's sequence and position, and each sequence's first row.
    fn place(&mut self, caches: &[&mut KvCache], chunks: Chunks<'_>) {
        self.positions.clear();
        self.sequences.clear();
        self.first_rows.clear();
        for (s, cache) in caches.iter().enumerate() {
            let length = chunks.length(s);
            self.first_rows.push(self.positions.len());
            self.positions.extend(cache.len..cache.len + length);
            self.sequences.extend(std::iter::repeat_n(s, length));
        }
    }

    /// Sizes the activations for `rows` rows of a model of config `c`.
    fn fit_rows(&mut self, c: &super::LlamaConfig, rows: usize) {
        let (d, hd) = (c.hidden_size, c.head_dim);
        fit(&mut self.h, rows * d);
        fit(&mut self.out, rows * d);
        fit(&mut self.q, rows * c.num_heads * hd);
        fit(&mut self.k, rows * c.num_kv_heads * hd);
        fit(&mut self.v, rows * c.num_kv_heads * hd);
        fit(&mut self.attended, rows * c.num_heads * hd);
        fit(&mut self.gate, rows * c.intermediate_size);
        fit(&mut self.up, rows * c.intermediate_size);
        // The first layer adds no block output into the residual.
        self.out.fill(0.0);
    }
}

/// What every layer of one pass shares.
struct Pass<'a> {
    rows: usize,
    eps: f32,
    rope: Rope<'a>,
    rotations: &'a Rotations,
    attention: AttentionShape,
}

impl<'a> Pass<'a> {
    /// The norm of the residual with `add` added, by `weight`, rotated
    /// where the model rotates `input`.
    fn norm<'p>(&'p self, weight: &'p [f32], input: RotatedInput, add: &'p [f32]) -> NormPass<'p>
    where
        'a: 'p,
    {
        NormPass {
            rows: self.rows,
            eps: self.eps,
            weight,
            rotations: self.rotations,
            input,
            add,
        }
    }
}

/// Adds the block output `b.out` into the residual `b.x`, norms it into
/// `b.h` by `weight` (rotated where the model rotates `input`) and hands
/// `b.h` to `observer` as layer `i`'s input `point`.
fn residual_norm(
    team: &mut Team,
    pass: &Pass<'_>,
    (weight, input): (&Tensor, RotatedInput),
    b: &mut Buffers,
    observer: &mut Option<&mut dyn Observer>,
    (i, point): (usize, &str),
) -> Result<()> {
    let weight = F32View::of(weight)?;
    normalize(
        team,
        pass.norm(weight.values()?, input, &b.out),
        &mut b.x,
        &mut b.h,
    )?;
    observe(observer, i, point, &b.h, b.x.len() / pass.rows)
}

/// Decoder layer `i` over the pass's rows: the residual `b.x` takes the
/// previous block's output `b.out` (zeros before the first layer), and
/// `b.out` ends as this layer's MLP output.
fn decoder_layer(
    projector: &mut Projector,
    b: &mut Buffers,
    pass: &Pass<'_>,
    caches: &mut [&mut KvCache],
    (i, layer): (usize, &Layer),
    observer: &mut Option<&mut dyn Observer>,
) -> Result<()> {
    let int8 = Int8Layer::of(layer).expect("checked by supports");
    let rows = pass.rows;
    let team = &mut projector.team;
    let attention_input = (&layer.input_norm, RotatedInput::Attention);
    residual_norm(
        team,
        pass,
        attention_input,
        b,
        observer,
        (i, "self_attn.q_proj"),
    )?;
    projector.project(
        rows,
        &b.h,
        &[int8.q, int8.k, int8.v],
        &mut [&mut b.q, &mut b.k, &mut b.v],
    )?;
    let team = &mut projector.team;
    let rope = pass.rope;
    store(
        team,
        i,
        rope,
        &b.positions,
        &b.first_rows,
        &b.k,
        &b.v,
        caches,
    );
    let rows_of = (&b.sequences[..], &b.positions[..]);
    let q = &b.q;
    attend_all(
        team,
        i,
        pass.attention,
        rope,
        rows_of,
        q,
        caches,
        &mut b.attended,
    )?;
    let attended_width = b.attended.len() / rows;
    rotate_rows(
        team,
        pass.rotations,
        RotatedInput::AttentionOutput,
        rows,
        &mut b.attended,
    )?;
    observe(observer, i, "self_attn.o_proj", &b.attended, attended_width)?;
    projector.project(rows, &b.attended, &[int8.o], &mut [&mut b.out])?;
    let team = &mut projector.team;
    let mlp_input = (&layer.post_attention_norm, RotatedInput::Mlp);
    residual_norm(team, pass, mlp_input, b, observer, (i, "mlp.gate_proj"))?;
    projector.project(
        rows,
        &b.h,
        &[int8.gate, int8.up],
        &mut [&mut b.gate, &mut b.up],
    )?;
    swiglu(
        &mut projector.team,
        pass.rotations,
        rows,
        &mut b.gate,
        &b.up,
    )?;
    let intermediate = b.gate.len() / rows;
    observe(observer, i, "mlp.down_proj", &b.gate, intermediate)?;
    projector.project(rows, &b.gate, &[int8.down], &mut [&mut b.out])
}

/// How many tokens each sequence of a pass takes.
#[derive(Clone, Copy)]
enum Chunks<'a> {
    /// One each (a decode step).
    One,
    /// `lengths[i]` for sequence `i`.
    Given(&'a [usize]),
}

impl Chunks<'_> {
    /// Tokens sequence `s` takes.
    fn length(self, s: usize) -> usize {
        match self {
            Chunks::One => 1,
            Chunks::Given(lengths) => lengths[s],
        }
    }
}

/// Hands layer `i`'s input `point` (`rows` of `width` values) to `observer`.
fn observe(
    observer: &mut Option<&mut dyn Observer>,
    i: usize,
    point: &str,
    rows: &[f32],
    width: usize,
) -> Result<()> {
    match observer.as_deref_mut() {
        Some(observer) => observer.observe(&format!("model.layers.{i}.{point}"), rows, width),
        None => Ok(()),
    }
}

/// The rotary tables, `[positions, half]` each.
#[derive(Clone, Copy)]
struct Rope<'a> {
    cos: &'a [f32],
    sin: &'a [f32],
    half: usize,
}

impl Rope<'_> {
    /// Half-split rotary embedding of one head at `position`.
    fn apply(self, head: &mut [f32], position: usize) {
        let at = position * self.half..(position + 1) * self.half;
        let (cos, sin) = (&self.cos[at.clone()], &self.sin[at]);
        let (first, second) = head.split_at_mut(self.half);
        for i in 0..self.half {
            let (a, b) = (first[i], second[i]);
            first[i] = a * cos[i] - b * sin[i];
            second[i] = b * cos[i] + a * sin[i];
        }
    }
}

/// One RMSNorm pass over a batch's residual rows.
struct NormPass<'a> {
    rows: usize,
    eps: f32,
    weight: &'a [f32],
    rotations: &'a Rotations,
    /// The rotation the normed rows then take (where the model has it).
    input: RotatedInput,
    /// A block's output to add into the residual first.
    add: &'a [f32],
}

/// `x += add`, then `h = rms_norm(x) · weight`, rotated as
/// `pass.input` asks; in parallel over rows.
fn normalize(team: &mut Team, pass: NormPass<'_>, x: &mut [f32], h: &mut [f32]) -> Result<()> {
    let d = pass.weight.len();
    let failure = FirstFailure::new();
    let rotation = pass.rotations.get(pass.input);
    team.run_rows(
        pass.rows,
        [&mut x[..pass.rows * d], &mut h[..pass.rows * d]],
        |rows, [x, h]| {
            for (a, &b) in x.iter_mut().zip(&pass.add[rows.start * d..rows.end * d]) {
                *a += b;
            }
            for (x, h) in x.chunks_exact(d).zip(h.chunks_exact_mut(d)) {
                rms_norm(x, pass.weight, pass.eps, h);
            }
            if let Some(rotation) = rotation {
                failure.note(rotation.rotate(h));
            }
        },
    );
    failure.into_result()
}

/// Rotates every row of `rows` (`n` rows) where the model rotates `input`.
fn rotate_rows(
    team: &mut Team,
    rotations: &Rotations,
    input: RotatedInput,
    n: usize,
    rows: &mut [f32],
) -> Result<()> {
    let Some(rotation) = rotations.get(input) else {
        return Ok(());
    };
    let failure = FirstFailure::new();
    let width = rows.len() / n;
    team.run_rows(n, [&mut rows[..n * width]], |_, [rows]| {
        failure.note(rotation.rotate(rows));
    });
    failure.into_result()
}

/// `gate = silu(gate) · up`, rotated where the model rotates the MLP's
/// product; in parallel over rows.
fn swiglu(
    team: &mut Team,
    rotations: &Rotations,
    n: usize,
    gate: &mut [f32],
    up: &[f32],
) -> Result<()> {
    let width = gate.len() / n;
    team.run_rows(n, [&mut gate[..n * width]], |rows, [gate]| {
        for (g, &u) in gate
            .iter_mut()
            .zip(&up[rows.start * width..rows.end * width])
        {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
    });
    rotate_rows(team, rotations, RotatedInput::MlpProduct, n, gate)
}

/// Writes every row's keys (rotated for its position) and values into its
/// sequence's cache at layer `layer`, position `positions[row]`; sequence
/// `s`'s rows start at `first_rows[s]` and run to the next sequence's. In
/// parallel over sequences.
#[allow(clippy::too_many_arguments)]
fn store(
    team: &mut Team,
    layer: usize,
    rope: Rope<'_>,
    positions: &[usize],
    first_rows: &[usize],
    keys: &[f32],
    values: &[f32],
    caches: &mut [&mut KvCache],
) {
    let n = caches.len();
    let width = keys.len() / positions.len();
    team.run_rows(n, [caches], |sequences, [caches]| {
        for (s, cache) in sequences.zip(caches.iter_mut()) {
            let end = first_rows.get(s + 1).copied().unwrap_or(positions.len());
            let (capacity, hd) = (cache.capacity, cache.head_dim);
            let cached = &mut cache.layers[layer];
            let rows = first_rows[s]..end;
            for (row, &position) in rows.clone().zip(&positions[rows]) {
                let at = row * width..(row + 1) * width;
                let heads = keys[at.clone()]
                    .chunks_exact(hd)
                    .zip(values[at].chunks_exact(hd));
                for (head, (key, value)) in heads.enumerate() {
                    let slot =
                        (head * capacity + position) * hd..(head * capacity + position + 1) * hd;
                    let cached_key = &mut cached.keys[slot.clone()];
                    cached_key.copy_from_slice(key);
                    rope.apply(cached_key, position);
                    cached.values[slot].copy_from_slice(value);
                }
            }
        }
    });
}

/// The query heads of a step and how they share key/value heads.
#[derive(Clone, Copy)]
struct AttentionShape {
    heads: usize,
    /// Query heads per key/value head.
    group: usize,
    /// Values per head.
    dim: usize,
    /// What multiplies each score.
    scale: f32,
}

/// Attention of every row's query heads (`q`, rotated here for the row's
/// position) over its sequence's cache up to and including that position,
/// into `out`; `rows` gives each row's sequence and position.
///
/// Every (row, head) pair is one unit and each thread takes a contiguous
/// share of them, a key/value head's query heads of one row attended
/// together so that its cache is read once per thread: one row's heads
/// split over the threads (SmolLM2's 9 heads 4:5 over two), many rows split
/// by row. A head's result depends on nothing but its query and its
/// sequence's cache.
#[allow(clippy::too_many_arguments)]
fn attend_all(
    team: &mut Team,
    layer: usize,
    shape: AttentionShape,
    rope: Rope<'_>,
    (sequences, positions): (&[usize], &[usize]),
    q: &[f32],
    caches: &[&mut KvCache],
    out: &mut [f32],
) -> Result<()> {
    let AttentionShape {
        heads,
        group,
        dim,
        scale,
    } = shape;
    let rows = positions.len();
    // The scratch is sized by capacity, which a reserved cache keeps,
    // rather than by the growing length.
    let longest = caches.iter().map(|c| c.capacity).max().unwrap_or(1);
    let failure = FirstFailure::new();
    team.run_rows(
        rows * heads,
        [&mut out[..rows * heads * dim]],
        |units, [mut out]| {
            // Sized once per thread for the largest cache, so that steps do not
            // allocate.
            reserve(group, longest);
            QUERIES.with_borrow_mut(|queries| {
                let mut unit = units.start;
                while !out.is_empty() {
                    let (row, head) = (unit / heads, unit % heads);
                    let kv_head = head / group;
                    let count = ((kv_head + 1) * group - head).min(out.len() / dim);
                    let (these, rest) = out.split_at_mut(count * dim);
                    let position = positions[row];
                    queries.clear();
                    queries.extend_from_slice(&q[(row * heads + head) * dim..][..count * dim]);
                    for query in queries.chunks_exact_mut(dim) {
                        rope.apply(query, position);
                    }
                    let cache = &caches[sequences[row]];
                    let cached = &cache.layers[layer];
                    let attended = attend(
                        Queries {
                            rows: queries,
                            head_stride: dim,
                            position_stride: 0,
                            visible: &[position + 1],
                        },
                        KeyValues {
                            keys: &cached.keys,
                            values: &cached.values,
                            offset: kv_head * cache.capacity * dim,
                            stride: dim,
                        },
                        dim,
                        scale,
                        these,
                    );
                    failure.note(attended);
                    (unit, out) = (unit + count, rest);
                }
            });
        },
    );
    failure.into_result()
}

/// RMSNorm in the arithmetic of candle's `rms_norm`, which the tensor
/// forward runs (the squares summed in order, each value divided by the root
/// mean square, then scaled), so a decode step computes the tensor path's
/// bits.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let root_mean_square = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v / root_mean_square * w;
    }
}
