//! The `.qstats` codec: [`Stats`] to bytes and back.
//!
//! ```text
//! magic    8 bytes  "QFSTATS\0"
//! version  u32 LE   PLAIN_VERSION (2), or FORMAT_VERSION (5) with Gram matrices
//! length   u64 LE   body length in bytes
//! body     see below
//! crc32    u32 LE   CRC-32 (IEEE) of everything before it
//! ```
//!
//! The body is a canonical encoding: unsigned LEB128 varints, sets in ascending
//! order, tensors in name order, histogram bins ascending and delta-coded, no
//! timestamps, hosts or run ids. Equal statistics therefore give equal bytes,
//! and the decoder rejects any non-canonical body, so bytes → stats → bytes is
//! the identity.
//!
//! ```text
//! provenance:
//!   flags u8 (bit 0: forced merge; bit 1: mixed hardware)
//!   models, data, recipes: varint n, then n 32-byte SHA-256 digests each
//!   passes:                varint n, then n × (varint len, UTF-8)
//!   batches:               varint n, then n × (varint index, 32-byte digest)
//!   planned:               varint (batches in the plan; coverage = n / planned)
//! tensors: varint n, then per tensor:
//!   name                   varint len, UTF-8
//!   zero nan +inf -inf     4 varints
//!   extremes               u8 0, or u8 1 + min f32 bits LE + max f32 bits LE
//!   bins                   varint n, then n × (varint index delta, varint count)
//!   channels               u8 0, or u8 1 + varint n + n × f32 bits LE
//!   gram (version 5 only)  u8 0, or u8 1 + varint width + varint zigzag
//!                          exponent + varint rows + width·(width+1)/2 entries
//! ```
//!
//! A file with a Gram matrix is version 5; one without is written as version
//! 2, so statistics without Gram matrices keep their bytes. Versions 3 and 4
//! held Gram matrices summed another way (3: f64 chunk sums; 4: f32 products
//! and additions apart, over chunks of 256 rows; [`crate::Gram`] now fuses
//! them, over 1 024): they are refused, because they would not merge exactly
//! with this build's. A Gram entry `v` is `varint 0` for zero, else
//! `varint (1 + (tz << 1 | sign))` then `varint128 ((|v| >> tz) >> 1)` with
//! `tz` the trailing zero bits of `|v|`: a batch's partial sums are f32
//! values scaled by a power of two, so their integers carry at most 24
//! significant bits per chunk and take a few bytes, not 16.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result};
use crate::gram::Gram;
use crate::histogram::{Histogram, HistogramParts};
use crate::stats::{BatchId, Digest, Provenance, Stats, TensorStats};

/// Magic bytes that open every `.qstats` file.
pub const MAGIC: &[u8; 8] = b"QFSTATS\0";
/// Version of the format this build writes for statistics with a Gram
/// matrix; it reads this and [`PLAIN_VERSION`].
pub const FORMAT_VERSION: u32 = 5;
/// Version written for statistics without a Gram matrix (the layout before
/// Gram matrices existed, byte for byte).
pub const PLAIN_VERSION: u32 = 2;
const HEADER_LEN: usize = 8 + 4 + 8;
const TRAILER_LEN: usize = 4;

