//! Statistics of a file of values (`qforge stats observe`): raw little-endian
//! f32 or a `.npy` array, read in bounded chunks so that files of any size
//! stream through.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use qforge_core::{BatchId, Digest, DigestBuilder, Provenance, Stats, TensorStats};

use crate::error::{Error, Result};

/// Values per chunk handed to the consumer (4 MiB of f32).
const CHUNK_VALUES: usize = 1 << 20;

/// Element types a value file may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Element {
    F32Le,
    F32Be,
    F64Le,
}

impl Element {
    fn size(self) -> usize {
        match self {
            Element::F32Le | Element::F32Be => 4,
            Element::F64Le => 8,
        }
    }

    fn decode(self, bytes: &[u8], out: &mut Vec<f32>) {
        out.clear();
        match self {
            Element::F32Le => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))),
            ),
            Element::F32Be => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_be_bytes(b.try_into().expect("4 bytes"))),
            ),
            // Narrowing is the documented behaviour: statistics are of f32.
            Element::F64Le => out.extend(
                bytes
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32),
            ),
        }
    }
}

/// Layout of a value file.
#[derive(Debug)]
struct ValueFile {
    element: Element,
    /// Number of values the file holds.
    len: u64,
    /// Shape, for `.npy` files.
    shape: Option<Vec<u64>>,
    /// True for a Fortran-ordered `.npy` (column-major).
    fortran_order: bool,
    reader: BufReader<File>,
}

impl ValueFile {
    /// Opens `path` as `.npy` (by its magic bytes) or as raw little-endian f32.
    fn open(path: &Path) -> Result<Self> {
        let io = |source| Error::from(qforge_formats::Error::io(path, source));
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut magic = [0u8; 6];
        let is_npy = file_len >= 6 && {
            reader.read_exact(&mut magic).map_err(io)?;
            &magic == b"\x93NUMPY"
        };
        if is_npy {
            return Self::open_npy(path, reader, file_len);
        }
        // Not .npy: start again from the first byte as raw f32.
        let file = File::open(path).map_err(io)?;
        ensure(file_len.is_multiple_of(4), || {
            Error::Data(format!(
                "{}: size {file_len} bytes is not a multiple of 4, so it is not raw little-endian f32 \
                 (and it has no .npy header); write the values as float32",
                path.display()
            ))
        })?;
        Ok(Self {
            element: Element::F32Le,
            len: file_len / 4,
            shape: None,
            fortran_order: false,
            reader: BufReader::with_capacity(1 << 20, file),
        })
    }

