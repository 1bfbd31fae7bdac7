//! Reading the files of a model, which qforge did not necessarily write.
//!
//! Every loader reads through here, so three rules hold everywhere:
//!
//! * only regular files are read ([`open_regular`]): a FIFO in place of
//!   `model.safetensors` blocked `serve` forever, and a shard index linked to
//!   `/dev/zero` was read until memory ran out;
//! * a JSON or TOML file is read only up to [`MAX_CONFIG_BYTES`]
//!   ([`read_config`], [`read_json`]);
//! * a path named by a file (a manifest's entries, a shard index's weight
//!   map) stays inside its directory ([`inside`]): `qforge verify` hashed
//!   `/etc/passwd` when a manifest listed it.
//!
//! Data files (JSONL rollouts, evaluation text) are not models and are not
//! read through here: a pipe is a fine source of data (`--data <(zcat …)`).

use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// The largest JSON or TOML file qforge reads (configs, tokenizers,
/// manifests, recipes, calibration profiles). `tokenizer.json` is the
/// largest of them: about 9 MB for Llama 3's 128k-token vocabulary, 2 MB
/// for SmolLM2's. 64 MiB leaves room for larger vocabularies and refuses a
/// runaway file before it fills memory.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;

/// What a file that is not a regular file is, for messages.
fn kind_of(metadata: &std::fs::Metadata) -> &'static str {
    let kind = metadata.file_type();
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO";
        }
        if kind.is_socket() {
            return "a socket";
        }
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
    }
    if kind.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

fn check_regular(path: &Path, metadata: &std::fs::Metadata) -> Result<()> {
    if metadata.is_file() {
        return Ok(());
    }
    Err(Error::Format(format!(
        "{} is {}; qforge reads models only from regular files (replace it with the file itself)",
        path.display(),
        kind_of(metadata)
    )))
}

/// Opens `path` for reading, following symlinks, if it is a regular file.
///
/// The type is checked before opening, and the open itself cannot block: a
/// FIFO swapped in after the check opens at once under `O_NONBLOCK` and is
/// refused by the second check, made on the opened file. `O_NONBLOCK`
/// changes nothing for reading or mapping a regular file.
pub fn open_regular(path: &Path) -> Result<File> {
    let metadata = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    check_regular(path, &metadata)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(|e| Error::io(path, e))?;
    check_regular(path, &file.metadata().map_err(|e| Error::io(path, e))?)?;
    Ok(file)
}

/// The whole of the regular file `path` (weights, ONNX graphs): its size is
/// bounded by what the file holds, unlike a device's.
pub fn read_regular(path: &Path) -> Result<Vec<u8>> {
    let mut file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    Ok(bytes)
}

/// The bytes of the JSON or TOML file `path`: a regular file of at most
/// [`MAX_CONFIG_BYTES`].
pub fn read_config(path: &Path) -> Result<Vec<u8>> {
    let file = open_regular(path)?;
    let too_large = || {
        Error::Format(format!(
            "{} is larger than {} MiB, the most qforge reads from a JSON or TOML file; is it the right file?",
            path.display(),
            MAX_CONFIG_BYTES >> 20
        ))
    };
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len > MAX_CONFIG_BYTES {
        return Err(too_large());
    }
    // The size may grow after the look: read one byte past the limit to tell.
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(too_large());
    }
    Ok(bytes)
}

/// The JSON file `path` ([`read_config`]) as a `T`; a value that does not
/// parse is a [`Error::Format`] naming the file.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    serde_json::from_slice(&read_config(path)?)
        .map_err(|e| Error::Format(format!("{}: {e}", path.display())))
}

/// [`read_config`] as UTF-8 text (TOML).
pub fn read_config_text(path: &Path) -> Result<String> {
    String::from_utf8(read_config(path)?)
        .map_err(|e| Error::Format(format!("{}: not UTF-8 text ({e})", path.display())))
}

/// The file `name` inside `dir`, where `name` comes from `listed_in`, a
/// file of `dir` (a manifest, a shard index): a relative path of plain
/// components (`/`-separated) that resolves, symlinks followed, to a path
/// inside `dir`. A name that does not exist is returned as it is, for the
/// caller to report as missing.
pub fn inside(dir: &Path, name: &str, listed_in: &Path) -> Result<PathBuf> {
    let relative = Path::new(name);
    let plain = !name.is_empty()
        && relative
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        return Err(Error::Format(format!(
            "{} names {name:?}, which is not a relative path inside {} (it is empty or \
             absolute, or has `.` or `..` in it); qforge reads only the directory's own files",
            listed_in.display(),
            dir.display()
        )));
    }
    let path = dir.join(relative);
    let real = match std::fs::canonicalize(&path) {
        Ok(real) => real,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(path),
        Err(e) => return Err(Error::io(&path, e)),
    };
    let root = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    if !real.starts_with(&root) {
        return Err(Error::Format(format!(
            "{} names {name}, which resolves to {}, outside {}; copy the file into the \
             directory instead of linking to it",
            listed_in.display(),
            real.display(),
            dir.display()
        )));
    }
    Ok(path)
}
