//! Calibration data in the shapes RL trainers emit, as JSONL.
//!
//! LLM episodes: `{"prompt": …, "completion": …}`, `{"text": …}` or
//! `{"token_ids": …}`, each with `"reward"?` and `"episode_id"?`: exactly one
//! of the three contents (a record with two is ambiguous, so it is refused
//! rather than one of them silently dropped), and not empty (an empty text
//! has no token to calibrate on). Policy trajectories: `{"observations":
//! [[…], …], "actions"?: …, "rewards"?: …}`. Every line is one record;
//! blank lines are ignored.

use std::path::Path;

use qforge_core::{Digest, DigestBuilder};
use serde_json::Value;

use crate::error::{Error, Result};

/// What an LLM episode holds to calibrate on.
#[derive(Debug, Clone, PartialEq)]
pub enum EpisodeContent {
    /// A prompt and the policy's completion.
    PromptCompletion {
        /// The prompt.
        prompt: String,
        /// The completion.
        completion: String,
    },
    /// Plain text.
    Text(String),
    /// Token ids, already tokenized.
    TokenIds(Vec<u32>),
}

/// One record of calibration data.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// An LLM episode.
    Episode {
        /// Its content.
        content: EpisodeContent,
        /// The episode's reward, if recorded.
        reward: Option<f64>,
    },
    /// A control-policy trajectory.
    Trajectory {
        /// Observations, one row per step.
        observations: Vec<Vec<f32>>,
        /// Total reward of the trajectory, if rewards were recorded.
        reward: Option<f64>,
    },
}

impl Record {
    /// The record's reward (episode reward, or sum of trajectory rewards).
    pub fn reward(&self) -> Option<f64> {
        match self {
            Record::Episode { reward, .. } | Record::Trajectory { reward, .. } => *reward,
        }
    }
}

/// A loaded calibration data file.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Valid records, in file order.
    pub records: Vec<Record>,
    /// The 1-based line of each record.
    pub lines: Vec<usize>,
    /// Lines skipped under `skip_invalid`: (1-based line, reason), in file
    /// order.
    pub skipped: Vec<(usize, String)>,
    /// SHA-256 of the file's bytes.
    pub digest: Digest,
}

/// Every row is `width` values wide.
pub fn fits_width(rows: &[Vec<f32>], width: usize) -> std::result::Result<(), String> {
    match rows.iter().position(|o| o.len() != width) {
        Some(i) => Err(format!(
            "observation {i} has {} values; the policy takes {width}",
            rows[i].len()
        )),
        None => Ok(()),
    }
}

/// Reads a JSONL file. A bad line fails the load with its line number, unless
/// `skip_invalid`, which counts and skips it.
pub fn load_jsonl(path: &Path, skip_invalid: bool) -> Result<Dataset> {
    let bytes = std::fs::read(path).map_err(|source| qforge_formats::Error::io(path, source))?;
    parse_jsonl(&bytes, &path.display().to_string(), skip_invalid)
}

/// Parses JSONL bytes (`name` labels errors).
pub fn parse_jsonl(bytes: &[u8], name: &str, skip_invalid: bool) -> Result<Dataset> {
    let mut digest = DigestBuilder::default();
    digest.update(bytes);
    let mut records = Vec::new();
    let mut lines = Vec::new();
    let mut skipped = Vec::new();
    // A UTF-8 byte-order mark, which Windows editors and some exporters
    // write, is not part of line 1's record (it made line 1 "not valid
    // JSON"). The digest above still covers the file's bytes as they are.
    let body = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    for (index, line) in body.split(|&b| b == b'\n').enumerate() {
        let line_no = index + 1;
        let text = match std::str::from_utf8(line) {
            Ok(t) => t.trim(),
            Err(_) => {
                let reason = "not valid UTF-8".to_owned();
                if skip_invalid {
                    skipped.push((line_no, reason));
                    continue;
                }
                return Err(Error::InvalidLine {
                    path: name.to_owned(),
                    line: line_no,
                    reason,
                });
            }
        };
        if text.is_empty() {
            continue;
        }
        match parse_record(text) {
            Ok(record) => {
                records.push(record);
                lines.push(line_no);
            }
            Err(reason) if skip_invalid => skipped.push((line_no, reason)),
            Err(reason) => {
                return Err(Error::InvalidLine {
                    path: name.to_owned(),
                    line: line_no,
                    reason,
                });
            }
        }
    }
    if records.is_empty() {
        return Err(Error::Data(format!(
            "{name}: no valid records ({} skipped)",
            skipped.len()
        )));
    }
    let kinds = records
        .iter()
        .map(|r| matches!(r, Record::Episode { .. }))
        .collect::<std::collections::BTreeSet<_>>();
    if kinds.len() > 1 {
        return Err(Error::Data(format!(
            "{name} mixes LLM episodes and policy trajectories; use one kind per file"
        )));
    }
    Ok(Dataset {
        records,
        lines,
        skipped,
        digest: digest.finish(),
    })
}

