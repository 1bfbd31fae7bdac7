//! `qforge info`: this build and what this CPU runs.

use anyhow::Result;
use clap::Args;
use qforge_kernels::MachineReport;

use crate::OutputFlags;
use crate::output::print_report;

/// Arguments of `qforge info`.
#[derive(Args)]
pub struct InfoArgs {
    #[command(flatten)]
    flags: OutputFlags,
}

/// `qforge info`: the version, the CPU features the one probe found, and the
/// tier each hot kernel runs at.
pub fn info(args: InfoArgs) -> Result<()> {
    print_report(&MachineReport::detect(), args.flags)
}
