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

/// Writes the page of `cmd` as NAME.1 into `dir`, then those of its subcommands.
fn write_pages(
    cmd: &clap::Command,
    name: &str,
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> Result<()> {
    let cmd = cmd.clone().name(name.to_string());
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone())
        .render(&mut page)
        .with_context(|| format!("render the page of {name}"))?;
    let path = dir.join(format!("{name}.1"));
    crate::output::write_atomic(&path, &page)?;
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