impl Dataset {
    /// Every observation of a trajectories file, row-major, each checked to
    /// be `width` values wide; an LLM episode or a row of another width is an
    /// error naming its line. `name` labels errors.
    pub fn observations(&self, name: &str, width: usize) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for (record, &line) in self.records.iter().zip(&self.lines) {
            let invalid = |reason: String| Error::InvalidLine {
                path: name.to_owned(),
                line,
                reason,
            };
            let Record::Trajectory { observations, .. } = record else {
                return Err(invalid(
                    "an LLM episode where policy trajectories were expected".into(),
                ));
            };
            fits_width(observations, width).map_err(invalid)?;
            out.extend(observations.iter().flatten());
        }
        Ok(out)
    }

    /// Applies a check that needs the model (an observation's width, a token
    /// id's range) to every record, as [`parse_jsonl`] does its own: a
    /// failing record fails with its line number, or under `skip_invalid` is
    /// counted and skipped. `name` labels errors.
    pub fn check(
        &mut self,
        name: &str,
        skip_invalid: bool,
        check: impl Fn(&Record) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let mut kept = (Vec::new(), Vec::new());
        for (record, line) in std::mem::take(&mut self.records)
            .into_iter()
            .zip(&self.lines)
        {
            match check(&record) {
                Ok(()) => {
                    kept.0.push(record);
                    kept.1.push(*line);
                }
                Err(reason) if skip_invalid => self.skipped.push((*line, reason)),
                Err(reason) => {
                    return Err(Error::InvalidLine {
                        path: name.to_owned(),
                        line: *line,
                        reason,
                    });
                }
            }
        }
        (self.records, self.lines) = kept;
        self.skipped.sort_by_key(|(line, _)| *line);
        if self.records.is_empty() {
            return Err(Error::Data(format!(
                "{name}: no valid records ({} skipped)",
                self.skipped.len()
            )));
        }
        Ok(())
    }
}

fn parse_record(text: &str) -> std::result::Result<Record, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let object = value
        .as_object()
        .ok_or_else(|| "a record must be a JSON object".to_owned())?;
    let number = |key: &str| -> std::result::Result<Option<f64>, String> {
        match object.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite())
                .map(Some)
                .ok_or_else(|| format!("\"{key}\" must be a finite number")),
        }
    };
    if let Some(observations) = object.get("observations") {
        let rows = observations
            .as_array()
            .ok_or("\"observations\" must be a list of lists of numbers")?;
        let mut parsed = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let row = row
                .as_array()
                .ok_or_else(|| format!("observation {i} is not a list"))?;
            let values = row
                .iter()
                .map(|v| {
                    // Finite in f32, as the forward computes: 3.5e38 is a
                    // finite f64 that rounds to +inf.
                    v.as_f64()
                        .map(|f| f as f32)
                        .filter(|f| f.is_finite())
                        .ok_or_else(|| {
                            format!("observation {i} holds {v}, not a finite 32-bit float")
                        })
                })
                .collect::<std::result::Result<Vec<f32>, String>>()?;
            if parsed
                .first()
                .is_some_and(|first: &Vec<f32>| first.len() != values.len())
            {
                return Err(format!(
                    "observation {i} has {} values, the first has {}",
                    values.len(),
                    parsed[0].len()
                ));
            }
            parsed.push(values);
        }
        if parsed.is_empty() || parsed[0].is_empty() {
            return Err("\"observations\" is empty".into());
        }
        let reward = match object.get("rewards") {
            None | Some(Value::Null) => None,
            Some(Value::Array(r)) => Some(
                r.iter()
                    .map(|v| v.as_f64().filter(|f| f.is_finite()))
                    .sum::<Option<f64>>()
                    .ok_or("\"rewards\" must be finite numbers")?,
            ),
            Some(_) => return Err("\"rewards\" must be a list of numbers".into()),
        };
        return Ok(Record::Trajectory {
            observations: parsed,
            reward,
        });
    }
    parse_episode(object, number("reward")?)
}

