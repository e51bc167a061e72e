//! What the README and the docs show, run: an example that drifts from the program
//! fails here.
//!
//! * Every fenced block of [`FILES`] says what it is. ` ```console ` blocks are run,
//!   in order, one sandbox per file (a temporary folder holding the tiny corpus pair
//!   as `old.img` and `new.img`, the built `vabc` first on `PATH`): each `$ ` line
//!   is a command (a trailing `\` continues it), the lines after it its output,
//!   stdout and stderr together, matched with snapbox's patterns (`[..]` within a
//!   line, `...` for any lines); a command must exit 0 unless a `? N` line names its
//!   status. ` ```synopsis ` blocks are command references: every subcommand and
//!   flag they name must exist. ` ```json `/` ```text ` blocks are data, and the one
//!   ` ```sh ` block is the README's two set-up commands (this suite is one of them).
//! * Every inline `vabc ...` span of those files is checked like a synopsis line.
//!
//! Why not trycmd, which runs ` ```console ` blocks too: these examples need a
//! shell (a daemon started with `&` and stopped with `kill %1`, `&&`, redirections)
//! and fixtures made at test time (35 MB images, not files in the repository);
//! trycmd runs each line as one process in a fixed folder. Its matcher, snapbox,
//! is used as is.
//!
//! The quickstart mounts a file system (FUSE and loop): run as root, as the other
//! mount tests.

mod serve_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use pulldown_cmark::{CodeBlockKind, Event, Parser, Tag, TagEnd};
use serve_common::{corpus_image, vabc};

/// The files whose examples are tested.
const FILES: &[&str] = &["README.md", "docs/commands.md", "docs/cli.md"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A fenced block or an inline span of a Markdown file, with its line.
#[derive(Debug)]
enum Piece {
    Block {
        info: String,
        text: String,
        line: usize,
    },
    Inline {
        text: String,
        line: usize,
    },
}

fn pieces(text: &str) -> Vec<Piece> {
    let line_of = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut out = Vec::new();
    let mut open: Option<(String, usize, String)> = None;
    for (event, range) in Parser::new(text).into_offset_iter() {
        match event {
            Event::Start(Tag::CodeBlock(kind)) => {
                let info = match kind {
                    CodeBlockKind::Fenced(i) => i.to_string(),
                    CodeBlockKind::Indented => "indented".into(),
                };
                open = Some((info, line_of(range.start), String::new()));
            }
            Event::Text(t) => {
                if let Some((_, _, body)) = &mut open {
                    body.push_str(&t);
                }
            }
            Event::End(TagEnd::CodeBlock) => {
                if let Some((info, line, text)) = open.take() {
                    out.push(Piece::Block { info, text, line });
                }
            }
            Event::Code(c) if c.starts_with("vabc ") => out.push(Piece::Inline {
                text: c.to_string(),
                line: line_of(range.start),
            }),
            _ => {}
        }
    }
    out
}

/// One `$ ` command of a console block and what it must print.
#[derive(Debug)]
struct Step {
    line: usize,
    command: String,
    expected: String,
    status: i32,
}

fn steps(text: &str, first_line: usize) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    let mut continuing = false;
    for (i, l) in text.lines().enumerate() {
        if continuing && let Some(s) = out.last_mut() {
            s.command.push('\n');
            s.command.push_str(l);
            continuing = l.ends_with('\\');
            continue;
        }
        if let Some(cmd) = l.strip_prefix("$ ") {
            continuing = cmd.ends_with('\\');
            out.push(Step {
                line: first_line + 1 + i,
                command: cmd.to_string(),
                expected: String::new(),
                status: 0,
            });
        } else if let Some(s) = out.last_mut() {
            match l.strip_prefix("? ").and_then(|n| n.trim().parse().ok()) {
                Some(n) => s.status = n,
                None => {
                    s.expected.push_str(l);
                    s.expected.push('\n');
                }
            }
        }
    }
    out
}

