//! `vabc verity format|verify`: dm-verity hash trees, compatible with
//! `veritysetup format|verify` (same options, same output layout, same bytes).

use std::fs::{self, File};
use std::io::Write as _;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use verity::{Format, HashAlgorithm, Input, Params, SUPERBLOCK_SIZE, Superblock};

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

/// Length of a regular file, or of a block device (whose metadata says 0).
pub(crate) fn device_or_file_len(f: &File, path: &Path) -> Result<u64> {
    Ok(cow::view::file_size(f, path)?)
}

impl TreeOpts {
    /// Whether any tree option differs from its default.
    pub(crate) fn any_given(&self) -> bool {
        self.hash.is_some()
            || self.salt.is_some()
            || self.data_block_size.is_some()
            || self.hash_block_size.is_some()
            || self.data_blocks.is_some()
            || self.no_superblock
            || self.hash_offset != 0
            || self.format.is_some()
    }

    /// Byte offset of the tree itself in the hash file (past any superblock).
    pub(crate) fn tree_offset(&self, params: &Params) -> u64 {
        verity::tree_offset(
            self.hash_offset,
            !self.no_superblock,
            params.hash_block_size,
        )
    }

    fn check_offset(&self) -> Result<()> {
        if !self.hash_offset.is_multiple_of(512) {
            bail!(
                "--hash-offset {} is not a multiple of 512",
                self.hash_offset
            );
        }
        Ok(())
    }

