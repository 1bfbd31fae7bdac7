//! Writing results so that a reader sees the old result or the whole new
//! one, never a partial write: files through a synced temporary file and a
//! rename, directories through a staged sibling swapped into place.

use std::fs;
use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};

/// Writes `bytes` to `path` through a temporary file in the same directory,
/// synced and renamed into place.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = parent_of(path);
    create_dir_all(dir)?;
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::Output(format!("output path {} names no file", path.display())))?;
    let temp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut file = fs::File::create(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&temp, path)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&temp);
        Error::Output(format!(
            "cannot write {} (check free space and permissions): {e}",
            path.display()
        ))
    })
}

/// Checks that a file can be written at `path` before the work that
/// produces it: `path` is no directory, and its directory can be created
/// and written in (a probe file beside it).
pub fn check_writable(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(Error::Request(format!(
            "{} is a directory; name a file",
            path.display()
        )));
    }
    let dir = parent_of(path);
    create_dir_all(dir)?;
    let probe = dir.join(format!(".qforge-probe-{}", std::process::id()));
    fs::write(&probe, b"").map_err(|e| {
        Error::Output(format!(
            "cannot write in {} (check permissions): {e}",
            dir.display()
        ))
    })?;
    let _ = fs::remove_file(probe);
    Ok(())
}

/// Fills a fresh sibling of the directory `output` through `fill`, then
/// swaps it into place. An existing `output` must be an earlier qforge
/// output (it has a `manifest.json` or `report.json`) or empty; anything
/// else is left alone and refused.
pub fn write_dir_atomic<E: From<Error>>(
    output: &Path,
    fill: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    if output.exists() && !replaceable(output) {
        return Err(Error::Output(format!(
            "{} exists and is not an earlier qforge output; choose another output directory",
            output.display()
        ))
        .into());
    }
    let parent = parent_of(output);
    create_dir_all(parent)?;
    let name = output
        .file_name()
        .ok_or_else(|| Error::Output(format!("{} names no directory", output.display())))?
        .to_string_lossy()
        .into_owned();
    let staging = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir(&staging).map_err(|e| Error::io(&staging, e))?;
    if let Err(e) = fill(&staging) {
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    if output.exists() {
        fs::rename(output, &old).map_err(|e| Error::io(output, e))?;
    }
    fs::rename(&staging, output).map_err(|e| Error::io(output, e))?;
    let _ = fs::remove_dir_all(&old);
    Ok(())
}

/// Whether `output` may be replaced: an earlier qforge output, or empty.
fn replaceable(output: &Path) -> bool {
    output.is_dir()
        && (output.join("report.json").exists()
            || output.join("manifest.json").exists()
            || fs::read_dir(output).is_ok_and(|mut d| d.next().is_none()))
}

/// Creates `dir` and its parents, saying which could not be made.
fn create_dir_all(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)
        .map_err(|e| Error::Output(format!("cannot create directory {}: {e}", dir.display())))
}

/// The directory `path` is in (`.` for a bare name).
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}
