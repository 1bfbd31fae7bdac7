//! `manifest.json`: what every directory qforge writes (native artifact,
//! exports) says about itself — the qforge version, what produced it
//! (provenance hashes, recipe, coverage, guard results: free-form, from the
//! producer) and the SHA-256 of every other file, so [`verify`] can name the
//! file that changed.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use qforge_core::DigestBuilder;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The manifest's file name.
pub const MANIFEST_FILE: &str = "manifest.json";
const FORMAT: &str = "qforge-manifest";
const VERSION: u32 = 1;

/// One file of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// SHA-256 of the content, hex.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always `qforge-manifest`.
    pub format: String,
    /// Layout version.
    pub version: u32,
    /// Version of the qforge that wrote the directory.
    pub qforge_version: String,
    /// What the producer records: provenance, recipe, coverage, guard.
    pub info: serde_json::Value,
    /// Every other file of the directory (paths relative to it, `/`-separated).
    pub files: BTreeMap<String, FileEntry>,
}

/// Every regular file under `dir` except the manifest, relative paths sorted.
fn files_under(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(current) = pending.pop() {
        let entries = std::fs::read_dir(&current).map_err(|e| Error::io(&current, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(&current, e))?;
            let path = entry.path();
            let kind = entry.file_type().map_err(|e| Error::io(&path, e))?;
            if kind.is_dir() {
                pending.push(path);
                continue;
            }
            let relative = path
                .strip_prefix(dir)
                .expect("listed under dir")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            if relative != MANIFEST_FILE {
                out.push((relative, path));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The SHA-256 and size of the file at `path`.
pub fn hash_file(path: &Path) -> Result<FileEntry> {
    let mut file = crate::files::open_regular(path)?;
    let mut digest = DigestBuilder::default();
    let mut buffer = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buffer).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        bytes += n as u64;
        digest.update(&buffer[..n]);
    }
    Ok(FileEntry {
        sha256: digest.finish().to_hex(),
        bytes,
    })
}

/// Hashes every file of `dir` and writes `dir/manifest.json` with `info`.
pub fn write_manifest(dir: &Path, info: serde_json::Value) -> Result<Manifest> {
    let files = files_under(dir)?
        .into_iter()
        .map(|(name, path)| Ok((name, hash_file(&path)?)))
        .collect::<Result<_>>()?;
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        qforge_version: env!("CARGO_PKG_VERSION").into(),
        info,
        files,
    };
    let path = dir.join(MANIFEST_FILE);
    let text = serde_json::to_string_pretty(&manifest).expect("plain data serializes");
    std::fs::write(&path, text + "\n").map_err(|e| Error::io(&path, e))?;
    Ok(manifest)
}

/// Reads `dir/manifest.json`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST_FILE);
    let manifest: Manifest = crate::files::read_json(&path)?;
    if manifest.format != FORMAT || manifest.version != VERSION {
        return Err(Error::Unsupported(format!(
            "{}: manifest format {:?} version {} (this qforge reads {FORMAT} version {VERSION})",
            path.display(),
            manifest.format,
            manifest.version
        )));
    }
    Ok(manifest)
}

/// A directory found to match its manifest (`qforge verify`).
#[derive(Debug, Serialize)]
pub struct Verified {
    /// The directory.
    pub dir: PathBuf,
    /// Always true: a mismatch is an error.
    pub ok: bool,
    /// Files checked.
    pub files: usize,
    /// Their bytes.
    pub bytes: u64,
    /// The qforge that wrote the directory.
    pub qforge_version: String,
}

impl std::fmt::Display for Verified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} files ({} bytes) match manifest.json (written by qforge {})",
            self.dir.display(),
            self.files,
            self.bytes,
            self.qforge_version
        )
    }
}

/// Verifies `dir` ([`verify`]) and reports what matched.
pub fn verified(dir: &Path) -> Result<Verified> {
    let manifest = verify(dir)?;
    Ok(Verified {
        dir: dir.to_owned(),
        ok: true,
        files: manifest.files.len(),
        bytes: manifest.files.values().map(|f| f.bytes).sum(),
        qforge_version: manifest.qforge_version,
    })
}

/// What to do about a directory that no longer matches its manifest.
const RESTORE: &str = "the directory is not as qforge wrote it: restore it, or write it again";

/// Re-hashes every file `dir/manifest.json` lists; an error names the first
/// file that changed, went missing or appeared since it was written.
///
/// Every listed name must be a file inside `dir` ([`crate::files::inside`]),
/// checked before it is opened: a manifest listing `../x` or `/etc/passwd`
/// made this read, and on a mismatch print the SHA-256 of, any readable
/// file.
pub fn verify(dir: &Path) -> Result<Manifest> {
    let manifest = read_manifest(dir)?;
    let listed_in = dir.join(MANIFEST_FILE);
    let present = files_under(dir)?;
    if let Some((extra, _)) = present
        .iter()
        .find(|(name, _)| !manifest.files.contains_key(name))
    {
        return Err(Error::Format(format!(
            "{}: {extra} is not in the manifest (added after the directory was written); {RESTORE}",
            dir.display()
        )));
    }
    for (name, entry) in &manifest.files {
        let path = crate::files::inside(dir, name, &listed_in)?;
        let changed = |what: String| {
            Error::Format(format!(
                "{}: {name} changed since it was written ({what}); {RESTORE}",
                dir.display()
            ))
        };
        let bytes = match std::fs::metadata(&path) {
            Ok(metadata) => metadata.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::Format(format!(
                    "{}: {name} is listed in the manifest but missing; {RESTORE}",
                    dir.display()
                )));
            }
            Err(e) => return Err(Error::io(&path, e)),
        };
        // The size first: a file that grew is refused without reading it.
        if bytes != entry.bytes {
            return Err(changed(format!(
                "{bytes} bytes, manifest says {}",
                entry.bytes
            )));
        }
        let actual = hash_file(&path)?;
        if actual != *entry {
            return Err(changed(format!(
                "sha256 {}, manifest says {}",
                actual.sha256, entry.sha256
            )));
        }
    }
    Ok(manifest)
}
