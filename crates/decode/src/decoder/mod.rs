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

mod passes;
mod projector;

use std::ops::Range;

use candle_core::{DType, Storage, Tensor};
use qforge_kernels::{Int8Linear, Team};

use self::passes::{
    AttendedRows, AttentionShape, NormPass, Rope, Together, attend_all, normalize, observe,
    rotate_rows, store, swiglu,
};
use self::projector::Projector;
use qforge_formats::llama_config::LlamaConfig;
use qforge_model::llama::{Layer, Rotations};
use qforge_model::{KvCache, Linear, Llama, Observer, Result, RotatedInput};

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
            .ok_or_else(|| {
                qforge_formats::Error::Unsupported("a strided tensor in the decode step".into())
            })?;
        Ok(F32View { storage, range })
    }
}

impl<Guard: std::ops::Deref<Target = Storage>> F32View<Guard> {
    fn values(&self) -> Result<&[f32]> {
        let Storage::Cpu(cpu) = &*self.storage else {
            return Err(qforge_formats::Error::Unsupported("a tensor off the CPU".into()).into());
        };
        Ok(&cpu.as_slice::<f32>()?[self.range.clone()])
    }
}

/// Most rows that attend together: 16 rows of SmolLM2's 3-head groups
/// are 48 queries, 12 KiB, beside 8 keys or 64 values at a time in L1.
const TOGETHER_ROWS: usize = 16;

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
    /// Which rows attend together with each row.
    together: Vec<Together>,
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
        f32(model.embed_tokens())
            && f32(model.final_norm())
            && f32(model.rope_tables().0)
            && f32(model.rope_tables().1)
            && int8(model.lm_head()).is_some()
            && model.layers().iter().all(|layer| {
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
            return Err(qforge_formats::Error::Shape(format!(
                "a step needs one token per sequence: {} tokens for {} caches",
                tokens.len(),
                caches.len()
            ))
            .into());
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
            return Err(qforge_formats::Error::Shape(format!(
                "chunks of {lengths:?} tokens (at least one each) for {} caches and {} tokens",
                caches.len(),
                tokens.len()
            ))
            .into());
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
            let table = F32View::of(model.embed_tokens())?;
            let table = table.values()?;
            for (row, &token) in fit(&mut b.x, rows * d).chunks_exact_mut(d).zip(tokens) {
                let at = token as usize * d;
                row.copy_from_slice(&table[at..at + d]);
            }
        }
        let (cos, sin) = (
            F32View::of(model.rope_tables().0)?,
            F32View::of(model.rope_tables().1)?,
        );
        let pass = Pass {
            rows,
            eps: c.rms_norm_eps as f32,
            rope: Rope {
                cos: cos.values()?,
                sin: sin.values()?,
                half: c.head_dim / 2,
            },
            rotations: model.rotations(),
            attention: AttentionShape {
                heads: c.num_heads,
                group: c.num_heads / c.num_kv_heads,
                dim: c.head_dim,
                scale: 1.0 / (c.head_dim as f32).sqrt(),
            },
        };
        b.fit_rows(c, rows);
        for (i, layer) in model.layers().iter().enumerate() {
            decoder_layer(
                &mut self.projector,
                b,
                &pass,
                caches,
                (i, layer),
                &mut observer,
            )?;
        }
        let norm = F32View::of(model.final_norm())?;
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
        let lm_head = int8(model.lm_head()).expect("checked by supports");
        let logits = fit(&mut b.logits, n * c.vocab_size);
        self.projector
            .project(n, &b.last, &[lm_head], &mut [logits])?;
        for (s, cache) in caches.iter_mut().enumerate() {
            cache.commit(chunks.length(s));
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
        return Err(
            qforge_formats::Error::Shape("a step needs at least one sequence".into()).into(),
        );
    }
    if !Decoder::supports(model) {
        return Err(qforge_formats::Error::Unsupported(
            "the INT8 decode step needs every linear layer on the INT8 engine and f32 norms".into(),
        )
        .into());
    }
    model.check_vocabulary(tokens)?;
    if let Some(longest) = caches
        .iter()
        .enumerate()
        .map(|(s, k)| k.len() + chunks.length(s))
        .max()
    {
        model.check_positions(longest)?;
    }
    for (s, cache) in caches.iter_mut().enumerate() {
        model.check_cache(cache)?;
        cache.make_room_for(cache.len() + chunks.length(s));
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
            self.positions.extend(cache.len()..cache.len() + length);
            self.sequences.extend(std::iter::repeat_n(s, length));
        }
        self.group_siblings(caches);
    }

    /// Which rows attend together: the rows of consecutive sequences
    /// whose caches were forked from one (the `n` samples of a prompt,
    /// which a server steps side by side), in groups of at most
    /// [`TOGETHER_ROWS`], read their shared prefix once per group.
    /// Every other row attends alone.
    fn group_siblings(&mut self, caches: &[&mut KvCache]) {
        self.together.clear();
        let rows = self.positions.len();
        let mut s = 0;
        while s < caches.len() {
            let prefix = caches[s].shared_prefix();
            // An unforked cache is a family of one.
            let family = match prefix {
                Some(_) => caches[s..]
                    .iter()
                    .take_while(|cache| cache.shared_prefix() == prefix)
                    .count(),
                None => 1,
            };
            let start = self.first_rows[s];
            let end = self.first_rows.get(s + family).copied().unwrap_or(rows);
            let shared = prefix.map_or(0, |prefix| prefix.len);
            for group in (start..end).step_by(TOGETHER_ROWS) {
                let group_end = (group + TOGETHER_ROWS).min(end);
                let members = if family > 1 { group_end - group } else { 1 };
                for row in group..group_end {
                    let visible = self.positions[row] + 1;
                    let common = if members > 1 { shared.min(visible) } else { 0 };
                    self.together.push(Together {
                        end: if members > 1 { group_end } else { row + 1 },
                        reads: visible - common + common.div_ceil(members),
                    });
                }
            }
            s += family;
        }
    }

    /// Sizes the activations for `rows` rows of a model of config `c`.
    fn fit_rows(&mut self, c: &LlamaConfig, rows: usize) {
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
    let rows_of = AttendedRows {
        sequences: &b.sequences,
        positions: &b.positions,
        together: &b.together,
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of consecutive forks of one cache attend together, at most 16
    /// at a time; a fork apart from its family, an unforked cache and
    /// another family's forks do not join them.
    #[test]
    fn consecutive_forks_of_one_cache_attend_together() {
        let (mut origin, mut other) = (KvCache::default(), KvCache::default());
        let mut caches: Vec<KvCache> = (0..18).map(|_| origin.fork()).collect();
        caches.push(KvCache::default());
        caches.extend([other.fork(), other.fork()]);
        caches.push(origin.fork());
        let refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let mut buffers = Buffers::default();
        buffers.place(&refs, Chunks::Given(&[1, 2].repeat(11)));
        let ends: Vec<usize> = buffers.together.iter().map(|t| t.end).collect();
        // 18 forks of 1 and 2 rows (27 rows): 16 rows, then 11; the
        // unforked cache's row alone; the other family's 3 rows; the fork
        // apart, its 2 rows each alone.
        let mut expected = vec![16; 16];
        expected.extend([27; 11]);
        expected.push(28);
        expected.extend([31; 3]);
        expected.extend([32, 33]);
        assert_eq!(ends, expected);
    }
}
