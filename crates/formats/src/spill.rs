//! Data moved out of the process's memory into unnamed temporary files,
//! mapped read-only.
//!
//! What a long run builds once and then only reads (GPTQ's int8 rounding of
//! every layer, the guard's reference log-probabilities) lives in the page
//! cache this way: the kernel keeps it while memory allows and drops and
//! re-reads it when not, where the process's own memory could only grow.
//! llama.cpp keeps its reference logits for `--kl-divergence` in a file for
//! the same reason. The files have no name (`O_TMPFILE` where the system has
//! it), so they go when their mapping does, even if the process dies.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use crate::error::Result;

/// Bytes converted and written at a time: what is spilled is never copied
/// whole.
pub const CHUNK: usize = 1 << 20;

/// Writes what `write` writes to an unnamed file in the temporary directory
/// (`TMPDIR`, else `/tmp`) and maps it read-only.
pub fn spill(
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<Arc<memmap2::Mmap>> {
    spill_in(&std::env::temp_dir(), write)
}

/// [`spill`] into the directory `dir`.
pub fn spill_in(
    dir: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<Arc<memmap2::Mmap>> {
    let failed = |e| crate::Error::Io {
        path: dir.to_owned(),
        source: std::io::Error::other(format!(
            "cannot write to a temporary file here ({e}); set TMPDIR to a directory with room \
             (a quantized model's int8 copy, 7.5 GB for Llama-3-8B)"
        )),
    };
    let file = tempfile::tempfile_in(dir).map_err(failed)?;
    let mut out = std::io::BufWriter::with_capacity(CHUNK, file);
    write(&mut out).map_err(failed)?;
    let file = out.into_inner().map_err(|e| failed(e.into_error()))?;
    // SAFETY: the file has no name (it was never linked into a directory),
    // so no other process can change it under the mapping, and this handle,
    // which nothing writes through again, is the only one.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(failed)?;
    Ok(Arc::new(map))
}

/// Writes `values` as little-endian f32, a chunk at a time.
pub fn write_f32(values: &[f32], out: &mut dyn Write) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(4 * (CHUNK / 4).min(values.len()));
    for chunk in values.chunks(CHUNK / 4) {
        bytes.clear();
        bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
        out.write_all(&bytes)?;
    }
    Ok(())
}

/// Writes `values`, each a bf16 widened to f32, as little-endian bf16 (its
/// upper 16 bits), a chunk at a time; a value that is no bf16 is an error,
/// never truncated.
pub fn write_bf16(values: &[f32], out: &mut dyn Write) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(2 * (CHUNK / 2).min(values.len()));
    for chunk in values.chunks(CHUNK / 2) {
        bytes.clear();
        for v in chunk {
            let bits = v.to_bits();
            if bits & 0xffff != 0 {
                return Err(std::io::Error::other(format!(
                    "{v} is no bf16 value; only a bf16 tensor is written as bf16"
                )));
            }
            bytes.extend(((bits >> 16) as u16).to_le_bytes());
        }
        out.write_all(&bytes)?;
    }
    Ok(())
}

/// Writes `values` as bytes, a chunk at a time.
pub fn write_i8(values: &[i8], out: &mut dyn Write) -> std::io::Result<()> {
    values.chunks(CHUNK).try_for_each(|chunk| {
        let bytes: Vec<u8> = chunk.iter().map(|v| v.to_le_bytes()[0]).collect();
        out.write_all(&bytes)
    })
}

/// The little-endian f32 values of `bytes`.
pub fn read_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
