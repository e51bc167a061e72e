//! `vabc`: the command-line front end. Each subcommand lives in `cmd/`.

use clap::{Parser, Subcommand};

mod cmd;
mod output;
mod progress;

#[derive(Parser)]
#[command(
    name = "vabc",
    version,
    about = "Android Virtual A/B Compression: create, serve, merge and verify COW updates"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a COW file's header, op counts, labels and (optionally) its ops.
    Inspect(cmd::inspect::Args),
    /// Write the snapshot view (base + COW) to a new image file.
    Apply(cmd::apply::Args),
    /// Merge a COW into its base image in place (crash-safe, resumable).
    Merge(cmd::merge::Args),
    /// Make the COW update that turns OLD into NEW (COPY, XOR, ZERO, REPLACE).
    Diff(cmd::diff::Args),
    /// Build and check dm-verity hash trees (veritysetup compatible).
    Verity(cmd::verity::Args),
    /// Add and inspect unsigned AVB hashtree footers (avbtool layout, no FEC).
    Avb(cmd::avb::Args),
    /// Serve the new image (base + COW) through FUSE, a read-only mount, or NBD.
    Serve(cmd::serve::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Apply(a) => cmd::apply::run(a),
        Command::Merge(a) => cmd::merge::run(a),
        Command::Diff(a) => cmd::diff::run(a),
        Command::Verity(a) => cmd::verity::run(a),
        Command::Avb(a) => cmd::avb::run(a),
        Command::Serve(a) => cmd::serve::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vabc: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
