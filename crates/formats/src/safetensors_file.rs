//! Writing a safetensors file one tensor at a time, so that a file larger
//! than memory (an 8B model's artifact) is never held whole.

use std::io::Write;
use std::path::Path;

use safetensors::Dtype;

use crate::error::{Error, Result};

/// A tensor [`write_safetensors`] writes: its dtype and shape up front (the
/// header needs every tensor's size), its bytes only when its turn comes,
/// so that a file larger than memory (an 8B model's artifact) is never held
/// whole.
pub trait TensorSource {
    /// The stored dtype.
    fn dtype(&self) -> Dtype;
    /// The stored shape.
    fn shape(&self) -> &[usize];
    /// Writes the tensor's little-endian bytes, `shape`'s product times the
    /// dtype's size of them, to `out`. A tensor that cannot be made fails
    /// as an I/O error carrying its cause.
    fn write_to(&self, out: &mut dyn Write) -> std::io::Result<()>;
}

impl TensorSource for safetensors::tensor::TensorView<'_> {
    fn dtype(&self) -> Dtype {
        safetensors::tensor::TensorView::dtype(self)
    }

    fn shape(&self) -> &[usize] {
        safetensors::tensor::TensorView::shape(self)
    }

    fn write_to(&self, out: &mut dyn Write) -> std::io::Result<()> {
        out.write_all(self.data())
    }
}

/// Writes `tensors` as the safetensors file `path`, created like every
/// other file qforge writes: with the user's umask.
///
/// `safetensors::serialize_to_file` writes a `tempfile` temporary, which is
/// created 0600, and renames it into place: artifacts came out with
/// `model.safetensors` 0600 and every other file 0644. qforge writes into a
/// staging directory renamed into place whole, so it needs no temporary.
/// The bytes are `serialize_to_file`'s: the same tensor order (alignment,
/// then name), the same header padded with spaces to 8 bytes. Each tensor's
/// bytes are made as they are written ([`TensorSource`]).
pub fn write_safetensors(path: &Path, mut tensors: Vec<(String, impl TensorSource)>) -> Result<()> {
    let malformed =
        |e: safetensors::SafeTensorError| Error::Format(format!("{}: {e}", path.display()));
    tensors.sort_by(|(left_name, left), (right_name, right)| {
        right
            .dtype()
            .cmp(&left.dtype())
            .then(left_name.cmp(right_name))
    });
    let mut offset = 0;
    let mut infos = Vec::with_capacity(tensors.len());
    for (name, tensor) in &tensors {
        let end = offset + tensor.shape().iter().product::<usize>() * tensor.dtype().bitsize() / 8;
        infos.push((
            name.clone(),
            safetensors::tensor::TensorInfo {
                dtype: tensor.dtype(),
                shape: tensor.shape().to_vec(),
                data_offsets: (offset, end),
            },
        ));
        offset = end;
    }
    let metadata = safetensors::tensor::Metadata::new(None, infos.clone()).map_err(malformed)?;
    let mut header = serde_json::to_vec(&metadata).expect("a safetensors header serializes");
    header.resize(header.len().next_multiple_of(8), b' ');
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut out = Counted {
        inner: std::io::BufWriter::with_capacity(1 << 20, file),
        written: 0,
    };
    out.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&header))
        .map_err(|e| Error::io(path, e))?;
    let start = out.written;
    for ((name, tensor), (_, info)) in tensors.iter().zip(&infos) {
        tensor.write_to(&mut out).map_err(|e| Error::io(path, e))?;
        let (begin, end) = info.data_offsets;
        if out.written - start != end {
            return Err(Error::Format(format!(
                "{}: {name} gave {} bytes where its shape needs {}",
                path.display(),
                out.written - start - begin,
                end - begin
            )));
        }
    }
    out.flush().map_err(|e| Error::io(path, e))
}

/// A writer that counts the bytes through it.
struct Counted<W> {
    inner: W,
    written: usize,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(bytes)?;
        self.written += n;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_safetensors_writes_the_bytes_safetensors_writes() {
        let floats: Vec<u8> = [1.5f32, -2.0, 0.25]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let ints = [1u8, 255, 7, 0];
        let views = vec![
            (
                "b.weight".to_owned(),
                safetensors::tensor::TensorView::new(Dtype::I8, vec![2, 2], &ints).unwrap(),
            ),
            (
                "a.bias".to_owned(),
                safetensors::tensor::TensorView::new(Dtype::F32, vec![3], &floats).unwrap(),
            ),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        write_safetensors(&path, views.clone()).unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            safetensors::serialize(views, None).unwrap()
        );
    }
}
