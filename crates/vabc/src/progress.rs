//! Progress of long work (docs/cli.md): a bar when stderr is a terminal, otherwise a
//! plain line every few seconds (a CI log or a serial console then shows the command
//! is alive), nothing with `--no-progress` or `-q`.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How progress is shown, decided once from the global flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Bar,
    Lines,
    Off,
}

static MODE: OnceLock<Mode> = OnceLock::new();

/// Sets the mode from `--no-progress` / `-q` and whether stderr is a terminal.
pub fn init(off: bool) {
    let mode = match (off, std::io::stderr().is_terminal()) {
        (true, _) => Mode::Off,
        (false, true) => Mode::Bar,
        (false, false) => Mode::Lines,
    };
    let _ = MODE.set(mode);
}

pub fn mode() -> Mode {
    *MODE.get().unwrap_or(&Mode::Off)
}

/// Seconds between plain progress lines (`VABC_PROGRESS_INTERVAL`, default 10).
fn interval() -> Duration {
    let secs = std::env::var("VABC_PROGRESS_INTERVAL")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .unwrap_or(10.0);
    Duration::from_secs_f64(secs)
}

/// What is counted.
#[derive(Clone, Copy)]
pub enum Unit {
    Bytes,
    Items(&'static str),
}

/// One phase of work of a known size.
pub struct Progress {
    bar: ProgressBar,
    lines: Option<Lines>,
}

struct Lines {
    what: String,
    unit: Unit,
    total: u64,
    start: Instant,
    every: Duration,
    last: Mutex<Instant>,
}

impl Progress {
    pub fn new(total: u64, what: &str, unit: Unit) -> Progress {
        match mode() {
            Mode::Bar => {
                let bar = ProgressBar::new(total);
                let template = match unit {
                    Unit::Bytes => format!(
                        "{what:>14} [{{bar:40}}] {{bytes}}/{{total_bytes}} {{binary_bytes_per_sec}} eta {{eta}}"
                    ),
                    Unit::Items(u) => {
                        format!("{what:>14} [{{bar:40}}] {{pos}}/{{len}} {u} eta {{eta}}")
                    }
                };
                bar.set_style(
                    ProgressStyle::with_template(&template)
                        .unwrap_or_else(|_| ProgressStyle::default_bar())
                        .progress_chars("=> "),
                );
                Progress { bar, lines: None }
            }
            Mode::Lines => Progress {
                bar: ProgressBar::hidden(),
                lines: Some(Lines {
                    what: what.to_string(),
                    unit,
                    total,
                    start: Instant::now(),
                    every: interval(),
                    last: Mutex::new(Instant::now()),
                }),
            },
            Mode::Off => Progress {
                bar: ProgressBar::hidden(),
                lines: None,
            },
        }
    }

    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
        if let Some(l) = &self.lines {
            l.maybe_print(pos);
        }
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
        if let Some(l) = &self.lines {
            l.maybe_print(self.bar.position());
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Lines {
    fn maybe_print(&self, pos: u64) {
        let now = Instant::now();
        let Ok(mut last) = self.last.lock() else {
            return;
        };
        if now.duration_since(*last) < self.every {
            return;
        }
        *last = now;
        let pct = (pos.min(self.total) * 100)
            .checked_div(self.total)
            .unwrap_or(100);
        let done = match self.unit {
            Unit::Bytes => format!(
                "{:.1} of {:.1} MB",
                pos as f64 / 1e6,
                self.total as f64 / 1e6
            ),
            Unit::Items(u) => format!("{pos} of {} {u}", self.total),
        };
        eprintln!(
            "vabc: {}: {pct}% ({done}), {:.0} s",
            self.what,
            now.duration_since(self.start).as_secs_f64()
        );
    }
}

/// Progress of planning, writing and proving, shown as [`init`] decided (a bar, lines
/// or nothing); the library reports to it.
pub(crate) struct Bar {
    bar: std::sync::Mutex<Option<Progress>>,
}

impl Bar {
    pub(crate) fn new() -> Bar {
        Bar {
            bar: std::sync::Mutex::new(None),
        }
    }
}

impl ota::Observer for Bar {
    fn event(&self, e: ota::Event<'_>) {
        let Ok(mut b) = self.bar.lock() else {
            return;
        };
        match e {
            ota::Event::Start { phase, total } => {
                let unit = match phase {
                    "apply" | "verifying the payload" => Unit::Bytes,
                    "merge" => Unit::Items("ops"),
                    _ => Unit::Items("blocks"),
                };
                *b = Some(Progress::new(total, phase, unit));
            }
            ota::Event::Advance(n) => {
                if let Some(pb) = b.as_ref() {
                    pb.inc(n);
                }
            }
            ota::Event::Finish => {
                if let Some(pb) = b.take() {
                    pb.finish();
                }
            }
            _ => {}
        }
    }
}
