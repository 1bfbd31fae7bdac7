//! A calibration's events on the terminal: a progress bar per pass, the
//! line that tells a cluster's operator which run to start workers for, and
//! the library's messages on stderr (only warnings with `--json`).

use indicatif::{ProgressBar, ProgressStyle};
use qforge_runner::{Listener, PassEvent, PassPosition};

pub struct Terminal {
    bar: ProgressBar,
    quiet: bool,
}

impl Terminal {
    /// `quiet`: no progress, no messages but warnings.
    pub fn new(quiet: bool) -> Self {
        Self {
            bar: ProgressBar::hidden(),
            quiet,
        }
    }
}

impl Listener for Terminal {
    fn message(&mut self, line: &str) {
        if !self.quiet || line.starts_with("warning:") {
            self.bar.suspend(|| eprintln!("{line}"));
        }
    }

    fn pass_event(&mut self, pass: PassPosition, event: &PassEvent) {
        match event {
            PassEvent::Opened { run, batches } => {
                if self.quiet {
                    return;
                }
                if let (Some(run), 1) = (run, pass.index) {
                    eprintln!(
                        "run {run} is open: start workers with `qforge worker --cluster URL --run {run}`"
                    );
                }
                self.bar = ProgressBar::new(*batches as u64);
                self.bar.set_style(
                    ProgressStyle::with_template(
                        "{prefix} {bar:40} {pos}/{len} batches  {per_sec}  ETA {eta}  {msg}",
                    )
                    .expect("valid template"),
                );
                if pass.count > 1 {
                    self.bar
                        .set_prefix(format!("pass {}/{}", pass.index, pass.count));
                }
            }
            PassEvent::Progress(p) => {
                self.bar.set_position(p.merged as u64);
                self.bar
                    .set_message(format!("{} workers, {} retries", p.workers, p.retries));
                if p.merged == p.planned {
                    self.bar.finish_and_clear();
                }
            }
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}
