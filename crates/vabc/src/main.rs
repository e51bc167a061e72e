//! `vabc`: the command-line front end. Each subcommand lives in `cmd/`.

use clap::{CommandFactory, Parser, Subcommand};

/// The version of every `--json` report and of `serve --ready-file` (docs/cli.md):
/// raised when a key changes meaning or goes away, not when one is added.
pub(crate) const SCHEMA_VERSION: u32 = 1;

mod args;
mod checks;
mod cmd;
mod progress;
mod report;

#[derive(Parser)]
#[command(
    name = "vabc",
    version,
    about = "Android Virtual A/B Compression: create, serve, merge and verify COW updates"
)]
struct Cli {
    /// No progress bars or progress lines on stderr (errors are still printed).
    #[arg(long, global = true)]
    no_progress: bool,
    /// Quiet: no progress, and of the messages only errors.
    #[arg(short, long, global = true)]
    quiet: bool,
    /// More messages (-v: debug, -vv: trace). VABC_LOG (env_logger's syntax, e.g.
    /// `serve=debug`) overrides both.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
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
    /// Serve the new image (base + COW) through FUSE, a read-only mount, NBD or ublk.
    Serve(Box<cmd::serve::Args>),
    /// Write the manifest (which base, which result) of a COW made by another tool.
    Manifest(cmd::manifest::Args),
    /// The update as one signed file: create, info, verify, install (into device
    /// COWs), apply (into new images).
    Bundle(cmd::bundle::Args),
    /// The device side: install an update into a store, boot it from base + COW,
    /// mark it good (merge) or roll it back.
    Update(cmd::update::Args),
    /// Android's own OTA payloads (payload.bin, an OTA zip, a URL): info, verify,
    /// extract partition images (full and incremental).
    Payload(cmd::payload::Args),
    /// Block-layer tracing: record the kernel's block events (blktrace's), report
    /// btt's breakdown of where each request's time went.
    Trace(cmd::trace::Args),
    /// Write the manual pages (vabc.1, vabc-diff.1, ...) into a folder.
    Man(cmd::docs::ManArgs),
    /// Print the completion script for a shell (bash, zsh, fish, elvish, powershell).
    Completions(cmd::docs::CompletionArgs),
    /// Remove what killed vabc processes left behind (mounts, loop and ublk devices, temporary files).
    Cleanup(cmd::cleanup::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::try_parse().unwrap_or_else(|e| with_tips(e).exit());
    progress::init(cli.no_progress || cli.quiet);
    init_logging(cli.quiet, cli.verbose);
    let serving = match &cli.command {
        Command::Serve(_) => true,
        Command::Update(a) => a.is_daemon(),
        _ => false,
    };
    if !serving {
        // A reader that goes away (`vabc inspect --ops --json | head -1`) ends us as it
        // ends any Unix tool: by SIGPIPE (exit 141), not by a panic in println!. The
        // server keeps Rust's default (ignored), since a client hanging up must only
        // fail that write.
        // SAFETY: restoring a signal's default disposition installs no handler code.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    // Commands that write files: a signal removes their temporary files (serve handles
    // its own signals, tearing down what it set up).
    let note = match &cli.command {
        _ if serving => None,
        Command::Merge(_) => Some("the merge is crash-safe: run the same command to resume"),
        Command::Update(_) => Some("the update's state is crash-safe: see `vabc update status`"),
        // A recording ends on Ctrl-C and writes what it has.
        Command::Trace(_) => None,
        _ => Some("no output was written"),
    };
    if let Some(note) = note
        && let Err(e) = ota::output::on_signal_remove_temps(note)
    {
        eprintln!("vabc: error: {}", ota::error::chain(&e));
        return std::process::ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Apply(a) => cmd::apply::run(a),
        Command::Merge(a) => cmd::merge::run(a),
        Command::Diff(a) => cmd::diff::run(a),
        Command::Verity(a) => cmd::verity::run(a),
        Command::Avb(a) => cmd::avb::run(a),
        Command::Serve(a) => cmd::serve::run(*a),
        Command::Cleanup(a) => cmd::cleanup::run(a),
        Command::Manifest(a) => cmd::manifest::run(a),
        Command::Bundle(a) => cmd::bundle::run(a),
        Command::Update(a) => cmd::update::run(a),
        Command::Payload(a) => cmd::payload::run(a),
        Command::Trace(a) => cmd::trace::run(a),
        Command::Man(a) => cmd::docs::man(a, Cli::command()),
        Command::Completions(a) => cmd::docs::completions(a, Cli::command()),
    };
    // Whatever temporary file an error left registered (most are gone already) and
    // the record `vabc cleanup` would have read.
    ota::output::remove_pending();
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vabc: error: {}", error_chain(&e));
            if e.chain().any(|c| {
                c.downcast_ref::<ota::Error>()
                    .is_some_and(ota::Error::is_half_merged)
            }) {
                std::process::ExitCode::from(cmd::update::EXIT_HALF_MERGED)
            } else if e.chain().any(|c| {
                c.downcast_ref::<ota::Error>()
                    .is_some_and(ota::Error::is_mismatch)
            }) {
                std::process::ExitCode::from(checks::EXIT_MISMATCH)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}

/// clap's usage error, with the next step where clap's own message stops short.
fn with_tips(mut e: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let missing = |arg: &str| {
        e.kind() == ErrorKind::MissingRequiredArgument
            && matches!(e.get(ContextKind::InvalidArg), Some(ContextValue::Strings(v))
                if v.iter().any(|a| a.starts_with(arg)))
    };
    let tip = if missing("--key <KEY.pem>") {
        Some(
            "sign with --key KEY.pem (an Ed25519 private key: openssl genpkey -algorithm ed25519), or make an unsigned bundle with --unsigned",
        )
    } else if missing("--key <PUB.pem>") {
        Some(
            "check the signature with --key PUB.pem (openssl pkey -in KEY.pem -pubout), or accept a bundle without checking it with --allow-unsigned",
        )
    } else if missing("--key <PUBKEY.pem>") {
        Some(
            "give the public key the payload was signed with, --key PUBKEY.pem (e.g. update_engine's update-payload-key.pub.pem; openssl rsa -in KEY.pem -pubout); `payload extract --no-verify` skips the signature checks",
        )
    } else {
        None
    };
    if let Some(tip) = tip {
        e.insert(
            ContextKind::Suggested,
            ContextValue::StyledStrs(vec![tip.into()]),
        );
    }
    e
}

/// Messages of every crate through `log`: the text alone on stderr, as the commands
/// always printed it; `-q` keeps errors, `-v`/`-vv` add debug/trace, `VABC_LOG` (the
/// `RUST_LOG` syntax of env_logger) overrides.
fn init_logging(quiet: bool, verbose: u8) {
    use std::io::Write;
    let level = match (quiet, verbose) {
        (true, _) => log::LevelFilter::Error,
        (false, 0) => log::LevelFilter::Info,
        (false, 1) => log::LevelFilter::Debug,
        _ => log::LevelFilter::Trace,
    };
    env_logger::Builder::new()
        .filter_level(level)
        .parse_env(env_logger::Env::new().filter("VABC_LOG"))
        .format(|buf, record| writeln!(buf, "{}", record.args()))
        .init();
}

/// The error and its causes joined by ": ", as `{:#}` would, except that a cause whose
/// text already ends the message is not repeated: the libraries' errors include their
/// I/O cause in their own text (so that they read well alone) and also return it as
/// their source.
pub(crate) fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    /// Shaped like the libraries' I/O errors: the cause in the text and as source.
    #[derive(Debug)]
    struct Open {
        path: String,
        source: std::io::Error,
    }

    impl std::fmt::Display for Open {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "open {}: {}", self.path, self.source)
        }
    }

    impl std::error::Error for Open {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.source)
        }
    }

    #[test]
    fn causes_already_in_the_message_are_not_repeated() {
        let io = std::io::Error::from_raw_os_error(2);
        let text = io.to_string();
        let e = anyhow::Error::new(Open {
            path: "/x".into(),
            source: io,
        })
        .context("cannot serve /x");
        assert_eq!(error_chain(&e), format!("cannot serve /x: open /x: {text}"));
        // Causes that add something are kept.
        let e = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_chain(&e), "outer: inner");
    }
}