/// An LLM episode: exactly one content, not empty.
fn parse_episode(
    object: &serde_json::Map<String, Value>,
    reward: Option<f64>,
) -> std::result::Result<Record, String> {
    let string = |key: &str| -> std::result::Result<Option<String>, String> {
        match object.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(format!("\"{key}\" must be a string")),
        }
    };
    one_content(object)?;
    let content = if let Some(ids) = object.get("token_ids").filter(|v| !v.is_null()) {
        let ids = ids
            .as_array()
            .ok_or("\"token_ids\" must be a list of integers")?
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| format!("token id {v} is not a 32-bit unsigned integer"))
            })
            .collect::<std::result::Result<Vec<u32>, String>>()?;
        if ids.is_empty() {
            return Err("\"token_ids\" is empty".into());
        }
        EpisodeContent::TokenIds(ids)
    } else if let Some(text) = string("text")? {
        if text.is_empty() {
            return Err(
                "\"text\" is empty: it has no token to calibrate on; drop the line or give it text"
                    .into(),
            );
        }
        EpisodeContent::Text(text)
    } else if let Some(completion) = string("completion")? {
        let prompt = string("prompt")?.ok_or("a \"completion\" record needs a \"prompt\"")?;
        if prompt.is_empty() && completion.is_empty() {
            return Err(
                "\"prompt\" and \"completion\" are both empty: there is no token to calibrate on; drop the line or give it text"
                    .into(),
            );
        }
        EpisodeContent::PromptCompletion { prompt, completion }
    } else {
        return Err(
            "a record needs \"observations\" (policy) or \"completion\"/\"text\"/\"token_ids\" (LLM)"
                .into(),
        );
    };
    Ok(Record::Episode { content, reward })
}

