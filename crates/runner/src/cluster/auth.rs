//! Authenticated results. Redis is a meeting point, not a trusted party:
//! anything that can write to a run's keys could otherwise append a result
//! with forged statistics, and the coordinator would merge it as a worker's.
//!
//! Coordinator and workers share a **cluster key**, handed to them out of
//! band, never through Redis: the file `--cluster-key-file` names, the
//! variable `QFORGE_CLUSTER_KEY`, or by default the file
//! `~/.config/qforge/cluster.key`, created (mode 0600, 256 random bits) by
//! whichever process needs it first, so that a cluster on one machine needs
//! no setup; workers on other machines get a copy of that file, as an
//! Erlang node gets `~/.erlang.cookie`. The key never reaches a command line
//! (`ps`), a log line or Redis.
//!
//! From it the coordinator derives each run's own **run key**, with a random
//! nonce it publishes in the spec beside a check value that proves the key
//! without revealing it. A worker admits itself to a run only when its own
//! derivation gives the same check, and seals every result entry it appends
//! with an HMAC-SHA-256 of all the entry's fields under the run key. The
//! coordinator refuses, names and never decodes an entry whose MAC does not
//! verify. A run key is worth nothing to any other run, and the cluster key
//! itself never signs anything an observer of Redis sees.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use rand::RngCore;
use redis::Value;
use sha2::Sha256;

use crate::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

/// The variable holding the cluster key itself.
pub const KEY_VARIABLE: &str = "QFORGE_CLUSTER_KEY";

/// A key shorter than this is refused: a cluster key is random bytes, not a
/// password a person remembers.
const MIN_KEY_CHARS: usize = 32;

/// A key file holds one line; anything larger is not one.
const KEY_FILE_LIMIT: u64 = 4096;

/// The field of a result entry that carries its MAC.
pub const MAC_FIELD: &str = "mac";

/// The secret coordinator and workers share.
#[derive(Clone)]
pub struct ClusterKey {
    secret: Vec<u8>,
    /// Where it came from, for messages (never the key itself).
    source: String,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterKey(from {})", self.source)
    }
}

impl ClusterKey {
    /// The key `text` (its first line, trimmed), which came from `source`.
    pub fn from_text(text: &str, source: &str) -> Result<Self> {
        let key = text.lines().next().unwrap_or("").trim();
        if key.chars().count() < MIN_KEY_CHARS {
            return Err(Error::Cluster(format!(
                "the cluster key in {source} has {} characters; it needs at least {MIN_KEY_CHARS} \
                 (random ones: `head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'`)",
                key.chars().count()
            )));
        }
        Ok(Self {
            secret: key.as_bytes().to_vec(),
            source: source.to_owned(),
        })
    }

    /// The key from `file`, else from [`KEY_VARIABLE`], else from the
    /// default file, which is created if no process made it yet (`created`
    /// then names it, so the caller can say where to copy it).
    pub fn load(file: Option<&Path>) -> Result<(Self, Option<PathBuf>)> {
        if let Some(path) = file {
            return Ok((read_key_file(path)?, None));
        }
        if let Ok(text) = std::env::var(KEY_VARIABLE) {
            return Ok((Self::from_text(&text, KEY_VARIABLE)?, None));
        }
        let path = default_key_file()?;
        let created = create_key_file(&path)?;
        Ok((read_key_file(&path)?, created.then_some(path)))
    }

    /// Where the key came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The key of run `run` published with `nonce` (the spec's).
    pub fn run_key(&self, run: &str, nonce: &str) -> RunKey {
        let mut mac = self.mac();
        for part in ["qforge run key", run, nonce] {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part.as_bytes());
        }
        RunKey {
            secret: mac.finalize().into_bytes().into(),
        }
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.secret).expect("HMAC takes a key of any length")
    }
}

/// A fresh random nonce for a run's spec, hex.
pub(crate) fn new_nonce() -> String {
    let mut bytes = [0u8; 16];
    rand::rng().fill_bytes(&mut bytes);
    hex(&bytes)
}

/// The key that seals one run's results.
pub struct RunKey {
    secret: [u8; 32],
}

impl RunKey {
    /// A value the spec carries so that a worker can tell whether it derived
    /// the coordinator's run key: an HMAC of a fixed text, which says
    /// nothing about the key.
    pub fn check_value(&self) -> String {
        hex(&self.mac_of(&[("check", b"qforge key check")]))
    }

    /// The MAC of a result entry with `fields` (every field but the MAC;
    /// their order does not matter), as a worker seals one.
    pub fn seal(&self, fields: &[(&str, &[u8])]) -> String {
        hex(&self.mac_of(fields))
    }

    /// Whether `entry`, as Redis returned it, carries a MAC of all its other
    /// fields under this key. Compared in constant time.
    pub(crate) fn verifies(&self, entry: &HashMap<String, Value>) -> bool {
        let Some(Value::BulkString(claimed)) = entry.get(MAC_FIELD) else {
            return false;
        };
        let Some(claimed) = unhex(claimed) else {
            return false;
        };
        let mut fields = Vec::with_capacity(entry.len());
        for (name, value) in entry {
            match value {
                _ if name == MAC_FIELD => {}
                Value::BulkString(bytes) => fields.push((name.as_str(), bytes.as_slice())),
                _ => return false,
            }
        }
        self.mac_over(&fields).verify_slice(&claimed).is_ok()
    }

    fn mac_of(&self, fields: &[(&str, &[u8])]) -> [u8; 32] {
        self.mac_over(fields).finalize().into_bytes().into()
    }