/// Encodes statistics as `.qstats` bytes.
pub fn encode(stats: &Stats) -> Vec<u8> {
    let mut body = Vec::new();
    let p = &stats.provenance;
    body.push(u8::from(p.forced) | u8::from(p.mixed_hardware) << 1);
    for set in [&p.models, &p.data, &p.recipes] {
        put_varint(&mut body, set.len() as u64);
        for digest in set {
            body.extend_from_slice(&digest.0);
        }
    }
    put_varint(&mut body, p.passes.len() as u64);
    for pass in &p.passes {
        put_str(&mut body, pass);
    }
    put_varint(&mut body, p.batches.len() as u64);
    for batch in &p.batches {
        put_varint(&mut body, batch.index);
        body.extend_from_slice(&batch.content.0);
    }
    put_varint(&mut body, p.planned);
    let with_grams = stats.tensors.values().any(|t| t.gram().is_some());
    put_varint(&mut body, stats.tensors.len() as u64);
    for (name, tensor) in &stats.tensors {
        put_str(&mut body, name);
        let parts = tensor.histogram().to_parts();
        for count in [parts.zero, parts.nan, parts.pos_inf, parts.neg_inf] {
            put_varint(&mut body, count);
        }
        match (parts.min, parts.max) {
            (Some(min), Some(max)) => {
                body.push(1);
                body.extend_from_slice(&min.to_bits().to_le_bytes());
                body.extend_from_slice(&max.to_bits().to_le_bytes());
            }
            _ => body.push(0),
        }
        put_varint(&mut body, parts.bins.len() as u64);
        let mut previous = 0u64;
        for (index, count) in parts.bins {
            put_varint(&mut body, u64::from(index) - previous);
            put_varint(&mut body, count);
            previous = u64::from(index);
        }
        match tensor.channel_abs_max_bits() {
            Some(channels) => {
                body.push(1);
                put_varint(&mut body, channels.len() as u64);
                for bits in channels {
                    body.extend_from_slice(&bits.to_le_bytes());
                }
            }
            None => body.push(0),
        }
        if with_grams {
            put_gram(&mut body, tensor.gram());
        }
    }

    let version = if with_grams {
        FORMAT_VERSION
    } else {
        PLAIN_VERSION
    };
    let mut out = Vec::with_capacity(HEADER_LEN + body.len() + TRAILER_LEN);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The shape of one tensor's statistics: what the decoder can check before
/// it allocates anything for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorShape {
    /// Channels tracked for per-channel abs-max, if any.
    pub channels: Option<usize>,
    /// Width of the Gram matrix, if any.
    pub gram_width: Option<usize>,
}

/// The tensors some statistics hold, by name, with their shapes: every
/// batch of a calibration pass observes the same ones.
pub type Shapes = BTreeMap<String, TensorShape>;

/// The shapes of `stats`' tensors.
pub fn shapes(stats: &Stats) -> Shapes {
    stats
        .tensors
        .iter()
        .map(|(name, tensor)| {
            let shape = TensorShape {
                channels: tensor.channel_abs_max_bits().map(<[u32]>::len),
                gram_width: tensor.gram().map(Gram::width),
            };
            (name.clone(), shape)
        })
        .collect()
}

/// Decodes `.qstats` bytes, checking magic, version, length, checksum and the
/// body's structure.
pub fn decode(bytes: &[u8]) -> Result<Stats> {
    decode_checked(bytes, None)
}

/// Decodes `.qstats` bytes that must hold exactly the tensors of
/// `expected`, with their shapes: a tensor it does not name, another shape
/// or a missing tensor is an error found before anything is allocated for
/// it. Bytes from a party that is not trusted to send what the pass
/// produces (a cluster result) are decoded so; otherwise a few bytes can
/// announce a Gram matrix of gigabytes.
pub fn decode_shaped(bytes: &[u8], expected: &Shapes) -> Result<Stats> {
    decode_checked(bytes, Some(expected))
}

