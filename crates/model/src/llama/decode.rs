//! A single-sequence decode step for models whose linear layers all run on
//! the INT8 engine: plain loops over preallocated buffers instead of a chain
//! of tensor ops, so a step allocates nothing once the decoder exists.
//!
//! Measured motivation: at one token per step the linear layers of SmolLM2
//! took ≈ 3.8 ms of a 13.9 ms candle step; the rest was per-op overhead of the
//! norms, rotary embedding and attention, each op allocating its result.

use candle_core::{DType, Storage, Tensor};
use qforge_kernels::attention::{KeyValues, Queries, attend, reserve};
use qforge_kernels::gemm::{PANEL, SPLIT_CHANNELS_MIN_PANELS_PER_THREAD};
use qforge_kernels::{Int8Linear, Team};

use super::{KvCache, Layer, Llama, RotatedInput};
use crate::error::{Error, Result};
use crate::linear::Linear;

/// Runs a decode step's INT8 layers on a [`Team`]: the layers that read the
/// same input (q, k and v; gate and up) are quantized once and computed in
/// one parallel step, each thread summing an equal share of every layer's
/// inputs (a GEMV's bytes split evenly whatever its panel count), and the
/// shares added in the epilogue; a lone layer with many panels (lm_head) is
/// split by panels instead.
struct Projector {
    team: Team,
    /// Quantized inputs and their scales, one slot per layer of a step (a
    /// layer whose activations match the first layer's reuses slot 0).
    inputs: [Vec<u8>; 3],
    scales: [Vec<f32>; 3],
    /// Raw sums, `[thread][layer][panel][PANEL]`.
    sums: Vec<i32>,
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

    /// `outputs[j] = layers[j](x)` for up to three layers of one input.
    fn project(
        &mut self,
        x: &[f32],
        layers: &[&Int8Linear],
        outputs: &mut [&mut [f32]],
    ) -> Result<()> {
        let slot = |j: usize| {
            let shares = j > 0 && layers[j].activations() == layers[0].activations();
            if shares { 0 } else { j }
        };
        for (j, layer) in layers.iter().enumerate() {
            if slot(j) == j {
                layer.quantize(x, 1, &mut self.inputs[j], &mut self.scales[j])?;
            }
        }
        let threads = self.team.threads();
        let part_len: usize = layers.iter().map(|l| l.packed().panels() * PANEL).sum();
        let inputs = &self.inputs;
        let parts = match layers {
            [layer]
                if layer.packed().panels() >= SPLIT_CHANNELS_MIN_PANELS_PER_THREAD * threads =>
            {
                // Many panels (lm_head): each thread streams a contiguous
                // range of them, its sums in place.
                self.sums.resize(part_len, 0);
                let packed = layer.packed();
                let groups = packed.groups_per_panel();
                self.team.run_chunks(&mut self.sums, PANEL, |start, sums| {
                    let first = start / PANEL;
                    let panels = first..first + sums.len() / PANEL;
                    packed.raw_sums(&inputs[0], 1, panels, 0..groups, sums);
                });
                1
            }
            _ => {
                // Each thread sums an equal share of every layer's inputs.
                self.sums.resize(threads * part_len, 0);
                self.team
                    .run_chunks(&mut self.sums, part_len, |start, part| {
                        let thread = start / part_len;
                        let mut at = 0;
                        for (j, layer) in layers.iter().enumerate() {
                            let packed = layer.packed();
                            let len = packed.panels() * PANEL;
                            let groups = packed.group_share(threads, thread);
                            packed.raw_sums(
                                &inputs[slot(j)],
                                1,
                                0..packed.panels(),
                                groups,
                                &mut part[at..at + len],
                            );
                            at += len;
                        }
                    });
                threads
            }
        };
        let mut at = 0;
        for (j, (layer, y)) in layers.iter().zip(outputs.iter_mut()).enumerate() {
            layer.dequantize(&self.sums[at..], parts, part_len, &self.scales[slot(j)], y);
            at += layer.packed().panels() * PANEL;
        }
        Ok(())
    }
}

/// The INT8 layers and f32 norm weights of one decoder layer.
struct DecodeLayer<'m> {
    input_norm: Vec<f32>,
    q: &'m Int8Linear,
    k: &'m Int8Linear,
    v: &'m Int8Linear,
    o: &'m Int8Linear,
    post_attention_norm: Vec<f32>,
    gate: &'m Int8Linear,
    up: &'m Int8Linear,
    down: &'m Int8Linear,
    /// Keys and values of positions `0..len`, head-major: `[kv_heads,
    /// capacity, head_dim]`, so that a step's attention streams each head's
    /// keys and values as one contiguous run (position-major, each head read
    /// 256 of every 768 bytes at SmolLM2's shape, and 4 096 positions
    /// decoded at 0.85× llama.cpp's speed).
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl DecodeLayer<'_> {
    /// Stores position `pos`'s keys and values, given position-major (every
    /// head's `head_dim` values in turn, as the projections give them), into
    /// the head-major cache of `capacity` positions per head.
    fn store(
        &mut self,
        pos: usize,
        capacity: usize,
        head_dim: usize,
        keys: &[f32],
        values: &[f32],
    ) {
        let heads = keys
            .chunks_exact(head_dim)
            .zip(values.chunks_exact(head_dim));
        for (head, (key, value)) in heads.enumerate() {
            let at = (head * capacity + pos) * head_dim;
            self.keys[at..at + head_dim].copy_from_slice(key);
            self.values[at..at + head_dim].copy_from_slice(value);
        }
    }
}

