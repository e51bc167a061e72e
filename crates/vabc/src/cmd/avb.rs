//! `vabc avb add-hashtree-footer|info`: unsigned AVB hashtree footers in the
//! layout of `avbtool add_hashtree_footer --do_not_generate_fec --algorithm NONE`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use verity::HashAlgorithm;
use verity::avb::{self, HashtreeFooterOptions};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Append a dm-verity hash tree, an unsigned vbmeta blob and an AVB footer to IMAGE, in place.
    #[command(
        long_about = "Append a dm-verity hash tree, an unsigned vbmeta blob (algorithm NONE) with a \
hashtree descriptor and an AVB footer to IMAGE, in place, byte for byte as \
`avbtool add_hashtree_footer --do_not_generate_fec --algorithm NONE` does.\n\n\
Not supported: FEC (forward error correction; avbtool needs an external `fec` tool for it, \
so the descriptor records 0 FEC roots), signing keys, and re-running on an image that already \
has a footer (refused: start again from the original image).\n\n\
Safety: all checks (existing footer, partition size) run before anything is written; the \
original bytes are never changed; the footer is written last after a sync; on error the file \
is cut back to its original size."
    )]
    AddHashtreeFooter(AddArgs),
    /// Print an image's AVB footer, vbmeta header and descriptors (like `avbtool info_image`).
    Info(InfoArgs),
}

#[derive(clap::Args)]
struct AddArgs {
    /// Image to extend in place.
    image: PathBuf,
    /// Size of the partition in bytes (a multiple of 4096); the image becomes exactly this size.
    #[arg(long, alias = "partition_size", value_name = "N", value_parser = crate::args::parse_size)]
    partition_size: u64,
    /// Partition name stored in the descriptor (e.g. system).
    #[arg(long, alias = "partition_name", value_name = "NAME")]
    partition_name: String,
    /// sha256 (default here; avbtool defaults to sha1), sha1 or sha512.
    #[arg(
        long,
        alias = "hash_algorithm",
        value_name = "ALG",
        default_value = "sha256"
    )]
    hash_algorithm: String,
    /// Salt as hex (default: random, as long as the digest).
    #[arg(long, value_name = "HEX")]
    salt: Option<String>,
    /// Release string in the vbmeta header (default matches avbtool 1.3.0's bytes).
    #[arg(long, value_name = "S", default_value = avb::DEFAULT_RELEASE_STRING)]
    release_string: String,
    /// Print the resulting footer and descriptors as JSON instead of avbtool's text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct InfoArgs {
    /// Image with an AVB footer, or a bare vbmeta image.
    image: PathBuf,
    /// Print a JSON report instead of avbtool's text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    match args.command {
        Sub::AddHashtreeFooter(a) => add(a),
        Sub::Info(a) => {
            let info = avb::read_image_info(&a.image)?;
            print_info(&info, a.json)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// avbtool's text, or the same facts as JSON.
fn print_info(info: &avb::ImageInfo, json: bool) -> Result<()> {
    if !json {
        print!("{}", avb::format_image_info(info));
        return Ok(());
    }
    let descriptors = info
        .descriptors
        .iter()
        .map(|d| match d {
            avb::Descriptor::Hashtree(h) => DescriptorReport::Hashtree {
                partition_name: &h.partition_name,
                image_size: h.image_size,
                tree_offset: h.tree_offset,
                tree_size: h.tree_size,
                data_block_size: h.data_block_size,
                hash_block_size: h.hash_block_size,
                hash_algorithm: &h.hash_algorithm,
                salt: hex::encode(&h.salt),
                root_digest: hex::encode(&h.root_digest),
                dm_verity_version: h.dm_verity_version,
                flags: h.flags,
            },
            avb::Descriptor::Other { tag, bytes } => DescriptorReport::Other {
                tag: *tag,
                size: bytes.len(),
            },
        })
        .collect();
    crate::report::print(AvbInfoReport {
        image_size: info.image_size,
        footer: info.footer.as_ref().map(|f| FooterReport {
            version: format!("{}.{}", f.version_major, f.version_minor),
            original_image_size: f.original_image_size,
            vbmeta_offset: f.vbmeta_offset,
            vbmeta_size: f.vbmeta_size,
        }),
        release_string: &info.header.release_string,
        descriptors,
    })
}

fn add(a: AddArgs) -> Result<ExitCode> {
    let algorithm: HashAlgorithm = a.hash_algorithm.parse()?;
    let salt = a
        .salt
        .as_deref()
        .map(|s| hex::decode(s).with_context(|| format!("--salt {s:?} is not hex")))
        .transpose()?;
    if a.release_string.len() > 47 {
        anyhow::bail!(
            "--release-string is {} bytes, at most 47 fit",
            a.release_string.len()
        );
    }
    let mut opts = HashtreeFooterOptions::new(a.partition_size, &a.partition_name);
    opts.algorithm = algorithm;
    opts.salt = salt;
    opts.release_string = a.release_string;
    avb::add_hashtree_footer(&a.image, &opts, None)?;
    let info = avb::read_image_info(&a.image)?;
    print_info(&info, a.json)?;
    Ok(ExitCode::SUCCESS)
}

/// `vabc avb info --json`.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct AvbInfoReport<'a> {
    image_size: u64,
    footer: Option<FooterReport>,
    release_string: &'a str,
    descriptors: Vec<DescriptorReport<'a>>,
}

#[derive(serde::Serialize, schemars::JsonSchema)]
struct FooterReport {
    version: String,
    original_image_size: u64,
    vbmeta_offset: u64,
    vbmeta_size: u64,
}

#[derive(serde::Serialize, schemars::JsonSchema)]
#[serde(tag = "type", rename_all = "lowercase")]
enum DescriptorReport<'a> {
    Hashtree {
        partition_name: &'a str,
        image_size: u64,
        tree_offset: u64,
        tree_size: u64,
        data_block_size: u32,
        hash_block_size: u32,
        hash_algorithm: &'a str,
        salt: String,
        root_digest: String,
        dm_verity_version: u32,
        flags: u32,
    },
    Other {
        tag: u64,
        size: usize,
    },
}
