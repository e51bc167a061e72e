//! Every `--json` report: the schema version (docs/cli.md) first, then the command's
//! own fields, from a typed struct; docs/schemas/ holds each command's JSON schema,
//! which `tests/json_schemas.rs` checks real reports against.

use std::io::Write as _;

use anyhow::Context as _;
use serde::Serialize;

/// A report as printed: `schema_version` and the body's fields.
#[derive(Serialize)]
pub struct Report<T> {
    schema_version: u32,
    #[serde(flatten)]
    body: T,
}

impl<T> Report<T> {
    pub fn new(body: T) -> Self {
        Report {
            schema_version: crate::SCHEMA_VERSION,
            body,
        }
    }
}

/// Prints `body` as a report, pretty, on stdout.
pub fn print<T: Serialize>(body: T) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(&Report::new(body))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}").context("write to stdout")
}
