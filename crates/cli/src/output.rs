//! Writing result files atomically.

use std::fs;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};

/// Writes `bytes` to `path` through a temporary file in the same directory,
/// synced and renamed into place, so a reader sees the old file or the whole
/// new one, never a partial write.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir)
        .with_context(|| format!("cannot create directory {}", dir.display()))?;
    let file_name = path
        .file_name()
        .with_context(|| format!("output path {} names no file", path.display()))?;
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
        anyhow::Error::new(e).context(format!(
            "cannot write {} (check free space and permissions)",
            path.display()
        ))
    })
}

/// Fills a fresh sibling of the directory `output`, then swaps it into
/// place, so a reader never sees a half-written directory. An existing
/// `output` must be an earlier qforge output (it has a `manifest.json` or
/// `report.json`) or empty; anything else is left alone.
pub fn write_dir_atomic(output: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    if output.exists() {
        let ours = output.is_dir()
            && (output.join("report.json").exists()
                || output.join("manifest.json").exists()
                || std::fs::read_dir(output)
                    .map(|mut d| d.next().is_none())
                    .unwrap_or(false));
        if !ours {
            bail!(
                "{} exists and is not an earlier qforge output; choose another -o",
                output.display()
            );
        }
    }
    let parent = output
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let name = output
        .file_name()
        .context("-o needs a directory name")?
        .to_string_lossy()
        .into_owned();
    let staging = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir(&staging)
        .with_context(|| format!("cannot create {}", staging.display()))?;
    if let Err(e) = fill(&staging) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    if output.exists() {
        std::fs::rename(output, &old)
            .with_context(|| format!("cannot move the earlier {} aside", output.display()))?;
    }
    std::fs::rename(&staging, output)
        .with_context(|| format!("cannot move the new output to {}", output.display()))?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}