/// Generates one token at a time for one sequence (see the module docs).
pub struct Decoder<'m> {
    model: &'m Llama,
    layers: Vec<DecodeLayer<'m>>,
    norm: Vec<f32>,
    lm_head: &'m Int8Linear,
    /// cos and sin tables, `[positions, head_dim / 2]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
    len: usize,
    capacity: usize,
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
    projector: Projector,
}

fn int8(linear: &Linear) -> Option<&Int8Linear> {
    match linear {
        Linear::Int8(layer) => Some(layer),
        _ => None,
    }
}

fn f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl<'m> Decoder<'m> {
    /// A decoder for up to `capacity` positions, or `None` when some linear
    /// layer (lm_head included) is not on the INT8 engine or the embedding is
    /// not f32 (the tensor forward serves those).
    pub fn new(model: &'m Llama, capacity: usize) -> Result<Option<Self>> {
        let c = model.config();
        let capacity = capacity.min(model.cos.dims()[0]);
        if model.embed_tokens.dtype() != DType::F32 {
            return Ok(None);
        }
        let kv = c.num_kv_heads * c.head_dim;
        let mut layers = Vec::with_capacity(model.layers.len());
        for layer in &model.layers {
            let Layer {
                input_norm,
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                post_attention_norm,
                gate_proj,
                up_proj,
                down_proj,
            } = layer;
            let (Some(q), Some(k), Some(v), Some(o), Some(gate), Some(up), Some(down)) = (
                int8(q_proj),
                int8(k_proj),
                int8(v_proj),
                int8(o_proj),
                int8(gate_proj),
                int8(up_proj),
                int8(down_proj),
            ) else {
                return Ok(None);
            };
            layers.push(DecodeLayer {
                input_norm: f32_vec(input_norm)?,
                q,
                k,
                v,
                o,
                post_attention_norm: f32_vec(post_attention_norm)?,
                gate,
                up,
                down,
                keys: vec![0.0; capacity * kv],
                values: vec![0.0; capacity * kv],
            });
        }
        let Some(lm_head) = int8(&model.lm_head) else {
            return Ok(None);
        };
        let d = c.hidden_size;
        Ok(Some(Self {
            model,
            layers,
            norm: f32_vec(&model.norm)?,
            lm_head,
            cos: f32_vec(&model.cos)?,
            sin: f32_vec(&model.sin)?,
            len: 0,
            capacity,
            x: vec![0.0; d],
            h: vec![0.0; d],
            q: vec![0.0; c.num_heads * c.head_dim],
            k: vec![0.0; kv],
            v: vec![0.0; kv],
            attended: vec![0.0; c.num_heads * c.head_dim],
            gate: vec![0.0; c.intermediate_size],
            up: vec![0.0; c.intermediate_size],
            out: vec![0.0; d.max(c.intermediate_size)],
            logits: vec![0.0; c.vocab_size],
            projector: Projector::new(rayon::current_num_threads())?,
        }))
    }

    /// Positions decoded so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position has been decoded.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Continues from a tensor forward's cache (a prefill of one sequence).
    pub fn load_cache(&mut self, cache: &KvCache) -> Result<()> {
        if cache.len > self.capacity {
            return Err(Error::Shape(format!(
                "{} cached positions exceed the decoder's capacity of {}",
                cache.len, self.capacity
            )));
        }
        self.model.check_cache(cache)?;
        let run = self.capacity * cache.head_dim;
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for head in 0..cache.kv_heads {
                let (keys, values) = cache.head(i, head);
                layer.keys[head * run..][..keys.len()].copy_from_slice(keys);
                layer.values[head * run..][..values.len()].copy_from_slice(values);
            }
        }
        self.len = cache.len;
        Ok(())
    }

    /// Feeds `token` at the next position and returns the logits there.
    pub fn step(&mut self, token: u32) -> Result<&[f32]> {
        let c = self.model.config();
        let (d, hd) = (c.hidden_size, c.head_dim);
        self.model.check_vocabulary(std::slice::from_ref(&token))?;
        if self.len >= self.capacity {
            return Err(Error::Shape(format!(
                "the decoder is full ({} positions)",
                self.capacity
            )));
        }
        {
            let (storage, layout) = self.model.embed_tokens.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                return Err(Error::Unsupported("embeddings off the CPU".into()));
            };
            let table = cpu.as_slice::<f32>()?;
            let start = layout.start_offset() + token as usize * d;
            self.x.copy_from_slice(&table[start..start + d]);
        }
        let pos = self.len;
        let half = hd / 2;
        let (cos, sin) = (
            &self.cos[pos * half..(pos + 1) * half],
            &self.sin[pos * half..(pos + 1) * half],
        );
        let eps = c.rms_norm_eps as f32;
        let heads = Heads {
            dim: hd,
            group: c.num_heads / c.num_kv_heads,
            capacity: self.capacity,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let model = self.model;
        let rotations = &model.rotations;
        let rotate = |input: RotatedInput, x: &mut [f32]| -> Result<()> {
            if let Some(rotation) = rotations.get(input) {
                rotation.rotate(x)?;
            }
            Ok(())
        };
        for layer in &mut self.layers {
            rms_norm(&self.x, &layer.input_norm, eps, &mut self.h);
            rotate(RotatedInput::Attention, &mut self.h)?;
            self.projector.project(
                &self.h,
                &[layer.q, layer.k, layer.v],
                &mut [&mut self.q, &mut self.k, &mut self.v],
            )?;
            for head in self
                .q
                .chunks_exact_mut(hd)
                .chain(self.k.chunks_exact_mut(hd))
            {
                rope(head, cos, sin);
            }
            layer.store(pos, self.capacity, hd, &self.k, &self.v);
            attend_heads(
                &mut self.projector.team,
                &self.q,
                layer,
                heads,
                pos + 1,
                &mut self.attended,
            )?;
            rotate(RotatedInput::AttentionOutput, &mut self.attended)?;
            let out = &mut self.out[..d];
            self.projector
                .project(&self.attended, &[layer.o], &mut [out])?;
            add(&mut self.x, out);
            rms_norm(&self.x, &layer.post_attention_norm, eps, &mut self.h);
            rotate(RotatedInput::Mlp, &mut self.h)?;
            self.projector.project(
                &self.h,
                &[layer.gate, layer.up],
                &mut [&mut self.gate, &mut self.up],
            )?;
            for (g, &u) in self.gate.iter_mut().zip(&self.up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            rotate(RotatedInput::MlpProduct, &mut self.gate)?;
            let out = &mut self.out[..d];
            self.projector
                .project(&self.gate, &[layer.down], &mut [out])?;
            add(&mut self.x, out);
        }
        rms_norm(&self.x, &self.norm, eps, &mut self.h);
        rotate(RotatedInput::Head, &mut self.h)?;
        self.projector
            .project(&self.h, &[self.lm_head], &mut [&mut self.logits])?;
        self.len += 1;
        Ok(&self.logits)
    }
}