/// Refuses an episode with more than one content: which one it meant to
/// calibrate on cannot be known, and taking one silently drops the other.
fn one_content(object: &serde_json::Map<String, Value>) -> std::result::Result<(), String> {
    let given: Vec<&str> = ["token_ids", "text", "prompt", "completion"]
        .into_iter()
        .filter(|key| object.get(*key).is_some_and(|v| !v.is_null()))
        .collect();
    let contents = usize::from(given.contains(&"token_ids"))
        + usize::from(given.contains(&"text"))
        + usize::from(given.contains(&"prompt") || given.contains(&"completion"));
    if contents > 1 {
        return Err(format!(
            "the record has {}: an episode is \"prompt\" with \"completion\", or \"text\", or \"token_ids\"; keep the one to calibrate on",
            given.join(", ")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_finite_as_the_f32_the_forward_computes_in() {
        let err = parse_jsonl(
            b"{\"observations\": [[1e38, 3.5e38]]}\n",
            "big.jsonl",
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("big.jsonl:1: observation 0 holds 3.5e+38"),
            "{err}"
        );
        assert!(parse_jsonl(b"{\"observations\": [[3.4e38]]}\n", "ok.jsonl", false).is_ok());
    }

    #[test]
    fn a_model_check_reports_lines_or_skips_them() {
        let text = b"{\"observations\": [[1, 2]]}\n\n{\"observations\": [[1]]}\n{\"observations\": [[3, 4]]}\n";
        let wide = |r: &Record| match r {
            Record::Trajectory { observations, .. } if observations[0].len() != 2 => {
                Err("too narrow".to_owned())
            }
            _ => Ok(()),
        };
        let mut d = parse_jsonl(text, "w.jsonl", false).unwrap();
        assert_eq!(d.lines, vec![1, 3, 4]);
        let err = d.check("w.jsonl", false, wide).unwrap_err().to_string();
        assert!(err.starts_with("w.jsonl:3: too narrow"), "{err}");
        let mut d = parse_jsonl(text, "w.jsonl", false).unwrap();
        d.check("w.jsonl", true, wide).unwrap();
        assert_eq!((d.records.len(), d.lines.clone()), (2, vec![1, 4]));
        assert_eq!(d.skipped, vec![(3, "too narrow".to_owned())]);
    }

    #[test]
    fn a_byte_order_mark_before_line_1_is_not_part_of_it() {
        let plain = b"{\"text\": \"hello\"}\n{\"text\": \"world\"}\n";
        let mut marked = b"\xEF\xBB\xBF".to_vec();
        marked.extend_from_slice(plain);
        let d = parse_jsonl(&marked, "bom.jsonl", false).unwrap();
        assert_eq!(
            d.records,
            parse_jsonl(plain, "plain.jsonl", false).unwrap().records
        );
        assert_ne!(
            d.digest,
            parse_jsonl(plain, "plain.jsonl", false).unwrap().digest
        );
        // Only at the start of the file: elsewhere it is a bad line.
        let mut inner = plain.to_vec();
        inner.extend_from_slice(b"\xEF\xBB\xBF{\"text\": \"x\"}\n");
        let err = parse_jsonl(&inner, "bom.jsonl", false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bom.jsonl:3"), "{err}");
    }

    #[test]
    fn parses_every_shape_and_names_bad_lines() {
        let good = br#"{"prompt": "2+2=", "completion": "4", "reward": 1.0, "episode_id": "a"}
{"text": "hello"}

{"token_ids": [1, 2, 3], "reward": -0.5}
"#;
        let d = parse_jsonl(good, "x.jsonl", false).unwrap();
        assert_eq!(d.records.len(), 3);
        assert_eq!(d.records[2].reward(), Some(-0.5));

        let bad = b"{\"text\": \"ok\"}\n{\"prompt\": 3, \"completion\": \"x\"}\nnot json\n";
        let err = parse_jsonl(bad, "x.jsonl", false).unwrap_err().to_string();
        assert!(
            err.contains("x.jsonl:2") && err.contains("--skip-invalid"),
            "{err}"
        );
        let d = parse_jsonl(bad, "x.jsonl", true).unwrap();
        assert_eq!(d.records.len(), 1);
        assert_eq!(
            d.skipped.iter().map(|s| s.0).collect::<Vec<_>>(),
            vec![2, 3]
        );

        let traj = b"{\"observations\": [[1, 2], [3, 4]], \"rewards\": [1, 0.5]}\n";
        let d = parse_jsonl(traj, "t", false).unwrap();
        assert_eq!(d.records[0].reward(), Some(1.5));
        for (line, needle) in [
            (&b"{\"observations\": [[1, 2], [3]]}"[..], "has 1 values"),
            (b"{\"observations\": [[1, NaN]]}", "not valid JSON"),
            (b"{\"observations\": []}", "empty"),
            (b"{\"token_ids\": [-1]}", "token id"),
            (b"[1, 2]", "object"),
        ] {
            let err = parse_jsonl(line, "t", false).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        let mixed = b"{\"text\": \"a\"}\n{\"observations\": [[1]]}\n";
        assert!(
            parse_jsonl(mixed, "m", false)
                .unwrap_err()
                .to_string()
                .contains("mixes")
        );
    }

    #[test]
    fn an_empty_or_ambiguous_episode_is_refused_naming_its_line() {
        for (record, needle) in [
            (r#"{"text": ""}"#, "\"text\" is empty"),
            (
                r#"{"prompt": "", "completion": ""}"#,
                "both empty: there is no token",
            ),
            (
                r#"{"prompt": "2+2=", "completion": "4", "text": "2+2=4"}"#,
                "has text, prompt, completion: an episode is",
            ),
            (r#"{"prompt": "2+2=", "text": "4"}"#, "has text, prompt"),
            (r#"{"text": "a", "token_ids": [1]}"#, "has token_ids, text"),
        ] {
            let file = format!("{{\"text\": \"fine\"}}\n{record}\n");
            let err = parse_jsonl(file.as_bytes(), "e.jsonl", false)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("e.jsonl:2") && err.contains(needle),
                "{record}: {err}"
            );
            let skipped = parse_jsonl(file.as_bytes(), "e.jsonl", true).unwrap();
            assert_eq!(skipped.skipped.len(), 1, "{record}");
        }
        // An empty completion after a prompt still has the prompt's tokens,
        // and a null stands for a key left out.
        for record in [
            r#"{"prompt": "2+2=", "completion": ""}"#,
            r#"{"text": "2+2=4", "prompt": null, "token_ids": null}"#,
        ] {
            assert!(
                parse_jsonl(record.as_bytes(), "e.jsonl", false).is_ok(),
                "{record}"
            );
        }
    }
}
