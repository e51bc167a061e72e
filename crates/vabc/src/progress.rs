//! Progress bars for long work, shown only when stderr is a terminal so
//! scripts and CI logs stay clean.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A byte-count progress bar with throughput and ETA, or a hidden one.
pub fn bytes(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    let style = ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    pb.set_style(style);
    pb.set_message(what.to_string());
    pb
}

/// A counting progress bar (ops, blocks), or a hidden one.
pub fn count(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    let style = ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} eta {eta}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    pb.set_style(style);
    pb.set_message(what.to_string());
    pb
}