/// The query heads of a decode step and the cache they attend.
#[derive(Clone, Copy)]
struct Heads {
    /// Values per head.
    dim: usize,
    /// Query heads per key/value head.
    group: usize,
    /// Positions the cache holds per head (its head-major stride).
    capacity: usize,
    /// What multiplies each score.
    scale: f32,
}

/// Attention of the query heads `q` over the first `visible` positions of
/// `layer`'s cache, into `out`, on `team`.
///
/// Query heads are independent, and a head's result does not depend on the
/// heads attended beside it: each thread attends a share of the heads, those
/// sharing a key/value head together so that its cache is read once per
/// thread. Shares of heads rather than of groups: SmolLM2's 3 groups of 3
/// split 6:3 over two threads, its 9 heads 4:5.
fn attend_heads(
    team: &mut Team,
    q: &[f32],
    layer: &DecodeLayer<'_>,
    heads: Heads,
    visible: usize,
    out: &mut [f32],
) -> Result<()> {
    let Heads {
        dim,
        group,
        capacity,
        scale,
    } = heads;
    let failure = std::sync::OnceLock::new();
    team.run_chunks(out, dim, |start, mut out| {
        // Sized once per thread for the longest sequence, so that steps do
        // not allocate.
        reserve(group, capacity);
        let mut head = start / dim;
        while !out.is_empty() {
            let kv_head = head / group;
            let count = ((kv_head + 1) * group - head).min(out.len() / dim);
            let (these, rest) = out.split_at_mut(count * dim);
            let attended = attend(
                Queries {
                    rows: &q[head * dim..],
                    head_stride: dim,
                    position_stride: 0,
                    visible: &[visible],
                },
                KeyValues {
                    keys: &layer.keys,
                    values: &layer.values,
                    offset: kv_head * capacity * dim,
                    stride: dim,
                },
                dim,
                scale,
                these,
            );
            if let Err(error) = attended {
                let _ = failure.set(error);
            }
            (head, out) = (head + count, rest);
        }
    });
    match failure.into_inner() {
        Some(error) => Err(error.into()),
        None => Ok(()),
    }
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

/// Half-split rotary embedding of one head at one position.
fn rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (first, second) = head.split_at_mut(half);
    for i in 0..half {
        let (a, b) = (first[i], second[i]);
        first[i] = a * cos[i] - b * sin[i];
        second[i] = b * cos[i] + a * sin[i];
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