/// Runs a console block's steps in `dir`, one shell for the block (a job started in
/// one step can be stopped in a later one); the first step whose output or status is
/// not the one shown is the error.
fn run_console(file: &str, steps: &[Step], dir: &Path) -> Result<(), String> {
    let mut script = String::from("set +e\n");
    for (n, s) in steps.iter().enumerate() {
        script.push_str(&format!(
            "printf '\\n@@step {n}@@\\n'\n{{ :; {}\n}} 2>&1\nprintf '\\n@@status %d@@\\n' $?\n",
            s.command
        ));
    }
    // Whatever a broken example left running goes with the shell.
    script.push_str("kill $(jobs -p) 2>/dev/null; wait\n");
    let bin = Path::new(vabc()).parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = Command::new("timeout")
        .args(["300", "bash", "-c", &script])
        .current_dir(dir)
        .env("PATH", path)
        // Progress lines come every 10 s by default: how many a step prints depends on
        // the machine's speed.
        .env("VABC_PROGRESS_INTERVAL", "100000")
        .output()
        .map_err(|e| format!("run bash: {e}"))?;
    let out = String::from_utf8_lossy(&o.stdout);
    for (n, s) in steps.iter().enumerate() {
        let start = format!("\n@@step {n}@@\n");
        let Some(at) = out.find(&start) else {
            return Err(format!(
                "{file}:{}: `{}` never ran (the block's shell ended: {})",
                s.line,
                s.command,
                String::from_utf8_lossy(&o.stderr)
            ));
        };
        let rest = &out[at + start.len()..];
        let end = rest.find("\n@@status ").ok_or_else(|| {
            format!(
                "{file}:{}: `{}` did not finish (timed out?)",
                s.line, s.command
            )
        })?;
        let printed = &rest[..end];
        let status: i32 = rest[end + 10..]
            .split("@@")
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1);
        if status != s.status {
            return Err(format!(
                "{file}:{}: `{}` exited {status}, the example shows {}; it printed:\n{printed}",
                s.line, s.command, s.status
            ));
        }
        let actual = printed.strip_suffix('\n').unwrap_or(printed);
        let expected = s.expected.strip_suffix('\n').unwrap_or(&s.expected);
        snapbox::Assert::new()
            .try_eq(
                Some(&format!("{file}:{} `{}`", s.line, s.command)),
                snapbox::Data::text(actual),
                snapbox::Data::text(expected),
            )
            .map_err(|e| format!("{file}:{}: `{}` printed otherwise:\n{e}", s.line, s.command))?;
    }
    Ok(())
}

/// `vabc`'s commands: each subcommand path (`["bundle", "create"]`) and its help text.
struct Cli {
    help: BTreeMap<Vec<String>, String>,
}

impl Cli {
    fn load() -> Cli {
        let mut help = BTreeMap::new();
        let mut todo = vec![Vec::<String>::new()];
        while let Some(path) = todo.pop() {
            let o = Command::new(vabc())
                .args(&path)
                .arg("--help")
                .output()
                .unwrap();
            assert!(o.status.success(), "vabc {path:?} --help");
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            // clap lists subcommands under "Commands:", two spaces in.
            let mut in_commands = false;
            for l in text.lines() {
                if l == "Commands:" {
                    in_commands = true;
                    continue;
                }
                if in_commands {
                    let Some(name) = l
                        .strip_prefix("  ")
                        .and_then(|r| r.split_whitespace().next())
                    else {
                        in_commands = false;
                        continue;
                    };
                    if name != "help" && !l.starts_with("   ") {
                        let mut p = path.clone();
                        p.push(name.to_string());
                        todo.push(p);
                    }
                }
            }
            help.insert(path, text);
        }
        Cli { help }
    }

    /// Checks a command line as a reference shows it (`vabc bundle info|verify
    /// UPDATE.vabc [--key PUB.pem] [--json]`): its subcommands exist, and so does
    /// every flag it names.
    fn check(&self, line: &str) -> Result<(), String> {
        // A pipe into another program ends the vabc command (`vabc inspect --ops |
        // head`); within brackets it separates alternatives.
        let mut words: Vec<&str> = Vec::new();
        let mut depth = 0i32;
        for w in line.split_whitespace() {
            // After `--` comes another program's command line (`trace record -- CMD`).
            if (w == "|" && depth == 0) || w == "--" || w == "[--" {
                break;
            }
            depth += w.matches(['[', '(']).count() as i32 - w.matches([']', ')']).count() as i32;
            words.push(w);
        }
        let mut paths: Vec<Vec<String>> = vec![Vec::new()];
        let mut rest = words.iter().skip(1).peekable();
        while let Some(w) = rest.peek() {
            let next: Vec<Vec<String>> = paths
                .iter()
                .flat_map(|p| {
                    w.split('|').map(move |alt| {
                        let mut q = p.clone();
                        q.push(alt.to_string());
                        q
                    })
                })
                .collect();
            if next.iter().all(|p| self.help.contains_key(p)) {
                paths = next;
                rest.next();
            } else {
                break;
            }
        }
        let flags: Vec<String> = rest
            .flat_map(|w| w.split('|'))
            .filter_map(flag_of)
            .collect();
        for p in &paths {
            for f in &flags {
                let known = |path: &Vec<String>| option_names(&self.help[path]).any(|n| n == *f);
                // Global flags (-q, --no-progress) are vabc's own.
                if !known(p) && !known(&Vec::new()) {
                    return Err(format!("`vabc {}` has no {f}", p.join(" ")));
                }
            }
        }
        Ok(())
    }
}

/// The flag a reference's word names (`[--key`, `--level=N`, `-o,`), if it names one.
fn flag_of(w: &str) -> Option<String> {
    let w = w.trim_matches(|c| matches!(c, '[' | ']' | '(' | ')' | ',' | '`'));
    let name = w.split('=').next()?;
    let ok = match name.strip_prefix("--") {
        Some(long) => {
            !long.is_empty() && long.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        }
        None => name
            .strip_prefix('-')
            .is_some_and(|s| s.len() == 1 && s.chars().all(|c| c.is_ascii_alphabetic())),
    };
    ok.then(|| name.to_string())
}

