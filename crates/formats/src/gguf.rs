//! GGUF files: a bounds-checked header parser of our own, and tensor loading
//! through candle's dequantizers.
//!
//! The parser checks every length against the bytes that remain before it
//! allocates, so a corrupt or hostile header (a string "of 2^60 bytes", an
//! absurd tensor shape) is an error, never an out-of-memory abort. Tensor data
//! is memory-mapped and each tensor's extent is checked against the file before
//! it is read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor, ggml_file::qtensor_from_ggml};
use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Largest tensor rank GGUF allows (GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Array of values.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array, if it is one.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor lives in the file and how it is stored.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Storage type.
    pub dtype: GgmlDType,
    /// Shape in row-major order (GGUF stores it innermost first; this is
    /// reversed, so a linear weight is `[out, in]`).
    pub shape: Vec<usize>,
    /// Byte offset from the start of the file.
    pub start: u64,
    /// Size in bytes.
    pub size: u64,
}

/// A parsed GGUF header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata, by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors, by name.
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl GgufHeader {
    /// Parses the header of a GGUF file held in `bytes` (the whole file, so
    /// tensor extents can be checked against it).
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let mut r = Cursor { bytes, at: 0 };
        if r.take(4, "magic")? != MAGIC {
            return Err(Error::Format(
                "not a GGUF file (bad magic bytes); expected a .gguf model".into(),
            ));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::Unsupported(format!(
                "GGUF version {version} (supported: 2 and 3)"
            )));
        }
        let tensor_count = r.u64("tensor count")?;
        let kv_count = r.u64("metadata count")?;
        // Each metadata entry takes at least 12 bytes, each tensor info 28.
        r.fits(kv_count, 12, "metadata entries")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = r.string("metadata key")?;
            let kind = r.u32("metadata type")?;
            let value = r.value(kind, &key, 0)?;
            metadata.insert(key, value);
        }
        r.fits(tensor_count, 28, "tensor infos")?;
        let mut raw = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            let name = r.string("tensor name")?;
            let n_dims = r.u32("tensor rank")?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(Error::Format(format!(
                    "tensor {name}: rank {n_dims} (GGUF allows 1 to {MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64("tensor dimension")?);
            }
            let dtype = ggml_dtype(r.u32("tensor type")?, &name)?;
            let offset = r.u64("tensor offset")?;
            raw.push((name, dims, dtype, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v.as_u64().filter(|a| a.is_power_of_two()).ok_or_else(|| {
                Error::Format(format!("general.alignment {v:?} is not a power of two"))
            })?,
        };
        let data_start = (r.at as u64).div_ceil(alignment) * alignment;
        let file_len = bytes.len() as u64;
        let mut tensors = BTreeMap::new();
        for (name, dims, dtype, offset) in raw {
            let elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| Error::Format(format!("tensor {name}: shape {dims:?} overflows")))?;
            let block = dtype.block_size() as u64;
            if elements % block != 0 {
                return Err(Error::Format(format!(
                    "tensor {name}: {elements} elements are not a whole number of {dtype:?} blocks of {block}"
                )));
            }
            let size = (elements / block)
                .checked_mul(dtype.type_size() as u64)
                .ok_or_else(|| Error::Format(format!("tensor {name}: size overflows")))?;
            let start = data_start
                .checked_add(offset)
                .filter(|s| s.checked_add(size).is_some_and(|end| end <= file_len))
                .ok_or_else(|| {
                    Error::Format(format!(
                        "tensor {name} ({dtype:?} {dims:?}, {size} bytes at data offset {offset}) \
                         runs past the end of the {file_len}-byte file: truncated or corrupt GGUF"
                    ))
                })?;
            let shape = dims.iter().rev().map(|&d| d as usize).collect();
            if tensors
                .insert(
                    name.clone(),
                    TensorInfo {
                        dtype,
                        shape,
                        start,
                        size,
                    },
                )
                .is_some()
            {
                return Err(Error::Format(format!("tensor {name} appears twice")));
            }
        }
        Ok(Self {
            version,
            metadata,
            tensors,
        })
    }

    /// A required metadata value.
    pub fn get(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| Error::Format(format!("GGUF metadata has no {key}")))
    }

    /// A required unsigned integer.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.get(key)?;
        v.as_u64()
            .ok_or_else(|| Error::Format(format!("GGUF {key} is {v:?}, not an unsigned integer")))
    }

    /// A required float.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.get(key)?;
        v.as_f64()
            .ok_or_else(|| Error::Format(format!("GGUF {key} is {v:?}, not a number")))
    }

    /// A required string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.get(key)?;
        v.as_str()
            .ok_or_else(|| Error::Format(format!("GGUF {key} is {v:?}, not a string")))
    }
}

