//! Checkpoints of a run: the merged statistics so far, whose provenance holds
//! the set of merged batch ids (the done set), written atomically and kept in
//! threes.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use qforge_core::Stats;
use qforge_core::codec::{decode, encode};

use crate::error::{Error, Result};

/// How many checkpoints to keep.
const KEEP: usize = 3;

/// The newest readable checkpoint (its path and statistics), if any, and
/// warnings about newer ones that could not be read.
pub type Latest = (Option<(PathBuf, Stats)>, Vec<String>);

/// A directory of checkpoints for one run: `ckpt-<merged batches>.qstats`.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    dir: PathBuf,
}

fn checkpoint_error(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

impl CheckpointStore {
    /// A store in `dir` (created when first written).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Checkpoint files, newest (most batches) first.
    fn files(&self) -> Result<Vec<(u64, PathBuf)>> {
        if !self.dir.exists() {
            return Ok(Vec::new());
        }
        let mut files: Vec<(u64, PathBuf)> = fs::read_dir(&self.dir)
            .map_err(|e| checkpoint_error(&self.dir, e))?
            .filter_map(|entry| {
                let path = entry.ok()?.path();
                let name = path.file_name()?.to_str()?;
                let n = name
                    .strip_prefix("ckpt-")?
                    .strip_suffix(".qstats")?
                    .parse()
                    .ok()?;
                Some((n, path))
            })
            .collect();
        files.sort_by(|a, b| b.cmp(a));
        Ok(files)
    }

    /// Writes `stats` as the checkpoint after `merged` batches (temp file,
    /// fsync, rename, fsync of the directory), then deletes all but the newest
    /// three.
    pub fn write(&self, merged: u64, stats: &Stats) -> Result<PathBuf> {
        fs::create_dir_all(&self.dir).map_err(|e| checkpoint_error(&self.dir, e))?;
        let path = self.dir.join(format!("ckpt-{merged:08}.qstats"));
        let temp = self
            .dir
            .join(format!(".ckpt-{merged:08}.tmp-{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut file = fs::File::create(&temp)?;
            file.write_all(&encode(stats))?;
            file.sync_all()?;
            fs::rename(&temp, &path)?;
            fs::File::open(&self.dir)?.sync_all()
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&temp);
            checkpoint_error(&path, format!("{e} (check free space and permissions)"))
        })?;
        for (_, old) in self.files()?.into_iter().skip(KEEP) {
            let _ = fs::remove_file(old);
        }
        Ok(path)
    }

    /// The newest checkpoint that decodes, and warnings about any newer one
    /// that did not (a corrupt latest checkpoint falls back to the previous).
    pub fn latest(&self) -> Result<Latest> {
        let mut warnings = Vec::new();
        for (_, path) in self.files()? {
            let decoded = fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|bytes| decode(&bytes).map_err(|e| e.to_string()));
            match decoded {
                Ok(stats) => return Ok((Some((path, stats)), warnings)),
                Err(reason) => warnings.push(format!(
                    "checkpoint {} is unreadable ({reason}); falling back to the previous one",
                    path.display()
                )),
            }
        }
        Ok((None, warnings))
    }
}
