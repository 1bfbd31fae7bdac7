//! Reading f32 values from raw little-endian files and `.npy` arrays, in
//! bounded chunks so that files of any size stream through.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};

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
pub struct ValueFile {
    element: Element,
    /// Number of values the file holds.
    pub len: u64,
    /// Shape, for `.npy` files.
    pub shape: Option<Vec<u64>>,
    /// True for a Fortran-ordered `.npy` (column-major).
    pub fortran_order: bool,
    reader: BufReader<File>,
}

impl ValueFile {
    /// Opens `path` as `.npy` (by its magic bytes) or as raw little-endian f32.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let file_len = file
            .metadata()
            .with_context(|| format!("cannot stat {}", path.display()))?
            .len();
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut magic = [0u8; 6];
        let is_npy = file_len >= 6 && {
            reader.read_exact(&mut magic)?;
            &magic == b"\x93NUMPY"
        };
        if is_npy {
            return Self::open_npy(path, reader, file_len);
        }
        // Not .npy: start again from the first byte as raw f32.
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        ensure!(
            file_len.is_multiple_of(4),
            "{}: size {file_len} bytes is not a multiple of 4, so it is not raw little-endian f32 \
             (and it has no .npy header); write the values as float32",
            path.display()
        );
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
        let mut version = [0u8; 2];
        reader
            .read_exact(&mut version)
            .with_context(|| format!("{name}: truncated .npy header"))?;
        let header_len = match version[0] {
            1 => {
                let mut n = [0u8; 2];
                reader
                    .read_exact(&mut n)
                    .with_context(|| format!("{name}: truncated .npy header"))?;
                u64::from(u16::from_le_bytes(n))
            }
            2 | 3 => {
                let mut n = [0u8; 4];
                reader
                    .read_exact(&mut n)
                    .with_context(|| format!("{name}: truncated .npy header"))?;
                u64::from(u32::from_le_bytes(n))
            }
            v => bail!("{name}: unsupported .npy format version {v}.{}", version[1]),
        };
        let prefix = if version[0] == 1 { 10 } else { 12 };
        ensure!(
            prefix + header_len <= file_len,
            "{name}: .npy header of {header_len} bytes runs past the end of the {file_len}-byte file"
        );
        let mut header = vec![0u8; header_len as usize];
        reader.read_exact(&mut header)?;
        let header = String::from_utf8(header)
            .with_context(|| format!("{name}: .npy header is not text"))?;
        let descr = npy_field(&header, "descr")
            .with_context(|| format!("{name}: .npy header has no 'descr': {header:?}"))?;
        let element = match descr.trim_matches(|c| c == '\'' || c == '"') {
            "<f4" | "=f4" => Element::F32Le,
            ">f4" => Element::F32Be,
            "<f8" | "=f8" => Element::F64Le,
            other => bail!(
                "{name}: .npy dtype {other:?} is not supported; save the array as float32 ('<f4')"
            ),
        };
        let fortran_order = npy_field(&header, "fortran_order")
            .map(|v| v.trim() == "True")
            .unwrap_or(false);
        let shape_text = npy_field(&header, "shape")
            .with_context(|| format!("{name}: .npy header has no 'shape': {header:?}"))?;
        let shape = shape_text
            .trim()
            .trim_start_matches('(')
            .trim_end_matches(')')
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|d| {
                d.parse::<u64>()
                    .with_context(|| format!("{name}: bad .npy shape {shape_text:?}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let len = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .with_context(|| format!("{name}: .npy shape {shape:?} overflows"))?;
        let data_len = file_len - prefix - header_len;
        let expected = len.checked_mul(element.size() as u64);
        ensure!(
            expected == Some(data_len),
            "{name}: .npy shape {shape:?} needs {} data bytes but the file has {data_len} \
             (truncated or corrupt file)",
            expected.map_or("more than 2^64".to_owned(), |e| e.to_string())
        );
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
    pub fn for_each_chunk(
        mut self,
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
            self.reader
                .read_exact(bytes)
                .context("value file ended early (was it truncated while being read?)")?;
            self.element.decode(bytes, &mut values);
            le_bytes.clear();
            le_bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
            consume(&values, &le_bytes)?;
            remaining -= n as u64;
        }
        Ok(())
    }
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
    use super::npy_field;

    #[test]
    fn reads_npy_header_fields() {
        let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }";
        assert_eq!(npy_field(h, "descr"), Some("'<f4'"));
        assert_eq!(npy_field(h, "fortran_order"), Some("False"));
        assert_eq!(npy_field(h, "shape"), Some("(3, 4)"));
        assert_eq!(npy_field(h, "missing"), None);
    }
}
