//! The tensor forward: a batch (or one cached sequence) to logits, one decode
//! step for several cached sequences, and the forwards that keep hidden states
//! and resume from them, with the checks on tokens and positions they share
//! with the INT8 decoder of `qforge-decode`. The decoder is the fast path;
//! this forward is the reference it is tested against.

use candle_core::{D, DType, Device, Tensor};

use super::stack::{HiddenState, Span};
use super::{KvCache, Llama, Logits, MAX_POSITIONS, attention};
use crate::error::Result;
use crate::observe::Observer;

impl Llama {
    /// Runs the decoder over a batch of token sequences.
    ///
    /// Sequences of different lengths are right-padded; padded positions are
    /// masked out of attention and never observed. With a `cache`, the batch is
    /// one sequence whose positions continue after the cached ones (a failed
    /// forward leaves the cache as it was). Every distinct linear input is
    /// handed to `observer`.
    pub fn forward(
        &self,
        batch: &[Vec<u32>],
        cache: Option<&mut KvCache>,
        observer: Option<&mut dyn Observer>,
        logits: Logits,
    ) -> Result<Tensor> {
        let start = cache.as_ref().map_or(0, |k| k.len);
        if let Some(kv) = cache.as_ref() {
            self.check_cache(kv)?;
            if batch.len() != 1 {
                return Err(qforge_formats::Error::Shape(format!(
                    "a KV cache holds one sequence: a batch of {} with a cache",
                    batch.len()
                ))
                .into());
            }
        }
        let Embedded {
            x,
            cos,
            sin,
            lengths,
        } = self.embedded(batch, start)?;
        let seq = x.dim(1)?;
        let mut cache = cache;
        let kv_heads = self.config.num_kv_heads;
        let x = self.decoder_stack(
            x,
            (&cos, &sin),
            &lengths,
            observer,
            Span::default(),
            |i, q, k, v| match cache.as_deref_mut() {
                Some(kv) => {
                    kv.append(i, k, v, 0)?;
                    attention::causal(q, &[kv.view(i, start)], kv_heads, &lengths)
                }
                None => attention::causal_over_tensors(q, k, v, &lengths),
            },
        );
        // A failed forward's keys lie past `len`, where nothing reads them.
        if let (Some(kv), Ok(_)) = (cache, &x) {
            kv.len += seq;
        }
        self.logits_of(x?, &lengths, logits)
    }

    /// The logits `logits` asks for from the decoder stack's output `x`.
    fn logits_of(&self, x: Tensor, lengths: &[usize], logits: Logits) -> Result<Tensor> {
        let x = match logits {
            Logits::All => x,
            Logits::Last => {
                let rows: Vec<Tensor> = lengths
                    .iter()
                    .enumerate()
                    .map(|(s, &len)| x.get(s)?.get(len - 1))
                    .collect::<candle_core::Result<_>>()?;
                Tensor::stack(&rows, 0)?
            }
        };
        self.lm_head.forward(&x)
    }

    /// [`Llama::forward`] without a cache or observer, also giving the
    /// hidden states entering every decoder layer and the one after the last
    /// (entering the final norm): a model that differs from this one only
    /// from some layer on can then start there ([`Llama::forward_resuming`]).
    pub fn forward_keeping(
        &self,
        batch: &[Vec<u32>],
        logits: Logits,
    ) -> Result<(Tensor, Vec<HiddenState>)> {
        let Embedded {
            x,
            cos,
            sin,
            lengths,
        } = self.embedded(batch, 0)?;
        let mut kept = Vec::with_capacity(self.layers.len() + 1);
        let x = self.decoder_stack(
            x,
            (&cos, &sin),
            &lengths,
            None,
            Span {
                kept: Some(&mut kept),
                keep_every: true,
                ..Span::default()
            },
            |_, q, k, v| attention::causal_over_tensors(q, k, v, &lengths),
        )?;
        Ok((self.logits_of(x, &lengths, logits)?, kept))
    }

    /// [`Llama::forward`] without a cache or observer, starting from
    /// `resume` (a hidden state that [`Llama::forward_keeping`] of this
    /// model, or of one with the same layers before `resume.layer`, kept
    /// for `batch`) instead of the embedding. The layers run compute exactly
    /// what they compute from the embedding (the same operations on the
    /// same values).
    pub fn forward_resuming(
        &self,
        batch: &[Vec<u32>],
        resume: &HiddenState,
        logits: Logits,
    ) -> Result<Tensor> {
        let Embedded {
            x,
            cos,
            sin,
            lengths,
        } = self.embedded(batch, 0)?;
        let x = self.decoder_stack(
            self.resumed(&x, resume)?,
            (&cos, &sin),
            &lengths,
            None,
            Span {
                first: resume.layer,
                ..Span::default()
            },
            |_, q, k, v| attention::causal_over_tensors(q, k, v, &lengths),
        )?;
        self.logits_of(x, &lengths, logits)
    }

    /// `resume`'s state, checked to fit the batch whose embedding is
    /// `embedded` and this model's layers.
    pub(super) fn resumed(&self, embedded: &Tensor, resume: &HiddenState) -> Result<Tensor> {
        if resume.x.dims() != embedded.dims() || resume.layer > self.layers.len() {
            return Err(qforge_formats::Error::Shape(format!(
                "a hidden state {:?} entering layer {} for a batch of {:?} in a model of {} layers",
                resume.x.dims(),
                resume.layer,
                embedded.dims(),
                self.layers.len()
            ))
            .into());
        }
        Ok(resume.x.clone())
    }