    /// The MAC state over `fields` in name order, each length-prefixed, so
    /// that no two different entries feed it the same bytes.
    fn mac_over(&self, fields: &[(&str, &[u8])]) -> HmacSha256 {
        let sorted: BTreeMap<&str, &[u8]> = fields.iter().copied().collect();
        let mut mac = HmacSha256::new_from_slice(&self.secret).expect("any key length");
        mac.update(&(sorted.len() as u64).to_le_bytes());
        for (name, value) in sorted {
            mac.update(&(name.len() as u64).to_le_bytes());
            mac.update(name.as_bytes());
            mac.update(&(value.len() as u64).to_le_bytes());
            mac.update(value);
        }
        mac
    }
}

fn read_key_file(path: &Path) -> Result<ClusterKey> {
    let source = format!("--cluster-key-file {}", path.display());
    let refuse = |why: String| Error::Cluster(format!("{source}: {why}"));
    let metadata = std::fs::metadata(path).map_err(|e| refuse(e.to_string()))?;
    if !metadata.is_file() || metadata.len() > KEY_FILE_LIMIT {
        return Err(refuse(format!(
            "not a key file (a regular file of one line, at most {KEY_FILE_LIMIT} bytes)"
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| refuse(e.to_string()))?;
    ClusterKey::from_text(&text, &path.display().to_string())
}

/// `$XDG_CONFIG_HOME/qforge/cluster.key`, else `$HOME/.config/qforge/cluster.key`.
fn default_key_file() -> Result<PathBuf> {
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".config")))
        .ok_or_else(|| {
            Error::Cluster(format!(
                "no cluster key: neither HOME nor XDG_CONFIG_HOME is set; give --cluster-key-file \
                 FILE or {KEY_VARIABLE}"
            ))
        })?;
    Ok(config.join("qforge").join("cluster.key"))
}

/// Creates the key file at `path` unless it exists; true when this call
/// created it. The file appears whole or not at all (written aside, then
/// linked into place, which fails if another process linked first), so
/// processes starting together agree on one key.
fn create_key_file(path: &Path) -> Result<bool> {
    if path.exists() {
        return Ok(false);
    }
    let refuse = |e: std::io::Error| {
        Error::Cluster(format!(
            "cannot create the cluster key file {}: {e}; give --cluster-key-file FILE or \
             {KEY_VARIABLE}",
            path.display()
        ))
    };
    let dir = path.parent().expect("the key file lies in a directory");
    std::fs::create_dir_all(dir).map_err(refuse)?;
    let aside = dir.join(format!(".cluster.key.{}", std::process::id()));
    let mut secret = [0u8; 32];
    rand::rng().fill_bytes(&mut secret);
    let written = write_private(&aside, format!("{}\n", hex(&secret)).as_bytes());
    let linked = written.and_then(|()| std::fs::hard_link(&aside, path));
    let _ = std::fs::remove_file(&aside);
    match linked {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(refuse(e)),
    }
}

/// Writes `bytes` to a new file at `path` that only its owner can read.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &[u8]) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    text.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> ClusterKey {
        ClusterKey::from_text(text, "test").unwrap()
    }

    fn entry(fields: &[(&str, &[u8])]) -> HashMap<String, Value> {
        fields
            .iter()
            .map(|(name, value)| (name.to_string(), Value::BulkString(value.to_vec())))
            .collect()
    }

    #[test]
    fn a_sealed_entry_verifies_and_any_change_to_it_does_not() {
        let run = key("k".repeat(32).as_str()).run_key("cartpole", "n1");
        let fields: [(&str, &[u8]); 3] =
            [("batches", b"3"), ("worker", b"w1"), ("stats", b"\x01\x02")];
        let mut sealed = entry(&fields);
        sealed.insert(
            MAC_FIELD.into(),
            Value::BulkString(run.seal(&fields).into_bytes()),
        );
        assert!(run.verifies(&sealed));
        // One byte of the statistics, a field added, a field dropped, a
        // field renamed: each breaks it.
        let mut forged = sealed.clone();
        forged.insert("stats".into(), Value::BulkString(b"\x01\x03".to_vec()));
        assert!(!run.verifies(&forged));
        let mut added = sealed.clone();
        added.insert("speculative".into(), Value::BulkString(b"1".to_vec()));
        assert!(!run.verifies(&added));
        let mut dropped = sealed.clone();
        dropped.remove("worker");
        assert!(!run.verifies(&dropped));
        let mut unsealed = sealed.clone();
        unsealed.remove(MAC_FIELD);
        assert!(!run.verifies(&unsealed));
        // Another run, nonce or cluster key derives another run key.
        for other in [
            key("k".repeat(32).as_str()).run_key("cartpole2", "n1"),
            key("k".repeat(32).as_str()).run_key("cartpole", "n2"),
            key("j".repeat(32).as_str()).run_key("cartpole", "n1"),
        ] {
            assert!(!other.verifies(&sealed));
            assert_ne!(other.check_value(), run.check_value());
        }
    }

    #[test]
    fn a_short_key_is_refused_and_a_created_key_file_is_private_and_kept() {
        let err = ClusterKey::from_text("password", "QFORGE_CLUSTER_KEY")
            .unwrap_err()
            .to_string();
        assert!(err.contains("at least 32"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qforge").join("cluster.key");
        assert!(create_key_file(&path).unwrap());
        assert!(!create_key_file(&path).unwrap());
        let first = read_key_file(&path).unwrap();
        assert_eq!(first.secret.len(), 64);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert_eq!(read_key_file(&path).unwrap().secret, first.secret);
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1
        );
    }
}