fn ggml_dtype(code: u32, name: &str) -> Result<GgmlDType> {
    Ok(match code {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        other => {
            return Err(Error::Unsupported(format!(
                "tensor {name}: GGML type {other} (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K..Q8_K)"
            )));
        }
    })
}

/// Nesting depth allowed for metadata arrays; real files use 1.
const MAX_ARRAY_DEPTH: u32 = 4;

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let left = (self.bytes.len() - self.at) as u64;
        if n > left {
            return Err(Error::Format(format!(
                "GGUF header truncated: {what} needs {n} bytes at offset {}, {left} left",
                self.at
            )));
        }
        let out = &self.bytes[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(out)
    }

    /// Fails unless `count` items of at least `min_size` bytes fit in what is left.
    fn fits(&self, count: u64, min_size: u64, what: &str) -> Result<()> {
        let left = (self.bytes.len() - self.at) as u64;
        if count.saturating_mul(min_size) > left {
            return Err(Error::Format(format!(
                "GGUF header claims {count} {what}, which cannot fit in the {left} bytes left"
            )));
        }
        Ok(())
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4"),
        ))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8"),
        ))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| Error::Format(format!("GGUF {what} is not valid UTF-8")))
    }

    fn value(&mut self, kind: u32, key: &str, depth: u32) -> Result<Value> {
        let mut fixed = |n: u64| -> Result<&'a [u8]> { self.take(n, key) };
        Ok(match kind {
            0 => Value::U64(u64::from(fixed(1)?[0])),
            1 => Value::I64(i64::from(fixed(1)?[0] as i8)),
            2 => Value::U64(u64::from(u16::from_le_bytes(
                fixed(2)?.try_into().expect("2"),
            ))),
            3 => Value::I64(i64::from(i16::from_le_bytes(
                fixed(2)?.try_into().expect("2"),
            ))),
            4 => Value::U64(u64::from(u32::from_le_bytes(
                fixed(4)?.try_into().expect("4"),
            ))),
            5 => Value::I64(i64::from(i32::from_le_bytes(
                fixed(4)?.try_into().expect("4"),
            ))),
            6 => Value::F64(f64::from(f32::from_le_bytes(
                fixed(4)?.try_into().expect("4"),
            ))),
            7 => Value::Bool(fixed(1)?[0] != 0),
            8 => Value::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(Error::Format(format!("GGUF {key}: arrays nested too deep")));
                }
                let item = self.u32(key)?;
                let len = self.u64(key)?;
                let min = match item {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => {
                        return Err(Error::Format(format!(
                            "GGUF {key}: unknown array item type {other}"
                        )));
                    }
                };
                self.fits(len, min, key)?;
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(item, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(fixed(8)?.try_into().expect("8"))),
            11 => Value::I64(i64::from_le_bytes(fixed(8)?.try_into().expect("8"))),
            12 => Value::F64(f64::from_le_bytes(fixed(8)?.try_into().expect("8"))),
            other => {
                return Err(Error::Format(format!(
                    "GGUF {key}: unknown value type {other}"
                )));
            }
        })
    }
}

/// A GGUF file: its header and its memory-mapped bytes.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    /// The parsed header.
    pub header: GgufHeader,
}