fn decode_checked(bytes: &[u8], expected: Option<&Shapes>) -> Result<Stats> {
    if bytes.len() < MAGIC.len() {
        return Err(if MAGIC.starts_with(bytes) {
            Error::Truncated(format!("{} bytes, shorter than the header", bytes.len()))
        } else {
            Error::NotStats
        });
    }
    if &bytes[..8] != MAGIC {
        return Err(Error::NotStats);
    }
    if bytes.len() < HEADER_LEN {
        return Err(Error::Truncated(format!(
            "{} bytes, shorter than the {HEADER_LEN}-byte header",
            bytes.len()
        )));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION && version != PLAIN_VERSION {
        return Err(Error::Version {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let body_len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let available = (bytes.len() - HEADER_LEN) as u64;
    let expected_total = body_len.saturating_add(TRAILER_LEN as u64);
    if available < expected_total {
        return Err(Error::Truncated(format!(
            "header announces {body_len} body bytes + {TRAILER_LEN}-byte checksum, {available} present"
        )));
    }
    if available > expected_total {
        return Err(Error::Corrupt(format!(
            "{} unexpected bytes after the checksum",
            available - expected_total
        )));
    }
    let body_end = HEADER_LEN + body_len as usize;
    let stored = u32::from_le_bytes(bytes[body_end..].try_into().expect("4 bytes"));
    let computed = crc32fast::hash(&bytes[..body_end]);
    if stored != computed {
        return Err(Error::Checksum { stored, computed });
    }
    let mut reader = Reader {
        bytes: &bytes[HEADER_LEN..body_end],
        offset: 0,
    };
    let stats = read_body(&mut reader, version == FORMAT_VERSION, expected)?;
    if reader.offset != reader.bytes.len() {
        return Err(Error::Corrupt(format!(
            "{} unread bytes at the end of the body",
            reader.bytes.len() - reader.offset
        )));
    }
    Ok(stats)
}

fn read_body(r: &mut Reader<'_>, with_grams: bool, expected: Option<&Shapes>) -> Result<Stats> {
    let flags = r.byte("provenance flags")?;
    if flags > 0b11 {
        return Err(Error::Corrupt(format!(
            "unknown provenance flags {flags:#x}"
        )));
    }
    let mut digest_sets = Vec::with_capacity(3);
    for what in ["model", "data", "recipe"] {
        let n = r.count(32, what)?;
        let mut set = BTreeSet::new();
        for _ in 0..n {
            let digest = r.digest(what)?;
            ascending(set.last(), &digest, what)?;
            set.insert(digest);
        }
        digest_sets.push(set);
    }
    let recipes = digest_sets.pop().expect("three sets");
    let data = digest_sets.pop().expect("three sets");
    let models = digest_sets.pop().expect("three sets");
    let n = r.count(1, "pass")?;
    let mut passes = BTreeSet::new();
    for _ in 0..n {
        let pass = r.string("pass name")?;
        ascending(passes.last(), &pass, "pass")?;
        passes.insert(pass);
    }
    let n = r.count(33, "batch id")?;
    let mut batches = BTreeSet::new();
    for _ in 0..n {
        let index = r.varint("batch index")?;
        let content = r.digest("batch content hash")?;
        let id = BatchId { index, content };
        ascending(batches.last(), &id, "batch id")?;
        batches.insert(id);
    }
    let planned = r.varint("planned batch count")?;
    let provenance = Provenance {
        models,
        data,
        recipes,
        passes,
        batches,
        planned,
        forced: flags & 1 == 1,
        mixed_hardware: flags & 2 == 2,
    };

    let n = r.count(8, "tensor")?;
    let mut tensors = BTreeMap::new();
    for _ in 0..n {
        let name = r.string("tensor name")?;
        if tensors.keys().next_back().is_some_and(|last| *last >= name) {
            return Err(Error::Corrupt(format!(
                "tensor {name:?} out of order or repeated"
            )));
        }
        let shape = match expected {
            None => None,
            Some(shapes) => Some(*shapes.get(&name).ok_or_else(|| {
                Error::Corrupt(format!("tensor {name:?} is not one this pass observes"))
            })?),
        };
        let tensor = read_tensor(r, &name, with_grams, shape)?;
        tensors.insert(name, tensor);
    }
    if let Some(missing) = expected.and_then(|e| e.keys().find(|n| !tensors.contains_key(*n))) {
        return Err(Error::Corrupt(format!(
            "tensor {missing:?}, which this pass observes, is missing"
        )));
    }
    if with_grams && tensors.values().all(|t| t.gram().is_none()) {
        return Err(Error::Corrupt(format!(
            "a version {FORMAT_VERSION} body without a Gram matrix (such statistics are written as version {PLAIN_VERSION})"
        )));
    }
    Ok(Stats {
        provenance,
        tensors,
    })
}

/// Reads tensor `name`'s statistics. What an error names is prefixed with
/// the tensor only once it happens: formatting that context for every value
/// read made decoding a SmolLM2 result (121 tensors) take 140 ms.
fn read_tensor(
    r: &mut Reader<'_>,
    name: &str,
    with_grams: bool,
    shape: Option<TensorShape>,
) -> Result<TensorStats> {
    read_tensor_fields(r, with_grams, shape).map_err(|e| match e {
        Error::Corrupt(what) => Error::Corrupt(format!("tensor {name:?}: {what}")),
        other => other,
    })
}

fn read_tensor_fields(
    r: &mut Reader<'_>,
    with_grams: bool,
    shape: Option<TensorShape>,
) -> Result<TensorStats> {
    let zero = r.varint("zero count")?;
    let nan = r.varint("NaN count")?;
    let pos_inf = r.varint("+inf count")?;
    let neg_inf = r.varint("-inf count")?;
    let (min, max) = match r.byte("extremes flag")? {
        0 => (None, None),
        1 => {
            let min = f32::from_bits(r.u32("min")?);
            let max = f32::from_bits(r.u32("max")?);
            (Some(min), Some(max))
        }
        other => {
            return Err(Error::Corrupt(format!("bad extremes flag {other}")));
        }
    };
    let n = r.count(2, "bin")?;
    let mut bins = Vec::with_capacity(n);
    let mut index = 0u64;
    for i in 0..n {
        let delta = r.varint("bin index")?;
        if i > 0 && delta == 0 {
            return Err(Error::Corrupt("repeated histogram bin".into()));
        }
        index = index
            .checked_add(delta)
            .filter(|&v| v <= u64::from(u16::MAX))
            .ok_or_else(|| Error::Corrupt("histogram bin index out of range".into()))?;
        let count = r.varint("bin count")?;
        bins.push((index as u16, count));
    }
    let histogram = Histogram::from_parts(HistogramParts {
        bins,
        zero,
        nan,
        pos_inf,
        neg_inf,
        min,
        max,
    })
    .map_err(|e| Error::Corrupt(e.to_string()))?;
    let flag = r.byte("channels flag")?;
    if let Some(shape) = shape
        && u8::from(shape.channels.is_some()) != flag
    {
        return Err(Error::Corrupt(format!(
            "per-channel abs-max present where the pass records {:?} channels, or the reverse",
            shape.channels
        )));
    }
    let channels = match flag {
        0 => None,
        1 => {
            let n = r.count(4, "channel")?;
            if let Some(expected) = shape.and_then(|s| s.channels)
                && n != expected
            {
                return Err(Error::Corrupt(format!(
                    "{n} channels where the pass records {expected}"
                )));
            }
            let mut channels = Vec::with_capacity(n);
            for _ in 0..n {
                channels.push(r.u32("channel abs-max")?);
            }
            Some(channels)
        }
        other => {
            return Err(Error::Corrupt(format!("bad channels flag {other}")));
        }
    };
    let gram = if with_grams {
        read_gram(r, shape.map(|s| s.gram_width))?
    } else {
        None
    };
    if let Some(TensorShape {
        gram_width: Some(width),
        ..
    }) = shape
        && gram.is_none()
    {
        return Err(Error::Corrupt(format!(
            "no Gram matrix where the pass records one {width} wide"
        )));
    }
    TensorStats::from_parts(histogram, channels, gram).map_err(|e| Error::Corrupt(e.to_string()))
}

fn put_gram(out: &mut Vec<u8>, gram: Option<&Gram>) {
    let Some(gram) = gram else {
        out.push(0);
        return;
    };
    out.push(1);
    put_varint(out, gram.width() as u64);
    let e = i64::from(gram.exponent());
    put_varint(out, ((e << 1) ^ (e >> 63)) as u64);
    put_varint(out, gram.rows());
    for &v in gram.upper() {
        if v == 0 {
            out.push(0);
            continue;
        }
        let magnitude = v.unsigned_abs();
        let tz = magnitude.trailing_zeros();
        put_varint(out, 1 + (u64::from(tz) << 1 | u64::from(v < 0)));
        put_varint128(out, (magnitude >> tz) >> 1);
    }
}

/// Reads a Gram matrix that, when `expected` is given, must be absent
/// (`Some(None)`) or that wide.
fn read_gram(r: &mut Reader<'_>, expected: Option<Option<usize>>) -> Result<Option<Gram>> {
    match r.byte("gram flag")? {
        0 => return Ok(None),
        1 => {}
        other => return Err(Error::Corrupt(format!("bad gram flag {other}"))),
    }
    let width = r.varint("gram width")?;
    if let Some(expected) = expected
        && expected != Some(width as usize)
    {
        return Err(Error::Corrupt(format!(
            "a Gram matrix {width} wide where the pass records {}",
            expected.map_or("none".to_owned(), |w| format!("one {w} wide"))
        )));
    }
    let zigzag = r.varint("gram exponent")?;
    let exponent = ((zigzag >> 1) as i64) ^ -((zigzag & 1) as i64);
    let rows = r.varint("gram rows")?;
    let entries = width
        .checked_mul(width + 1)
        .map(|n| n / 2)
        .ok_or_else(|| Error::Corrupt("gram width out of range".into()))?;
    // Each entry takes at least one byte, so a corrupt width cannot make the
    // decoder allocate without bound.
    let remaining = (r.bytes.len() - r.offset) as u64;
    if width == 0 || entries > remaining {
        return Err(Error::Corrupt(format!(
            "a {width}-wide Gram matrix cannot fit in the {remaining} bytes left"
        )));
    }
    let exponent =
        i32::try_from(exponent).map_err(|_| Error::Corrupt("gram exponent out of range".into()))?;
    let mut upper = Vec::with_capacity(entries as usize);
    for _ in 0..entries {
        let head = r.varint("gram entry")?;
        if head == 0 {
            upper.push(0);
            continue;
        }
        let (tz, negative) = ((head - 1) >> 1, (head - 1) & 1 == 1);
        let rest = r.varint128("gram entry")?;
        // |v| = (2·rest + 1) · 2^tz must stay below 2^127.
        let odd = rest
            .checked_mul(2)
            .map(|x| x | 1)
            .filter(|&x| tz < 127 && x.leading_zeros() as u64 > tz)
            .ok_or_else(|| Error::Corrupt("gram entry out of range".into()))?;
        let magnitude = (odd << tz) as i128;
        upper.push(if negative { -magnitude } else { magnitude });
    }
    Gram::from_parts(width as usize, exponent, rows, upper)
        .map(Some)
        .map_err(|e| Error::Corrupt(e.to_string()))
}

/// Rejects a set element that does not strictly follow its predecessor, so the
/// body stays canonical.
fn ascending<T: Ord + std::fmt::Debug>(previous: Option<&T>, next: &T, what: &str) -> Result<()> {
    match previous {
        Some(p) if p >= next => Err(Error::Corrupt(format!(
            "{what} set not in strictly ascending order ({p:?} then {next:?})"
        ))),
        _ => Ok(()),
    }
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_varint128(out: &mut Vec<u8>, mut value: u128) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_str(out: &mut Vec<u8>, text: &str) {
    put_varint(out, text.len() as u64);
    out.extend_from_slice(text.as_bytes());
}

struct Reader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let remaining = self.bytes.len() - self.offset;
        if n > remaining {
            return Err(Error::Corrupt(format!(
                "{what} needs {n} bytes at body offset {}, only {remaining} left",
                self.offset
            )));
        }
        let slice = &self.bytes[self.offset..self.offset + n];
        self.offset += n;
        Ok(slice)
    }

    fn byte(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }

    fn digest(&mut self, what: &str) -> Result<Digest> {
        Ok(Digest(self.take(32, what)?.try_into().expect("32 bytes")))
    }

    fn varint(&mut self, what: &str) -> Result<u64> {
        Ok(u64::try_from(self.varint_bits(64, what)?).expect("at most 64 bits"))
    }

    fn varint128(&mut self, what: &str) -> Result<u128> {
        self.varint_bits(128, what)
    }

    /// Reads a LEB128 number of at most `bits` bits, refusing one that overflows
    /// them or is longer than its shortest encoding, so that every number has
    /// exactly one encoding and the digest of a body is well defined.
    fn varint_bits(&mut self, bits: u32, what: &str) -> Result<u128> {
        let last = (bits - 1) / 7 * 7;
        let last_max = (1u128 << (bits - last)) - 1;
        let mut value = 0u128;
        for shift in (0..bits).step_by(7) {
            let byte = self.byte(what)?;
            let group = u128::from(byte & 0x7F);
            if shift == last && group > last_max {
                break;
            }
            value |= group << shift;
            if byte & 0x80 == 0 {
                // A final zero byte after the first would be a second encoding
                // of the same number.
                if byte == 0 && shift > 0 {
                    break;
                }
                return Ok(value);
            }
        }
        Err(Error::Corrupt(format!(
            "{what}: malformed varint ending at body offset {}",
            self.offset
        )))
    }

    /// Reads an element count and checks that `n` elements of at least
    /// `min_size` bytes each can fit in what is left, so a corrupt count cannot
    /// make the decoder allocate without bound.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize> {
        let n = self.varint(&format!("{what} count"))?;
        let remaining = (self.bytes.len() - self.offset) as u64;
        if n.saturating_mul(min_size as u64) > remaining {
            return Err(Error::Corrupt(format!(
                "{n} {what} entries cannot fit in the {remaining} bytes left"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.count(1, what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| Error::Corrupt(format!("{what} is not valid UTF-8")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::MergePolicy;

    fn sample() -> Stats {
        let mut tensor = TensorStats::with_channels(3);
        tensor
            .observe(&[1.0, -2.0, 0.0, f32::NAN, 7.5, -0.25])
            .unwrap();
        let mut plain = TensorStats::new();
        plain.observe(&[f32::INFINITY, -3.0]).unwrap();
        let id = BatchId {
            index: 3,
            content: Digest::of(b"batch"),
        };
        Stats {
            provenance: Provenance::single(
                Some(Digest::of(b"model")),
                Digest::of(b"data"),
                Digest::of(b"recipe"),
                "activation",
                id,
                8,
            ),
            tensors: BTreeMap::from([
                ("model.layers.0.mlp.down_proj".to_owned(), tensor),
                ("a".to_owned(), plain),
                ("empty".to_owned(), TensorStats::new()),
            ]),
        }
    }

    #[test]
    fn round_trips_exactly() {
        let stats = sample();
        let bytes = encode(&stats);
        let back = decode(&bytes).unwrap();
        assert_eq!(back, stats);
        assert_eq!(encode(&back), bytes);
        for (forced, mixed_hardware) in [(true, false), (false, true), (true, true)] {
            let mut flagged = sample();
            flagged.provenance.forced = forced;
            flagged.provenance.mixed_hardware = mixed_hardware;
            assert_eq!(decode(&encode(&flagged)).unwrap(), flagged);
        }
    }

    #[test]
    fn rejects_bad_magic_version_truncation_and_checksum() {
        let bytes = encode(&sample());
        assert!(matches!(decode(b"PK\x03\x04rest"), Err(Error::NotStats)));
        let mut wrong_version = bytes.clone();
        wrong_version[8] = 9;
        assert!(matches!(
            decode(&wrong_version),
            Err(Error::Version { found: 9, .. })
        ));
        for cut in [3, 12, 25, bytes.len() - 1] {
            let err = decode(&bytes[..cut]).unwrap_err();
            assert!(matches!(err, Error::Truncated(_)), "cut {cut}: {err}");
        }
        for position in [HEADER_LEN, HEADER_LEN + 40, bytes.len() - 6] {
            let mut flipped = bytes.clone();
            flipped[position] ^= 0x10;
            let err = decode(&flipped).unwrap_err();
            assert!(
                matches!(err, Error::Checksum { .. }),
                "byte {position}: {err}"
            );
        }
        let mut extended = bytes.clone();
        extended.push(0);
        assert!(matches!(decode(&extended), Err(Error::Corrupt(_))));
    }

    /// Re-seals a modified body with a valid checksum, to reach the structural
    /// checks behind it.
    fn seal(body: &[u8]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&PLAIN_VERSION.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(body);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    #[test]
    fn rejects_structurally_invalid_bodies_with_a_valid_checksum() {
        // A count that cannot fit must not allocate.
        let mut body = vec![0u8];
        put_varint(&mut body, u64::MAX / 2);
        assert!(matches!(decode(&seal(&body)), Err(Error::Corrupt(_))));
        // Unsorted digests are not canonical.
        let mut body = vec![0u8, 2];
        body.extend_from_slice(&[9; 32]);
        body.extend_from_slice(&[1; 32]);
        let err = decode(&seal(&body)).unwrap_err();
        assert!(err.to_string().contains("ascending"), "{err}");
        // Histogram counts that disagree with the extremes.
        let mut stats = Stats::default();
        let mut t = TensorStats::new();
        t.observe(&[1.0]).unwrap();
        stats.tensors.insert("x".into(), t);
        let bytes = encode(&stats);
        let body = &bytes[HEADER_LEN..bytes.len() - TRAILER_LEN];
        // Drop the extremes: flags, 3 digest sets, passes, batches, planned,
        // tensor count, name, four zero-count varints, then the flag byte.
        let flag_at = 1 + 3 + 1 + 1 + 1 + 1 + 2 + 4;
        assert_eq!(body[flag_at], 1);
        let mut broken = body[..flag_at].to_vec();
        broken.push(0);
        broken.extend_from_slice(&body[flag_at + 9..]);
        let err = decode(&seal(&broken)).unwrap_err();
        assert!(err.to_string().contains("inconsistent"), "{err}");
    }

    fn with_gram() -> Stats {
        let mut stats = sample();
        let exponent = Gram::exponent_for(3.0, 4).unwrap();
        let mut gram = TensorStats::with_gram(Gram::new(3, exponent).unwrap());
        gram.observe(&[1.0, -2.0, 0.0, 0.1, 3.0, -0.5]).unwrap();
        stats
            .tensors
            .insert("model.layers.0.mlp.gate_proj".into(), gram);
        stats
    }

    #[test]
    fn gram_matrices_round_trip_in_version_4_and_plain_stats_stay_version_2() {
        let plain = encode(&sample());
        assert_eq!(plain[8..12], PLAIN_VERSION.to_le_bytes());
        let stats = with_gram();
        let bytes = encode(&stats);
        assert_eq!(bytes[8..12], FORMAT_VERSION.to_le_bytes());
        let back = decode(&bytes).unwrap();
        assert_eq!(back, stats);
        assert_eq!(encode(&back), bytes);
        let gram = back.tensors["model.layers.0.mlp.gate_proj"].gram().unwrap();
        assert_eq!(gram.rows(), 2);
        // (0, 0) = 1 + 0.01, (0, 2) = 0 + 0.1 · (-0.5), both at the exponent.
        assert!(gram.upper()[0] > 0 && gram.upper()[2] < 0);
        // Extreme integers survive the compact entry encoding.
        let extremes = vec![i128::MAX >> 1, -(i128::MAX >> 1), 1, -1, 0, 1 << 100];
        let mut big = Stats::default();
        big.tensors.insert(
            "x".into(),
            TensorStats::from_parts(
                Histogram::new(),
                None,
                Some(Gram::from_parts(3, -7, 9, extremes).unwrap()),
            )
            .unwrap(),
        );
        assert_eq!(decode(&encode(&big)).unwrap(), big);
        // A version-4 body with no Gram matrix is not canonical.
        let mut relabelled = plain.clone();
        relabelled[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        let body_end = relabelled.len() - TRAILER_LEN;
        let crc = crc32fast::hash(&relabelled[..body_end]);
        relabelled[body_end..].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(decode(&relabelled), Err(Error::Corrupt(_))));
        // Version 3's Hessians (f64 chunk sums) would not merge exactly with
        // this build's: refused, saying what to do.
        let mut older = bytes.clone();
        older[8..12].copy_from_slice(&3u32.to_le_bytes());
        let body_end = older.len() - TRAILER_LEN;
        let crc = crc32fast::hash(&older[..body_end]);
        older[body_end..].copy_from_slice(&crc.to_le_bytes());
        let err = decode(&older).unwrap_err();
        assert!(matches!(err, Error::Version { found: 3, .. }), "{err}");
        assert!(err.to_string().contains("recompute"), "{err}");
        // Gram matrices merge through Stats like every other statistic.
        let mut a = with_gram();
        let mut other = with_gram();
        other.provenance.batches = BTreeSet::from([BatchId {
            index: 4,
            content: Digest::of(b"other"),
        }]);
        a.merge(&other, MergePolicy::Strict).unwrap();
        let merged = a.tensors["model.layers.0.mlp.gate_proj"].gram().unwrap();
        assert_eq!(merged.upper()[0], 2 * gram.upper()[0]);
    }

    #[test]
    fn shaped_decoding_refuses_what_the_pass_does_not_produce_before_allocating_it() {
        let stats = with_gram();
        let expected = shapes(&stats);
        assert_eq!(expected["model.layers.0.mlp.gate_proj"].gram_width, Some(3));
        assert_eq!(expected["model.layers.0.mlp.down_proj"].channels, Some(3));
        assert_eq!(decode_shaped(&encode(&stats), &expected).unwrap(), stats);
        // The attack on the coordinator: a Gram matrix 8 192 wide on a layer
        // 3 wide (33.5 MB of one-byte zero entries, 537 MB as i128 sums).
        let mut forged = stats.clone();
        forged.tensors.insert(
            "model.layers.0.mlp.gate_proj".into(),
            TensorStats::with_gram(Gram::new(8192, 0).unwrap()),
        );
        let refusal = |stats: &Stats| {
            decode_shaped(&encode(stats), &expected)
                .unwrap_err()
                .to_string()
        };
        let err = refusal(&forged);
        assert!(
            err.contains("8192 wide where the pass records one 3 wide"),
            "{err}"
        );
        // Another channel count, a tensor the pass does not observe, and a
        // missing one.
        let mut channels = stats.clone();
        channels.tensors.insert(
            "model.layers.0.mlp.down_proj".into(),
            TensorStats::with_channels(4096),
        );
        let err = refusal(&channels);
        assert!(
            err.contains("4096 channels where the pass records 3"),
            "{err}"
        );
        let mut extra = stats.clone();
        extra.tensors.insert("zz".into(), TensorStats::new());
        let err = refusal(&extra);
        assert!(err.contains("not one this pass observes"), "{err}");
        let mut missing = stats.clone();
        missing.tensors.remove("a");
        let err = refusal(&missing);
        assert!(
            err.contains("\"a\", which this pass observes, is missing"),
            "{err}"
        );
    }

    #[test]
    fn equal_stats_from_different_merge_orders_encode_identically() {
        let mut a = sample();
        let mut b = sample();
        b.provenance.batches = BTreeSet::from([BatchId {
            index: 4,
            content: Digest::of(b"other"),
        }]);
        let mut ab = a.clone();
        ab.merge(&b, MergePolicy::Strict).unwrap();
        let mut ba = b.clone();
        ba.merge(&a, MergePolicy::Strict).unwrap();
        assert_eq!(encode(&ab), encode(&ba));
        // Merging the same batch twice is refused and leaves `a` untouched.
        let before = encode(&a);
        assert!(a.merge(&sample(), MergePolicy::Strict).is_err());
        assert_eq!(encode(&a), before);
    }
}