    /// Parameters from the command line alone; `salt` supplies the default salt.
    fn params(
        &self,
        data_len: u64,
        default_salt: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<Params> {
        let algorithm: HashAlgorithm = self.hash.as_deref().unwrap_or("sha256").parse()?;
        let format = Format::from_u32(self.format.unwrap_or(1))?;
        let data_block_size = self.data_block_size.unwrap_or(4096);
        let hash_block_size = self.hash_block_size.unwrap_or(4096);
        let salt = match &self.salt {
            Some(s) => ota::trees::parse_salt(s)?,
            None => default_salt()?,
        };
        let whole = data_len / u64::from(data_block_size.max(1));
        let data_blocks = self.data_blocks.unwrap_or(whole);
        let p = Params {
            format,
            algorithm,
            data_block_size,
            hash_block_size,
            data_blocks,
            salt,
        };
        p.validate()?;
        if data_blocks > whole {
            bail!(
                "data device has {data_len} bytes, {whole} whole blocks of {data_block_size}, \
                 fewer than the {data_blocks} to protect"
            );
        }
        Ok(p)
    }
}

fn format(a: FormatArgs) -> Result<ExitCode> {
    let o = &a.opts;
    o.check_offset()?;
    let data_file =
        File::open(&a.data).with_context(|| format!("open data {}", a.data.display()))?;
    let data_len = device_or_file_len(&data_file, &a.data)?;
    let params = o.params(data_len, || Ok(verity::random_bytes(32)?))?;
    let layout = params.layout()?;
    let superblock = !o.no_superblock;
    if !superblock
        && !o
            .hash_offset
            .is_multiple_of(u64::from(params.hash_block_size))
    {
        bail!(
            "--hash-offset {} is not a multiple of the hash block size {} (needed without a superblock)",
            o.hash_offset,
            params.hash_block_size
        );
    }
    let uuid = match (&a.uuid, superblock) {
        (Some(u), _) => Some(verity::parse_uuid(u)?),
        (None, true) => Some(verity::random_uuid()?),
        (None, false) => None,
    };
    let tree_off = verity::tree_offset(o.hash_offset, superblock, params.hash_block_size);
    let end = tree_off + layout.tree_size();

    // The hash area must not overwrite the data it protects.
    let existing = fs::metadata(&a.hashfile).ok();
    let data_md = data_file
        .metadata()
        .with_context(|| format!("stat {}", a.data.display()))?;
    if let Some(md) = &existing
        && md.dev() == data_md.dev()
        && md.ino() == data_md.ino()
        && o.hash_offset < params.data_size()
    {
        bail!(
            "{} is the data file and --hash-offset {} lies inside the {} protected bytes",
            a.hashfile.display(),
            o.hash_offset,
            params.data_size()
        );
    }

    let write_tree = |out: &File, out_name: &Path| -> Result<Vec<u8>> {
        if let Some(uuid) = uuid {
            let sb = Superblock {
                params: params.clone(),
                uuid,
            };
            let mut area = sb.encode().to_vec();
            // Zero the gap up to the tree so a reused file carries no stale bytes.
            area.resize((tree_off - o.hash_offset).max(SUPERBLOCK_SIZE) as usize, 0);
            std::os::unix::fs::FileExt::write_all_at(out, &area, o.hash_offset).with_context(
                || {
                    format!(
                        "write superblock to {} at offset {}",
                        out_name.display(),
                        o.hash_offset
                    )
                },
            )?;
        }
        let input = Input {
            reader: &data_file,
            name: &a.data,
            len: data_len,
        };
        let mut w = out;
        let root = verity::build_tree(input, &params, &mut w, out_name, tree_off, None)?;
        Ok(root)
    };

    let root = match &existing {
        // Devices are written in place: there is nothing to rename.
        Some(md) if !md.file_type().is_file() => {
            let f = File::options()
                .read(true)
                .write(true)
                .open(&a.hashfile)
                .with_context(|| format!("open {} for writing", a.hashfile.display()))?;
            let len = device_or_file_len(&f, &a.hashfile)?;
            if len < end {
                bail!(
                    "{} has {len} bytes, the hash area needs {end}",
                    a.hashfile.display()
                );
            }
            let root = write_tree(&f, &a.hashfile)?;
            f.sync_all()
                .with_context(|| format!("sync {}", a.hashfile.display()))?;
            root
        }
        _ => {
            let tmp = ota::output::temp_beside(&a.hashfile)?;
            if existing.is_some() && o.hash_offset > 0 {
                // Keep what precedes the hash area (e.g. the data itself when
                // the tree is appended to the image).
                fs::copy(&a.hashfile, tmp.path()).with_context(|| {
                    format!("copy {} to {}", a.hashfile.display(), tmp.path().display())
                })?;
            }
            let root = write_tree(tmp.as_file(), tmp.path())?;
            // Never shorten a file that was longer, never leave one shorter than the area.
            let cur = tmp
                .as_file()
                .metadata()
                .context("stat temporary file")?
                .len();
            if cur < end {
                tmp.as_file()
                    .set_len(end)
                    .context("extend temporary file")?;
            }
            if let Some(md) = &existing {
                // A replaced file keeps its mode; a new one gets tempfile's 0600, as veritysetup's does.
                tmp.as_file()
                    .set_permissions(md.permissions())
                    .context("copy permissions to the temporary file")?;
            }
            ota::output::commit(tmp, &a.hashfile)?;
            root
        }
    };

    let salt_text = if params.salt.is_empty() {
        "-".to_string()
    } else {
        hex::encode(&params.salt)
    };
    let uuid_text = uuid.as_ref().map(verity::format_uuid).unwrap_or_default();
    let mut out = std::io::stdout().lock();
    if a.json {
        drop(out);
        crate::report::print(VerityFormatReport {
            tree: TreeReport::new(
                a.hashfile.clone(),
                uuid_text,
                &params,
                &root,
                layout.hash_blocks,
            ),
            hash_type: params.format.as_u32(),
            superblock,
            hash_offset: o.hash_offset,
            tree_offset: tree_off,
            hash_device_size: end,
        })?;
    } else {
        // Same labels, tabs and spacing as veritysetup 2.6.
        writeln!(
            out,
            "VERITY header information for {}",
            a.hashfile.display()
        )?;
        writeln!(out, "UUID:            \t{uuid_text}")?;
        writeln!(out, "Hash type:       \t{}", params.format.as_u32())?;
        writeln!(out, "Data blocks:     \t{}", params.data_blocks)?;
        writeln!(out, "Data block size: \t{}", params.data_block_size)?;
        writeln!(out, "Hash blocks:     \t{}", layout.hash_blocks)?;
        writeln!(out, "Hash block size: \t{}", params.hash_block_size)?;
        writeln!(out, "Hash algorithm:  \t{}", params.algorithm)?;
        writeln!(out, "Salt:            \t{salt_text}")?;
        writeln!(out, "Root hash:      \t{}", hex::encode(&root))?;
        if o.hash_offset == 0 {
            writeln!(out, "Hash device size: \t{end} [bytes]")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The tree parameters for checking `data` (of `data_len` bytes) against the
/// hash area of `hashfile` at `o.hash_offset`: from its superblock (options given
/// alongside must agree with it) or, with `--no-superblock`, from the options.
pub(crate) fn resolve_params(
    o: &TreeOpts,
    hashfile: &Path,
    hash_file: &File,
    hash_len: u64,
    data: &Path,
    data_len: u64,
) -> Result<Params> {
    o.check_offset()?;
    let params = if o.no_superblock {
        if o.salt.is_none() {
            bail!("--salt is required with --no-superblock (\"-\" for none)");
        }
        o.params(data_len, || Ok(Vec::new()))?
    } else {
        let mut b = vec![0u8; SUPERBLOCK_SIZE as usize];
        if hash_len < o.hash_offset + SUPERBLOCK_SIZE {
            return Err(verity::Error::Truncated {
                path: hashfile.to_path_buf(),
                what: format!("a superblock at offset {}", o.hash_offset),
                needed: o.hash_offset + SUPERBLOCK_SIZE,
                actual: hash_len,
            }
            .into());
        }
        std::os::unix::fs::FileExt::read_exact_at(hash_file, &mut b, o.hash_offset)
            .with_context(|| format!("read {} at offset {}", hashfile.display(), o.hash_offset))?;
        let sb = Superblock::decode(&b, hashfile, o.hash_offset)?;
        let p = sb.params;
        // Options given alongside a superblock must agree with it.
        let conflicts = [
            (
                "--hash",
                o.hash
                    .as_ref()
                    .map(|h| h.to_ascii_lowercase() != p.algorithm.name()),
            ),
            (
                "--data-block-size",
                o.data_block_size.map(|v| v != p.data_block_size),
            ),
            (
                "--hash-block-size",
                o.hash_block_size.map(|v| v != p.hash_block_size),
            ),
            ("--data-blocks", o.data_blocks.map(|v| v != p.data_blocks)),
            ("--format", o.format.map(|v| v != p.format.as_u32())),
            (
                "--salt",
                o.salt
                    .as_ref()
                    .map(|s| ota::trees::parse_salt(s).map_or(true, |s| s != p.salt)),
            ),
        ];
        if let Some((opt, _)) = conflicts.iter().find(|(_, c)| *c == Some(true)) {
            bail!(
                "{opt} differs from the superblock of {} at offset {}",
                hashfile.display(),
                o.hash_offset
            );
        }
        if data_len / u64::from(p.data_block_size) < p.data_blocks {
            return Err(verity::Error::Truncated {
                path: data.to_path_buf(),
                what: format!("{} data blocks of {}", p.data_blocks, p.data_block_size),
                needed: p.data_size(),
                actual: data_len,
            }
            .into());
        }
        p
    };
    Ok(params)
}

fn verify(a: VerifyArgs) -> Result<ExitCode> {
    let o = &a.opts;
    o.check_offset()?;
    let data_file =
        File::open(&a.data).with_context(|| format!("open data {}", a.data.display()))?;
    let data_len = device_or_file_len(&data_file, &a.data)?;
    let hash_file =
        File::open(&a.hashfile).with_context(|| format!("open {}", a.hashfile.display()))?;
    let hash_len = device_or_file_len(&hash_file, &a.hashfile)?;
    let root = hex::decode(a.root_hash.trim())
        .with_context(|| format!("root hash {:?} is not hex", a.root_hash))?;

    let params = resolve_params(o, &a.hashfile, &hash_file, hash_len, &a.data, data_len)?;
    let tree_off = verity::tree_offset(o.hash_offset, !o.no_superblock, params.hash_block_size);
    let data = Input {
        reader: &data_file,
        name: &a.data,
        len: data_len,
    };
    let hash = Input {
        reader: &hash_file,
        name: &a.hashfile,
        len: hash_len,
    };
    match verity::verify_tree(data, &params, hash, tree_off, &root, None) {
        Ok(()) => {
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
        Err(e) if e.is_integrity_error() => {
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
        Err(e) => Err(e.into()),
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