    fn open_npy(path: &Path, mut reader: BufReader<File>, file_len: u64) -> Result<Self> {
        let name = path.display();
        let bad = |why: String| Error::Data(format!("{name}: {why}"));
        let mut read = |buf: &mut [u8]| {
            reader
                .read_exact(buf)
                .map_err(|_| bad("truncated .npy header".into()))
        };
        let mut version = [0u8; 2];
        read(&mut version)?;
        let header_len = match version[0] {
            1 => {
                let mut n = [0u8; 2];
                read(&mut n)?;
                u64::from(u16::from_le_bytes(n))
            }
            2 | 3 => {
                let mut n = [0u8; 4];
                read(&mut n)?;
                u64::from(u32::from_le_bytes(n))
            }
            v => {
                return Err(bad(format!(
                    "unsupported .npy format version {v}.{}",
                    version[1]
                )));
            }
        };
        let prefix = if version[0] == 1 { 10 } else { 12 };
        ensure(prefix + header_len <= file_len, || {
            bad(format!(
                ".npy header of {header_len} bytes runs past the end of the {file_len}-byte file"
            ))
        })?;
        let mut header = vec![0u8; header_len as usize];
        read(&mut header)?;
        let header =
            String::from_utf8(header).map_err(|_| bad(".npy header is not text".into()))?;
        let field = |key: &str| {
            npy_field(&header, key)
                .ok_or_else(|| bad(format!(".npy header has no '{key}': {header:?}")))
        };
        let element = match field("descr")?.trim_matches(|c| c == '\'' || c == '"') {
            "<f4" | "=f4" => Element::F32Le,
            ">f4" => Element::F32Be,
            "<f8" | "=f8" => Element::F64Le,
            other => {
                return Err(bad(format!(
                    ".npy dtype {other:?} is not supported; save the array as float32 ('<f4')"
                )));
            }
        };
        let fortran_order = npy_field(&header, "fortran_order").is_some_and(|v| v.trim() == "True");
        let shape_text = field("shape")?;
        let shape = shape_text
            .trim()
            .trim_start_matches('(')
            .trim_end_matches(')')
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|d| {
                d.parse::<u64>()
                    .map_err(|_| bad(format!("bad .npy shape {shape_text:?}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let len = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!(".npy shape {shape:?} overflows")))?;
        let data_len = file_len - prefix - header_len;
        let expected = len.checked_mul(element.size() as u64);
        ensure(expected == Some(data_len), || {
            bad(format!(
                ".npy shape {shape:?} needs {} data bytes but the file has {data_len} \
                 (truncated or corrupt file)",
                expected.map_or("more than 2^64".to_owned(), |e| e.to_string())
            ))
        })?;
        Ok(Self {
            element,
            len,
            shape: Some(shape),
            fortran_order,
            reader,
        })
    }

    /// Calls `consume` with consecutive chunks of values and their raw
    /// little-endian f32 bytes (for hashing), until the file is exhausted.
    fn for_each_chunk(
        mut self,
        path: &Path,
        mut consume: impl FnMut(&[f32], &[u8]) -> Result<()>,
    ) -> Result<()> {
        let size = self.element.size();
        let mut raw = vec![0u8; CHUNK_VALUES * size];
        let mut values = Vec::with_capacity(CHUNK_VALUES);
        let mut le_bytes = Vec::with_capacity(CHUNK_VALUES * 4);
        let mut remaining = self.len;
        while remaining > 0 {
            let n = remaining.min(CHUNK_VALUES as u64) as usize;
            let bytes = &mut raw[..n * size];
            self.reader.read_exact(bytes).map_err(|_| {
                Error::Data(format!(
                    "{}: value file ended early (was it truncated while being read?)",
                    path.display()
                ))
            })?;
            self.element.decode(bytes, &mut values);
            le_bytes.clear();
            le_bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
            consume(&values, &le_bytes)?;
            remaining -= n as u64;
        }
        Ok(())
    }
}

/// `Ok` when `condition` holds, else the error `why` makes.
fn ensure(condition: bool, why: impl FnOnce() -> Error) -> Result<()> {
    if condition { Ok(()) } else { Err(why()) }
}

/// The recipe hash of `qforge stats observe` statistics: what was observed
/// and how (per-channel tracking or not).
fn observe_recipe(channels: Option<usize>) -> Digest {
    let channels = channels.map_or("none".to_owned(), |c| c.to_string());
    Digest::of(format!("qforge.stats.observe.v1 channels={channels}").as_bytes())
}

/// The statistics of every value in the file at `path` (raw little-endian
/// f32, or a float32/float64 `.npy` by its magic bytes) as one tensor named
/// `name`, tracked per channel when `channels` gives the row width. The data
/// hash is of the values as little-endian f32, so a `.npy` and a raw file of
/// the same values give the same statistics.
pub fn observe_value_file(path: &Path, name: &str, channels: Option<usize>) -> Result<Stats> {
    let file = ValueFile::open(path)?;
    if let Some(c) = channels {
        ensure(file.len.is_multiple_of(c as u64), || {
            Error::Data(format!(
                "{}: {} values do not form rows of {c} channels",
                path.display(),
                file.len
            ))
        })?;
        ensure(
            !file.fortran_order || file.shape.as_ref().is_some_and(|s| s.len() <= 1),
            || {
                Error::Data(format!(
                    "{}: a Fortran-ordered .npy does not store channels last; save it C-ordered",
                    path.display()
                ))
            },
        )?;
    }
    let mut tensor = channels.map_or_else(TensorStats::new, TensorStats::with_channels);
    let mut hash = DigestBuilder::default();
    // Per-channel tracking needs whole rows per call; a chunk that splits a row
    // carries the partial row over to the next one.
    let row_width = channels.unwrap_or(1);
    let mut pending: Vec<f32> = Vec::new();
    file.for_each_chunk(path, |values, bytes| {
        hash.update(bytes);
        if row_width == 1 || (pending.is_empty() && values.len() % row_width == 0) {
            tensor.observe(values)?;
        } else {
            pending.extend_from_slice(values);
            let whole = pending.len() / row_width * row_width;
            tensor.observe(&pending[..whole])?;
            pending.drain(..whole);
        }
        Ok(())
    })?;
    let data = hash.finish();
    Ok(Stats {
        provenance: Provenance::single(
            None,
            data,
            observe_recipe(channels),
            "observe",
            BatchId {
                index: 0,
                content: data,
            },
            1,
        ),
        tensors: [(name.to_owned(), tensor)].into(),
    })
}

/// The text of `key`'s value in a `.npy` header dict (a Python literal).
fn npy_field<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let start = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = &header[start + key.len() + 2..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')')? + 1
    } else {
        rest.find([',', '}']).unwrap_or(rest.len())
    };
    Some(&rest[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version-1 `.npy` of `values` as `<f4` with shape `shape`.
    fn npy(values: &[f32], shape: &str) -> Vec<u8> {
        let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((header.len() as u16).to_le_bytes());
        out.extend(header.as_bytes());
        out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        out
    }

    #[test]
    fn a_npy_and_a_raw_file_of_the_same_values_give_the_same_statistics() {
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.25 - 3.0).collect();
        let raw = dir.path().join("values.f32");
        std::fs::write(
            &raw,
            values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let array = dir.path().join("values.npy");
        std::fs::write(&array, npy(&values, "(6, 4)")).unwrap();
        let a = observe_value_file(&raw, "x", Some(4)).unwrap();
        let b = observe_value_file(&array, "x", Some(4)).unwrap();
        assert_eq!(
            qforge_core::codec::encode(&a),
            qforge_core::codec::encode(&b)
        );
        assert_eq!(a.tensors["x"].histogram().count(), 24);
        assert_eq!(a.tensors["x"].channel_abs_max().unwrap().len(), 4);
    }

    #[test]
    fn truncated_or_misshapen_files_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cut.npy");
        let mut bytes = npy(&[1.0; 8], "(8,)");
        bytes.truncate(bytes.len() - 4);
        std::fs::write(&path, bytes).unwrap();
        let e = observe_value_file(&path, "x", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs 32 data bytes but the file has 28"), "{e}");
        std::fs::write(&path, [0u8; 7]).unwrap();
        let e = observe_value_file(&path, "x", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a multiple of 4"), "{e}");
        std::fs::write(&path, [0u8; 12]).unwrap();
        let e = observe_value_file(&path, "x", Some(2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 values do not form rows of 2 channels"), "{e}");
    }

    #[test]
    fn reads_npy_header_fields() {
        let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }";
        assert_eq!(npy_field(h, "descr"), Some("'<f4'"));
        assert_eq!(npy_field(h, "fortran_order"), Some("False"));
        assert_eq!(npy_field(h, "shape"), Some("(3, 4)"));
        assert_eq!(npy_field(h, "missing"), None);
    }
}
