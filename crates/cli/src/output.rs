//! Printing a command's result.

use std::fmt::Display;
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use crate::OutputFlags;

/// Prints a command's result: its JSON with `--json`, else its text.
pub fn print_report(report: &(impl Serialize + Display), flags: OutputFlags) -> Result<()> {
    if flags.json {
        print_json(report)
    } else {
        println!("{report}");
        Ok(())
    }
}

/// Prints `value` as pretty JSON on stdout.
pub fn print_json(value: &impl Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints a command's result written to `output`: with `--json` the
/// report's JSON with `"output"` (the path) added, else `wrote OUTPUT:
/// REPORT`.
pub fn print_written(
    output: &Path,
    report: &(impl Serialize + Display),
    flags: OutputFlags,
) -> Result<()> {
    if flags.json {
        print_json(&Written { output, report })
    } else {
        println!("wrote {}: {report}", output.display());
        Ok(())
    }
}

/// A report of something written to `output`: the report's own fields and
/// `"output"`, the path.
#[derive(Serialize)]
pub struct Written<'a, R> {
    output: &'a Path,
    #[serde(flatten)]
    report: &'a R,
}

impl<'a, R: Serialize> Written<'a, R> {
    pub fn new(output: &'a Path, report: &'a R) -> Self {
        Self { output, report }
    }
}
