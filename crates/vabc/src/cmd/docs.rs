//! `vabc man DIR` and `vabc completions SHELL`: the manual pages and shell completions,
//! generated from the command-line definition itself (clap_mangen, clap_complete), so
//! they can never disagree with the flags a build accepts.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};

#[derive(clap::Args)]
pub struct ManArgs {
    /// Folder for vabc.1 and one page per command (vabc-diff.1, vabc-verity-format.1, ...).
    dir: PathBuf,
}

#[derive(clap::Args)]
pub struct CompletionArgs {
    /// The shell.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

/// A SYNOPSIS line: `spoken` and every option of `cmd` with its value name, optional
/// ones in brackets, repeatable ones followed by `...`; the global options
/// (`-q`, `--no-progress`, ...) only on vabc's own page.
fn synopsis(cmd: &clap::Command, spoken: &str) -> String {
    use clap::ArgAction;
    let mut parts = vec![spoken.to_string()];
    let top = !spoken.contains(' ');
    for a in cmd.get_arguments() {
        let id = a.get_id().as_str();
        if a.is_hide_set() || id == "help" || id == "version" || (a.is_global_set() && !top) {
            continue;
        }
        let value = a
            .get_value_names()
            .map(|v| {
                v.iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_else(|| id.to_uppercase());
        let takes_value = !matches!(
            a.get_action(),
            ArgAction::SetTrue | ArgAction::SetFalse | ArgAction::Count | ArgAction::Help
        );
        let flag = match (a.get_short(), a.get_long()) {
            (Some(s), Some(l)) => Some(format!("-{s}|--{l}")),
            (Some(s), None) => Some(format!("-{s}")),
            (None, Some(l)) => Some(format!("--{l}")),
            (None, None) => None,
        };
        let mut one = match (flag, takes_value) {
            (None, _) => format!("<{value}>"),
            (Some(f), true) => format!("{f} <{value}>"),
            (Some(f), false) => f,
        };
        if matches!(a.get_action(), ArgAction::Append | ArgAction::Count) {
            one.push_str("...");
        }
        parts.push(if a.is_required_set() {
            one
        } else {
            format!("[{one}]")
        });
    }
    if cmd.has_subcommands() {
        parts.push("<COMMAND>".into());
    }
    parts.join(" ")
}

/// Writes the page of `cmd` as NAME.1 into `dir`, then those of its subcommands.
fn write_pages(
    cmd: &clap::Command,
    name: &str,
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> Result<()> {
    let cmd = cmd.clone().name(name.to_string());
    let spoken = name.replace('-', " ");
    // The command as it is typed (`vabc bundle create`), each option with its value
    // (clap_mangen's own synopsis names the page and drops the value names).
    let page_cmd = cmd
        .clone()
        .bin_name(spoken.clone())
        .override_usage(synopsis(&cmd, &spoken));
    let mut page = Vec::new();
    clap_mangen::Man::new(page_cmd)
        .render(&mut page)
        .with_context(|| format!("render the page of {name}"))?;
    let path = dir.join(format!("{name}.1"));
    ota::output::write_atomic(&path, &page)?;
    written.push(path);
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_pages(sub, &format!("{name}-{}", sub.get_name()), dir, written)?;
    }
    Ok(())
}

pub fn man(a: ManArgs, cmd: clap::Command) -> Result<ExitCode> {
    std::fs::create_dir_all(&a.dir).with_context(|| format!("create {}", a.dir.display()))?;
    let mut written = Vec::new();
    write_pages(&cmd, "vabc", &a.dir, &mut written)?;
    for p in &written {
        println!("{}", p.display());
    }
    Ok(ExitCode::SUCCESS)
}

pub fn completions(a: CompletionArgs, mut cmd: clap::Command) -> Result<ExitCode> {
    clap_complete::generate(a.shell, &mut cmd, "vabc", &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}