impl GgufFile {
    /// Opens and validates a GGUF file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = crate::files::open_regular(path)?;
        // SAFETY: the map is read-only; qforge does not modify model files while
        // they are loaded (a concurrent writer truncating the file is outside what
        // any loader can defend against).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let header = GgufHeader::parse(&map).map_err(|e| e.in_file(path))?;
        Ok(Self {
            path: path.to_owned(),
            map,
            header,
        })
    }

    /// Path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file holds a tensor.
    pub fn has(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    /// A tensor as stored (still quantized), with its rows optionally
    /// reordered: row `r` of the result is row `row_order[r]` of the file.
    /// Rows of a GGUF matrix are whole quantization blocks, so reordering them
    /// is exact.
    pub fn tensor_quantized(&self, name: &str, row_order: Option<&[usize]>) -> Result<QTensor> {
        let info = self
            .header
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_owned(),
                file: self.path.clone(),
            })?;
        let bytes = &self.map[info.start as usize..(info.start + info.size) as usize];
        let reordered;
        let bytes = match row_order {
            None => bytes,
            Some(order) => {
                let rows = info.shape.first().copied().unwrap_or(0);
                if info.shape.len() != 2 || order.len() != rows || rows == 0 {
                    return Err(Error::Shape(format!(
                        "{name}: cannot reorder {} rows of a {:?} tensor",
                        order.len(),
                        info.shape
                    )));
                }
                let row_bytes = bytes.len() / rows;
                reordered = order
                    .iter()
                    .flat_map(|&r| &bytes[r * row_bytes..(r + 1) * row_bytes])
                    .copied()
                    .collect::<Vec<u8>>();
                &reordered[..]
            }
        };
        Ok(qtensor_from_ggml(
            info.dtype,
            bytes,
            info.shape.clone(),
            &Device::Cpu,
        )?)
    }

    /// A tensor dequantized to f32 (`[out, in]` for linear weights).
    pub fn tensor_f32(&self, name: &str) -> Result<Tensor> {
        Ok(self
            .tensor_quantized(name, None)?
            .dequantize(&Device::Cpu)?)
    }

    /// Bytes every tensor takes once dequantized to f32.
    pub fn dequantized_bytes(&self) -> u64 {
        self.header
            .tensors
            .values()
            .map(|t| t.shape.iter().product::<usize>() as u64 * 4)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal valid GGUF v3 file with one F32 tensor.
    fn tiny() -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        let key = b"general.architecture";
        b.extend_from_slice(&(key.len() as u64).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&5u64.to_le_bytes());
        b.extend_from_slice(b"llama");
        let name = b"w";
        b.extend_from_slice(&(name.len() as u64).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&3u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        for v in [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    #[test]
    fn parses_a_minimal_file() {
        let h = GgufHeader::parse(&tiny()).unwrap();
        assert_eq!(h.get_str("general.architecture").unwrap(), "llama");
        let w = &h.tensors["w"];
        assert_eq!(w.shape, vec![2, 3], "row-major [out, in]");
        assert_eq!(w.size, 24);
    }

    #[test]
    fn rejects_damage_without_allocating() {
        let good = tiny();
        assert!(
            GgufHeader::parse(&good[..good.len() - 1]).is_err(),
            "truncated data"
        );
        let refusal = |bytes: &[u8]| GgufHeader::parse(bytes).unwrap_err().to_string();
        let mut magic = good.clone();
        magic[0] = b'X';
        let err = refusal(&magic);
        assert!(err.contains("magic"), "{err}");
        // A string length of 2^60 must fail on the length check.
        let mut huge = good.clone();
        huge[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
        let err = refusal(&huge);
        assert!(err.contains("truncated"), "{err}");
        // Absurd dimensions must fail on the extent check.
        let mut dims = good.clone();
        let at = good
            .windows(8)
            .position(|w| w == 3u64.to_le_bytes())
            .unwrap();
        dims[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let err = refusal(&dims);
        assert!(err.contains("runs past the end"), "{err}");
        for cut in 0..good.len() {
            let _ = GgufHeader::parse(&good[..cut]);
        }
    }
}