/// The option names clap's help lists (`-o, --output <OUTPUT>` gives `-o`, `--output`).
fn option_names(help: &str) -> impl Iterator<Item = &str> {
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .flat_map(|l| {
            l.split([' ', ','])
                .filter(|t| !t.is_empty())
                .take_while(|t| t.starts_with('-'))
                .map(|t| t.split('[').next().unwrap_or(t))
        })
}

fn sandbox() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for side in ["old", "new"] {
        std::fs::copy(
            corpus_image("tiny", side, "ext4"),
            dir.path().join(format!("{side}.img")),
        )
        .unwrap();
    }
    dir
}

/// Checks every example of `file` (relative to the project), running its console
/// blocks in `dir`.
fn check_file(cli: &Cli, file: &str, dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(file)).unwrap();
    let mut errors = Vec::new();
    for piece in pieces(&text) {
        match piece {
            Piece::Block { info, text, line } => match info.as_str() {
                "console" => {
                    if let Err(e) = run_console(file, &steps(&text, line), dir) {
                        errors.push(e);
                    }
                }
                "synopsis" => {
                    let mut lines: Vec<(usize, String)> = Vec::new();
                    for (i, l) in text.lines().enumerate() {
                        match lines.last_mut() {
                            Some((_, cur)) if l.starts_with(' ') => {
                                cur.push(' ');
                                cur.push_str(l.trim());
                            }
                            _ => lines.push((line + 1 + i, l.to_string())),
                        }
                    }
                    for (n, l) in lines {
                        if let Err(e) = cli.check(&l) {
                            errors.push(format!("{file}:{n}: {e}"));
                        }
                    }
                }
                // A measurement's command and what it printed on one machine: the
                // command is checked, the numbers are the machine's.
                "console recorded" => {
                    for s in steps(&text, line) {
                        if let Err(e) = cli.check(&s.command) {
                            errors.push(format!("{file}:{}: {e}", s.line));
                        }
                    }
                }
                "json" | "text" => {}
                // The project's own scripts (the set-up commands, the VM tier): each
                // exists and is executable; test.sh runs them, not this test.
                "sh" => {
                    for (i, l) in text.lines().enumerate() {
                        let Some(script) = l.split_whitespace().next() else {
                            continue;
                        };
                        let path = root().join(script);
                        let exec = std::fs::metadata(&path).is_ok_and(|m| {
                            std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
                        });
                        if !exec {
                            errors.push(format!(
                                "{file}:{}: {script}: no such executable script in the project",
                                line + 1 + i
                            ));
                        }
                    }
                }
                other => errors.push(format!(
                    "{file}:{line}: a ```{other} block: say what it is (console, console recorded, \
                     synopsis, sh, json, text), so that it is tested or known not to be a command"
                )),
            },
            Piece::Inline { text, line } => {
                if let Err(e) = cli.check(&text) {
                    errors.push(format!("{file}:{line}: `{text}`: {e}"));
                }
            }
        }
    }
    errors
}

#[test]
fn every_documented_command_runs_as_shown() {
    let cli = Cli::load();
    let mut errors = Vec::new();
    for file in FILES {
        let dir = sandbox();
        errors.extend(check_file(&cli, file, dir.path()));
    }
    assert!(
        errors.is_empty(),
        "{} example(s) drifted:\n\n{}",
        errors.len(),
        errors.join("\n\n")
    );
}

#[test]
fn the_checker_finds_a_broken_example() {
    let cli = Cli::load();
    assert!(
        cli.check("vabc bundle info|verify UPDATE.vabc [--key PUB.pem] [--json]")
            .is_ok()
    );
    assert!(cli.check("vabc diff OLD NEW -o U.cow [--no-xor]").is_ok());
    let e = cli
        .check("vabc bundle info UPDATE.vabc --no-such-flag")
        .unwrap_err();
    assert!(e.contains("--no-such-flag"), "{e}");
    assert!(cli.check("vabc merge --base B --cow C -z").is_err());
    let dir = tempfile::tempdir().unwrap();
    let ok = "$ echo one && echo two\none\ntwo\n$ vabc --version\nvabc [..]\n$ false\n? 1\n";
    run_console("t.md", &steps(ok, 1), dir.path()).unwrap();
    // Output, status, or a job left running: each is caught, naming the line.
    let wrong = "$ echo one\none\n$ vabc --version\nvabc 0.0.0-not-this\n";
    let e = run_console("t.md", &steps(wrong, 10), dir.path()).unwrap_err();
    assert!(
        e.starts_with("t.md:13:") && e.contains("printed otherwise"),
        "{e}"
    );
    let e = run_console("t.md", &steps("$ vabc diff\n...\n", 20), dir.path()).unwrap_err();
    assert!(e.starts_with("t.md:21:") && e.contains("exited 2"), "{e}");
    // An unclassified block is an error too.
    let errors = check_file(
        &cli,
        "crates/vabc/tests/docs_examples/broken.md",
        dir.path(),
    );
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert!(errors[0].contains("```bash block"), "{errors:#?}");
    assert!(errors[1].contains("has no --colour"), "{errors:#?}");
}