    /// The embedded, right-padded batch at positions from `start`, with its
    /// attention mask and rotary tables.
    pub(super) fn embedded(&self, batch: &[Vec<u32>], start: usize) -> Result<Embedded> {
        let lengths: Vec<usize> = batch.iter().map(Vec::len).collect();
        let seq = lengths.iter().copied().max().unwrap_or(0);
        if batch.is_empty() || lengths.contains(&0) {
            return Err(qforge_formats::Error::Shape(
                "forward needs at least one token per sequence".into(),
            )
            .into());
        }
        self.check_positions(start + seq)?;
        self.check_vocabulary(batch.iter().flatten())?;
        let b = batch.len();
        let padded: Vec<u32> = batch
            .iter()
            .flat_map(|s| {
                s.iter()
                    .copied()
                    .chain(std::iter::repeat_n(0, seq - s.len()))
            })
            .collect();
        let ids = Tensor::from_vec(padded, (b, seq), &Device::Cpu)?;
        let x = self
            .embed_tokens
            .index_select(&ids.flatten_all()?, 0)?
            .to_dtype(DType::F32)?
            .reshape((b, seq, self.config.hidden_size))?;
        Ok(Embedded {
            x,
            cos: self.cos.narrow(0, start, seq)?,
            sin: self.sin.narrow(0, start, seq)?,
            lengths,
        })
    }

    /// One decoding step for several independent sequences: `tokens[i]`
    /// continues the sequence cached in `caches[i]`, each at its own
    /// position. The linear layers run once over all `n` rows (what
    /// continuous batching buys: one weight read serves every sequence);
    /// attention runs per sequence over its own cache. Returns logits
    /// `[n, vocab]`; every linear input is handed to `observer`.
    pub fn step(
        &self,
        caches: &mut [&mut KvCache],
        tokens: &[u32],
        observer: Option<&mut dyn Observer>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 || caches.len() != n {
            return Err(qforge_formats::Error::Shape(format!(
                "a step needs one token per sequence: {n} tokens for {} caches",
                caches.len()
            ))
            .into());
        }
        self.check_vocabulary(tokens)?;
        if let Some(longest) = caches.iter().map(|k| k.len + 1).max() {
            self.check_positions(longest)?;
        }
        for cache in caches.iter() {
            self.check_cache(cache)?;
        }
        let ids = Tensor::from_vec(tokens.to_vec(), n, &Device::Cpu)?;
        let x = self
            .embed_tokens
            .index_select(&ids, 0)?
            .to_dtype(DType::F32)?
            .reshape((n, 1, c.hidden_size))?;
        let positions: Vec<u32> = caches.iter().map(|k| k.len as u32).collect();
        let positions = Tensor::from_vec(positions, n, &Device::Cpu)?;
        let half = c.head_dim / 2;
        let cos = self
            .cos
            .index_select(&positions, 0)?
            .reshape((n, 1, half))?;
        let sin = self
            .sin
            .index_select(&positions, 0)?
            .reshape((n, 1, half))?;
        let lengths = vec![1; n];
        let kv_heads = c.num_kv_heads;
        let x = self.decoder_stack(
            x,
            (&cos, &sin),
            &lengths,
            observer,
            Span::default(),
            |i, q, k, v| {
                for (s, cache) in caches.iter_mut().enumerate() {
                    cache.append(i, k, v, s)?;
                }
                // One query per sequence at its newest position, every sequence
                // in one call.
                let views: Vec<_> = caches
                    .iter()
                    .map(|cache| cache.view(i, cache.len))
                    .collect();
                attention::causal(q, &views, kv_heads, &lengths)
            },
        );
        // A failed step's keys lie past `len`, where nothing reads them.
        let x = x?;
        for cache in caches.iter_mut() {
            cache.len += 1;
        }
        self.lm_head.forward(&x.reshape((n, c.hidden_size))?)
    }

    /// Refuses a token id outside the vocabulary.
    pub fn check_vocabulary<'t>(&self, tokens: impl IntoIterator<Item = &'t u32>) -> Result<()> {
        let vocab = self.config.vocab_size;
        match tokens.into_iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(qforge_formats::Error::Shape(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            ))
            .into()),
            None => Ok(()),
        }
    }

    /// Refuses a sequence of `positions` beyond the context.
    pub fn check_positions(&self, positions: usize) -> Result<()> {
        let context = self.config.max_position_embeddings.min(MAX_POSITIONS);
        if positions > context {
            return Err(qforge_formats::Error::Shape(format!(
                "{positions} positions exceed the context of {context} (the model's, capped at {MAX_POSITIONS})"
            )).into());
        }
        Ok(())
    }
}

/// A batch ready for the decoder stack ([`Llama::embedded`]).
pub(super) struct Embedded {
    /// `[b, seq, hidden]`.
    pub(super) x: Tensor,
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    /// Each sequence's length before padding.
    pub(super) lengths: Vec<usize>,
}

/// Log-softmax over the last dimension, in f32.
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(logits, D::Minus1)?)
}
