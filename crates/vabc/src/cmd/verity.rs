//! `vabc verity format|verify`: dm-verity hash trees, compatible with
//! `veritysetup format|verify` (same options, same output layout, same bytes).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use verity::Params;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Build the hash tree of DATA into HASHFILE and print the root hash (like `veritysetup format`).
    Format(FormatArgs),
    /// Check every block of DATA against HASHFILE and ROOT_HASH (like `veritysetup verify`).
    Verify(VerifyArgs),
}

/// Tree parameters shared by format, verify and `serve --verity-hash`
/// (veritysetup's option names).
#[derive(clap::Args, Debug)]
pub struct TreeOpts {
    /// Hash algorithm: sha256 (default), sha1 or sha512.
    #[arg(long = "hash", value_name = "ALG")]
    hash: Option<String>,
    /// Salt as hex, or "-" for none. Default for format: 32 random bytes.
    #[arg(long, value_name = "HEX|-")]
    salt: Option<String>,
    /// Data block size in bytes, a power of two from 512 to 65536 (default 4096).
    #[arg(long, value_name = "N")]
    data_block_size: Option<u32>,
    /// Hash block size in bytes, a power of two from 512 to 65536 (default 4096).
    #[arg(long, value_name = "N")]
    hash_block_size: Option<u32>,
    /// Number of data blocks to protect (default: every whole block of DATA;
    /// a partial last block is left unprotected, as veritysetup does).
    #[arg(long, value_name = "N")]
    data_blocks: Option<u64>,
    /// No superblock: the tree starts at the hash offset and every parameter
    /// must be given on the command line.
    #[arg(long)]
    no_superblock: bool,
    /// Byte offset of the superblock (or tree) in HASHFILE; a multiple of 512.
    #[arg(long, value_name = "N", default_value_t = 0)]
    hash_offset: u64,
    /// Hash format: 1 (default) or 0 (original Chrome OS format).
    #[arg(long = "format", value_name = "0|1")]
    format: Option<u32>,
}

#[derive(clap::Args)]
struct FormatArgs {
    /// Data device or image file to protect.
    data: PathBuf,
    /// Where to write the superblock and tree. Written to a temporary file and
    /// renamed into place; with --hash-offset, bytes of an existing HASHFILE
    /// outside the written range are kept.
    hashfile: PathBuf,
    #[command(flatten)]
    opts: TreeOpts,
    /// UUID for the superblock (default: random).
    #[arg(long)]
    uuid: Option<String>,
    /// Print a JSON object instead of veritysetup's text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct VerifyArgs {
    data: PathBuf,
    hashfile: PathBuf,
    /// Expected root hash, hex.
    root_hash: String,
    #[command(flatten)]
    opts: TreeOpts,
    /// Print a JSON report on stdout (`verified`, and `error` when it is false).
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    match args.command {
        Sub::Format(a) => format(a),
        Sub::Verify(a) => verify(a),
    }
}

impl From<&TreeOpts> for ota::trees::TreeOptions {
    fn from(o: &TreeOpts) -> Self {
        ota::trees::TreeOptions {
            hash: o.hash.clone(),
            salt: o.salt.clone(),
            data_block_size: o.data_block_size,
            hash_block_size: o.hash_block_size,
            data_blocks: o.data_blocks,
            no_superblock: o.no_superblock,
            hash_offset: o.hash_offset,
            format: o.format,
        }
    }
}

