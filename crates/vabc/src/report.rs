//! Every `--json` report: the schema version (docs/cli.md) first, then the command's
//! own fields, from a typed struct; docs/schemas/ holds each command's JSON schema,
//! which `tests/json_schemas.rs` checks real reports against.

use std::io::Write as _;

use anyhow::Context as _;
use serde::Serialize;

/// A report as printed: `schema_version` and the body's fields.
#[derive(Serialize, schemars::JsonSchema)]
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

/// Every report's JSON schema, by the name of its file in docs/schemas/ (the
/// command's words joined by `-`).
#[cfg(test)]
pub fn schemas() -> Vec<(&'static str, serde_json::Value)> {
    use crate::cmd::*;
    use schemars::schema_for;
    let all = vec![
        ("apply", schema_for!(Report<apply::ApplyReport<'static>>)),
        (
            "avb-add-hashtree-footer",
            schema_for!(Report<avb::AvbInfoReport<'static>>),
        ),
        ("avb-info", schema_for!(Report<avb::AvbInfoReport<'static>>)),
        (
            "bundle-apply",
            schema_for!(Report<bundle::ApplyReport<'static>>),
        ),
        ("bundle-create", schema_for!(Report<bundle::CreateReport>)),
        (
            "bundle-info",
            schema_for!(Report<bundle::InfoReport<'static>>),
        ),
        (
            "bundle-install",
            schema_for!(Report<bundle::InstallReport<'static>>),
        ),
        (
            "bundle-plan",
            schema_for!(Report<bundle::PlanReport<'static>>),
        ),
        (
            "bundle-verify",
            schema_for!(Report<bundle::VerifyReport<'static>>),
        ),
        (
            "cleanup",
            schema_for!(Report<cleanup::CleanupReport<'static>>),
        ),
        ("diff", schema_for!(Report<diff::Report>)),
        ("inspect", schema_for!(Report<inspect::Summary<'static>>)),
        (
            "manifest",
            schema_for!(Report<manifest::ManifestReport<'static>>),
        ),
        ("merge", schema_for!(Report<merge::MergeReport<'static>>)),
        (
            "payload-cow",
            schema_for!(Report<payload::CowReport<'static>>),
        ),
        (
            "payload-extract",
            schema_for!(Report<payload::ExtractReport<'static>>),
        ),
        ("payload-info", schema_for!(Report<::payload::info::Info>)),
        (
            "payload-verify",
            schema_for!(Report<payload::VerifyReport<'static>>),
        ),
        ("serve-ready", schema_for!(Report<ota::serving::Ready>)),
        ("trace-record", schema_for!(Report<trace::TraceReport>)),
        ("trace-report", schema_for!(Report<trace::TraceReport>)),
        (
            "trace-replay",
            schema_for!(Report<trace::ReplayReport<'static>>),
        ),
        (
            "update-boot",
            schema_for!(Report<update::BootReport<'static>>),
        ),
        (
            "update-init",
            schema_for!(Report<update::StoreReport<'static>>),
        ),
        (
            "update-install",
            schema_for!(Report<update::InstallReport<'static>>),
        ),
        (
            "update-mark-good",
            schema_for!(Report<update::StoreReport<'static>>),
        ),
        (
            "update-rollback",
            schema_for!(Report<update::RollbackReport<'static>>),
        ),
        (
            "update-status",
            schema_for!(Report<update::StatusReport<'static>>),
        ),
        (
            "verity-format",
            schema_for!(Report<verity::VerityFormatReport>),
        ),
        (
            "verity-verify",
            schema_for!(Report<verity::VerityVerifyReport>),
        ),
    ];
    all.into_iter()
        .map(|(name, schema)| {
            let command = match name {
                "serve-ready" => "vabc serve --ready-file FILE".to_string(),
                _ => format!("vabc {} --json", name.replacen('-', " ", 1)),
            };
            let mut schema = schema.to_value();
            schema["title"] = command.into();
            close_objects(&mut schema);
            (name, schema)
        })
        .collect()
}

/// Every object with named properties admits no others: a field added to a report
/// without its schema fails validation instead of passing unseen.
#[cfg(test)]
fn close_objects(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(o) => {
            if o.contains_key("properties") && !o.contains_key("additionalProperties") {
                o.insert("additionalProperties".into(), false.into());
            }
            o.values_mut().for_each(close_objects);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// docs/schemas/ holds exactly the schemas the report types make, so that the
    /// documented schema is the one a test validates real reports against
    /// (`tests/cli_contract.rs`, `tests/update_cli.rs`). `VABC_BLESS=1` rewrites them.
    #[test]
    fn the_documented_schemas_are_the_reports() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/schemas");
        let bless = std::env::var_os("VABC_BLESS").is_some();
        let mut stale = Vec::new();
        let mut names = Vec::new();
        for (name, schema) in super::schemas() {
            let path = dir.join(format!("{name}.json"));
            let want = serde_json::to_string_pretty(&schema).unwrap() + "\n";
            names.push(format!("{name}.json"));
            if std::fs::read_to_string(&path).ok().as_deref() != Some(want.as_str()) {
                if bless {
                    std::fs::create_dir_all(&dir).unwrap();
                    std::fs::write(&path, want).unwrap();
                } else {
                    stale.push(name);
                }
            }
        }
        assert!(
            stale.is_empty(),
            "docs/schemas/ differs from the report types for {stale:?}: run \
             VABC_BLESS=1 cargo test -p vabc the_documented_schemas and review the diff"
        );
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".json"))
            .collect();
        files.sort();
        names.sort();
        assert_eq!(
            files, names,
            "a schema file without a report, or the reverse"
        );
    }
}