fn format(a: FormatArgs) -> Result<ExitCode> {
    let o = ota::trees::TreeOptions::from(&a.opts);
    let done = ota::trees::format(&a.data, &a.hashfile, &o, a.uuid.as_deref())?;
    let (params, root) = (&done.tree.params, &done.tree.root);
    let salt_text = if params.salt.is_empty() {
        "-".to_string()
    } else {
        hex::encode(&params.salt)
    };
    let uuid_text = match done.superblock {
        true => verity::format_uuid(&done.tree.uuid),
        false => String::new(),
    };
    if a.json {
        return crate::report::print(VerityFormatReport {
            tree: TreeReport::new(
                a.hashfile.clone(),
                uuid_text,
                params,
                root,
                done.tree.hash_blocks,
            ),
            hash_type: params.format.as_u32(),
            superblock: done.superblock,
            hash_offset: o.hash_offset,
            tree_offset: done.tree_offset,
            hash_device_size: done.end,
        })
        .map(|()| ExitCode::SUCCESS);
    }
    // Same labels, tabs and spacing as veritysetup 2.6.
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "VERITY header information for {}",
        a.hashfile.display()
    )?;
    writeln!(out, "UUID:            \t{uuid_text}")?;
    writeln!(out, "Hash type:       \t{}", params.format.as_u32())?;
    writeln!(out, "Data blocks:     \t{}", params.data_blocks)?;
    writeln!(out, "Data block size: \t{}", params.data_block_size)?;
    writeln!(out, "Hash blocks:     \t{}", done.tree.hash_blocks)?;
    writeln!(out, "Hash block size: \t{}", params.hash_block_size)?;
    writeln!(out, "Hash algorithm:  \t{}", params.algorithm)?;
    writeln!(out, "Salt:            \t{salt_text}")?;
    writeln!(out, "Root hash:      \t{}", hex::encode(root))?;
    if o.hash_offset == 0 {
        writeln!(out, "Hash device size: \t{} [bytes]", done.end)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(a: VerifyArgs) -> Result<ExitCode> {
    let root = hex::decode(a.root_hash.trim())
        .with_context(|| format!("root hash {:?} is not hex", a.root_hash))?;
    let o = ota::trees::TreeOptions::from(&a.opts);
    match ota::trees::verify(&a.data, &a.hashfile, &root, &o)? {
        Ok(params) => {
            if a.json {
                crate::report::print(VerityVerifyReport {
                    verified: true,
                    data_blocks: Some(params.data_blocks),
                    data_block_size: Some(params.data_block_size),
                    root_hash: Some(hex::encode(&root)),
                    area: None,
                    error: None,
                })?;
            } else {
                println!(
                    "Verified {} data blocks of {} bytes against root hash {}",
                    params.data_blocks,
                    params.data_block_size,
                    hex::encode(&root)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            let area = if matches!(e, verity::Error::DataBlockMismatch { .. }) {
                "data area"
            } else {
                "hash area"
            };
            if a.json {
                crate::report::print(VerityVerifyReport {
                    verified: false,
                    data_blocks: None,
                    data_block_size: None,
                    root_hash: None,
                    area: Some(area),
                    error: Some(e.to_string()),
                })?;
            }
            eprintln!("vabc: Verification of {area} failed: {e}");
            Ok(ExitCode::from(crate::checks::EXIT_MISMATCH))
        }
    }
}

/// `vabc verity format --json`.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct VerityFormatReport {
    #[serde(flatten)]
    tree: TreeReport,
    hash_type: u32,
    superblock: bool,
    hash_offset: u64,
    tree_offset: u64,
    hash_device_size: u64,
}

/// `vabc verity verify --json`.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct VerityVerifyReport {
    verified: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_blocks: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_block_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    root_hash: Option<String>,
    /// Where verification failed: "data area" or "hash area".
    #[serde(skip_serializing_if = "Option::is_none")]
    area: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// A dm-verity tree as the reports of `verity format` and `diff --verity` give it.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct TreeReport {
    pub(crate) hashfile: PathBuf,
    pub(crate) uuid: String,
    pub(crate) root_hash: String,
    pub(crate) salt: String,
    pub(crate) hash_algorithm: &'static str,
    pub(crate) data_blocks: u64,
    pub(crate) data_block_size: u32,
    pub(crate) hash_blocks: u64,
    pub(crate) hash_block_size: u32,
}

impl TreeReport {
    pub(crate) fn new(
        hashfile: PathBuf,
        uuid: String,
        params: &Params,
        root: &[u8],
        hash_blocks: u64,
    ) -> TreeReport {
        TreeReport {
            hashfile,
            uuid,
            root_hash: hex::encode(root),
            salt: hex::encode(&params.salt),
            hash_algorithm: params.algorithm.name(),
            data_blocks: params.data_blocks,
            data_block_size: params.data_block_size,
            hash_blocks,
            hash_block_size: params.hash_block_size,
        }
    }
}
