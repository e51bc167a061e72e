//! dm-verity trees as an update uses them: made for a new image when an update is
//! created, rebuilt on the device from base + COW and checked against the signed
//! root hash when it is installed, and recognised when an interrupted install left
//! one behind whole.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use bundle::VerityInfo;
use verity::{Format, HashAlgorithm, Input, Params, Superblock};

use crate::error::{Context, Result, invalid};

/// A tree written by [`format_default`] or [`write_hashfile`].
#[derive(Debug, Clone)]
pub struct Formatted {
    /// The tree's parameters.
    pub params: Params,
    /// The root hash.
    pub root: Vec<u8>,
    /// The superblock's UUID.
    pub uuid: [u8; 16],
    /// Blocks of the tree (without the superblock).
    pub hash_blocks: u64,
}

/// A salt given as hex, or `-` for none; at most [`verity::MAX_SALT_SIZE`] bytes.
pub fn parse_salt(s: &str) -> Result<Vec<u8>> {
    if s == "-" {
        return Ok(Vec::new());
    }
    let salt = hex::decode(s).map_err(|e| {
        crate::Error::Invalid(format!(
            "--salt {s:?} is not hex (or \"-\" for no salt): {e}"
        ))
    })?;
    if salt.len() > verity::MAX_SALT_SIZE {
        invalid!(
            "--salt is {} bytes, at most {} are allowed",
            salt.len(),
            verity::MAX_SALT_SIZE
        );
    }
    Ok(salt)
}

/// The tree of `data` with every parameter at its default, as `veritysetup format`
/// makes it: sha256, 4096-byte blocks, a superblock at offset 0, a random UUID, and a
/// random 32-byte salt unless `salt` (hex, or `-` for none) is given. `hashfile` is
/// written to a temporary file and renamed into place.
pub fn format_default(data: &Path, hashfile: &Path, salt: Option<&str>) -> Result<Formatted> {
    let data_file = File::open(data).map_err(|e| crate::Error::io("open data", data, e))?;
    let data_len = cow::view::file_size(&data_file, data)?;
    let salt = match salt {
        Some(s) => parse_salt(s)?,
        None => verity::random_bytes(32)?,
    };
    let params = Params {
        format: Format::from_u32(1)?,
        algorithm: HashAlgorithm::Sha256,
        data_block_size: 4096,
        hash_block_size: 4096,
        data_blocks: data_len / 4096,
        salt,
    };
    params.validate()?;
    let input = Input {
        reader: &data_file,
        name: data,
        len: data_len,
    };
    write_hashfile(input, params, verity::random_uuid()?, hashfile)
}

/// Writes a superblock (`params`, `uuid`) and the tree of `input` under it to
/// `hashfile` (a temporary file renamed into place), as `veritysetup format` with
/// those parameters does.
pub fn write_hashfile(
    input: Input<'_>,
    params: Params,
    uuid: [u8; 16],
    hashfile: &Path,
) -> Result<Formatted> {
    let layout = params.layout()?;
    let tree_off = verity::tree_offset(0, true, params.hash_block_size);
    let tmp = crate::output::temp_beside(hashfile)?;
    let sb = Superblock {
        params: params.clone(),
        uuid,
    };
    let mut area = sb.encode().to_vec();
    area.resize(tree_off as usize, 0);
    tmp.as_file()
        .write_all_at(&area, 0)
        .map_err(|e| crate::Error::io("write the superblock to", tmp.path(), e))?;
    let mut w = tmp.as_file();
    let root = verity::build_tree(input, &params, &mut w, tmp.path(), tree_off, None)?;
    tmp.as_file()
        .set_len(tree_off + layout.tree_size())
        .map_err(|e| crate::Error::io("size the temporary hash file", tmp.path(), e))?;
    crate::output::commit(tmp, hashfile)?;
    Ok(Formatted {
        params,
        root,
        uuid,
        hash_blocks: layout.hash_blocks,
    })
}

/// Tree parameters and UUID of a signed [`VerityInfo`].
pub fn signed_params(v: &VerityInfo) -> Result<(Params, [u8; 16])> {
    let params = Params {
        format: Format::from_u32(v.format)?,
        algorithm: v.hash_algorithm.parse()?,
        data_block_size: v.data_block_size,
        hash_block_size: v.hash_block_size,
        data_blocks: v.data_blocks,
        salt: hex::decode(&v.salt)
            .map_err(|e| crate::Error::Invalid(format!("the salt is not hex: {e}")))?,
    };
    params.validate()?;
    Ok((params, verity::parse_uuid(&v.uuid)?))
}

/// Bytes of the hash file (superblock and tree) that `v` describes; 0 without one.
pub fn hashfile_bytes(v: Option<&VerityInfo>) -> u64 {
    v.and_then(|v| signed_params(v).ok())
        .and_then(|(params, _)| {
            let tree = params.layout().ok()?.tree_size();
            Some(verity::tree_offset(0, true, params.hash_block_size) + tree)
        })
        .unwrap_or(0)
}

/// Whether `path` holds the tree `v` describes, whole: left by an install of the same
/// bundle that was cut short. Its superblock must carry the signed parameters (the
/// UUID is made anew for every bundle) and its levels must hash up to the signed
/// root hash; a tree that does not is written again, never reused.
pub fn has_hashfile(v: &VerityInfo, path: &Path) -> bool {
    let Ok((params, uuid)) = signed_params(v) else {
        return false;
    };
    let Ok(f) = File::open(path) else {
        return false;
    };
    let mut b = vec![0u8; verity::SUPERBLOCK_SIZE as usize];
    let sb_ok = f.read_exact_at(&mut b, 0).is_ok()
        && Superblock::decode(&b, path, 0).is_ok_and(|sb| sb.uuid == uuid && sb.params == params);
    let (Ok(root), Ok(md)) = (hex::decode(&v.root_hash), f.metadata()) else {
        return false;
    };
    sb_ok
        && verity::verify_levels(
            &params,
            Input {
                reader: &f,
                name: path,
                len: md.len(),
            },
            verity::tree_offset(0, true, params.hash_block_size),
            &root,
        )
        .is_ok()
}

/// The new image read through a COW, as the dm-verity tree builder reads its data.
pub(crate) struct ViewAt<'a>(pub cow::SnapshotView<'a>);

impl verity::ReadAt for ViewAt<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let bs = cow::BLOCK_SIZE as u64;
        if !offset.is_multiple_of(bs) {
            return Err(std::io::Error::other(format!(
                "read at {offset}, not a multiple of {bs}"
            )));
        }
        self.0
            .read_blocks(offset / bs, buf)
            .map_err(std::io::Error::other)
    }
}

/// Writes `dir/NAME.verity`: the dm-verity tree of the new image of partition `name`
/// (`new_size` bytes), read through `cow_path` over `base`, with the signed
/// parameters `v`; its root hash must be the signed one, or nothing is kept.
pub fn install_hashfile(
    name: &str,
    v: &VerityInfo,
    new_size: u64,
    cow_path: &Path,
    base: &Path,
    dir: &Path,
) -> Result<PathBuf> {
    let (params, uuid) =
        signed_params(v).with_context(|| format!("partition {name}: verity parameters"))?;
    let cow = cow::CowReader::open(cow_path)?;
    let file = File::open(base).map_err(|e| crate::Error::io("open base", base, e))?;
    let view = ViewAt(cow::SnapshotView::new(&cow, &file, base, Some(new_size))?);
    let input = Input {
        reader: &view,
        name: cow_path,
        len: new_size,
    };
    let path = dir.join(update::verity_name(name));
    let f = write_hashfile(input, params, uuid, &path)?;
    if hex::encode(&f.root) != v.root_hash {
        let _ = std::fs::remove_file(&path);
        crate::error::mismatch!(
            "partition {name}: the dm-verity tree of the installed image has root hash {}, the \
             bundle says {}; nothing was kept",
            hex::encode(&f.root),
            v.root_hash
        );
    }
    Ok(path)
}

/// A tree's parameters as `veritysetup` takes them (its option names in messages),
/// shared by `format`, `verify` and serving with a hash file. `None` is the default.
#[derive(Debug, Clone, Default)]
pub struct TreeOptions {
    /// Hash algorithm: sha256 (default), sha1 or sha512.
    pub hash: Option<String>,
    /// Salt as hex, or "-" for none. Default for format: 32 random bytes.
    pub salt: Option<String>,
    /// Data block size in bytes (default 4096).
    pub data_block_size: Option<u32>,
    /// Hash block size in bytes (default 4096).
    pub hash_block_size: Option<u32>,
    /// Data blocks to protect (default: every whole block of the data).
    pub data_blocks: Option<u64>,
    /// No superblock: the tree starts at the hash offset and every parameter is given.
    pub no_superblock: bool,
    /// Byte offset of the superblock (or tree) in the hash file; a multiple of 512.
    pub hash_offset: u64,
    /// Hash format: 1 (default) or 0 (the original Chrome OS format).
    pub format: Option<u32>,
}

impl TreeOptions {
    /// Whether any option differs from its default.
    pub fn any_given(&self) -> bool {
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
    pub fn tree_offset(&self, params: &Params) -> u64 {
        verity::tree_offset(
            self.hash_offset,
            !self.no_superblock,
            params.hash_block_size,
        )
    }

    fn check_offset(&self) -> Result<()> {
        if !self.hash_offset.is_multiple_of(512) {
            invalid!(
                "--hash-offset {} is not a multiple of 512",
                self.hash_offset
            );
        }
        Ok(())
    }

    /// Parameters from the options alone; `default_salt` supplies the salt when none
    /// is given.
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
            Some(s) => parse_salt(s)?,
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
            invalid!(
                "data device has {data_len} bytes, {whole} whole blocks of {data_block_size}, \
                 fewer than the {data_blocks} to protect"
            );
        }
        Ok(p)
    }

    /// The tree parameters for checking `data` (of `data_len` bytes) against the hash
    /// area of `hashfile` (`hash_file`, `hash_len` bytes) at the hash offset: from its
    /// superblock (options given alongside must agree with it) or, without one, from
    /// the options.
    pub fn resolve(
        &self,
        hashfile: &Path,
        hash_file: &File,
        hash_len: u64,
        data: &Path,
        data_len: u64,
    ) -> Result<Params> {
        self.check_offset()?;
        if self.no_superblock {
            if self.salt.is_none() {
                invalid!("--salt is required with --no-superblock (\"-\" for none)");
            }
            return self.params(data_len, || Ok(Vec::new()));
        }
        let mut b = vec![0u8; verity::SUPERBLOCK_SIZE as usize];
        if hash_len < self.hash_offset + verity::SUPERBLOCK_SIZE {
            return Err(verity::Error::Truncated {
                path: hashfile.to_path_buf(),
                what: format!("a superblock at offset {}", self.hash_offset),
                needed: self.hash_offset + verity::SUPERBLOCK_SIZE,
                actual: hash_len,
            }
            .into());
        }
        hash_file
            .read_exact_at(&mut b, self.hash_offset)
            .map_err(|e| {
                crate::Error::io(
                    format!("read at offset {} of", self.hash_offset),
                    hashfile,
                    e,
                )
            })?;
        let p = Superblock::decode(&b, hashfile, self.hash_offset)?.params;
        // Options given alongside a superblock must agree with it.
        let conflicts = [
            (
                "--hash",
                self.hash
                    .as_ref()
                    .map(|h| h.to_ascii_lowercase() != p.algorithm.name()),
            ),
            (
                "--data-block-size",
                self.data_block_size.map(|v| v != p.data_block_size),
            ),
            (
                "--hash-block-size",
                self.hash_block_size.map(|v| v != p.hash_block_size),
            ),
            (
                "--data-blocks",
                self.data_blocks.map(|v| v != p.data_blocks),
            ),
            ("--format", self.format.map(|v| v != p.format.as_u32())),
            (
                "--salt",
                self.salt
                    .as_ref()
                    .map(|s| parse_salt(s).map_or(true, |s| s != p.salt)),
            ),
        ];
        if let Some((opt, _)) = conflicts.iter().find(|(_, c)| *c == Some(true)) {
            invalid!(
                "{opt} differs from the superblock of {} at offset {}",
                hashfile.display(),
                self.hash_offset
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
        Ok(p)
    }
}

/// What [`format()`] wrote.
#[derive(Debug, Clone)]
pub struct FormatOutcome {
    /// The tree, its root hash and parameters (`uuid` is zero without a superblock).
    pub tree: Formatted,
    /// Whether a superblock was written.
    pub superblock: bool,
    /// Where the tree starts in the hash file.
    pub tree_offset: u64,
    /// Where the hash area ends in the hash file.
    pub end: u64,
}

/// Builds the tree of `data` into `hashfile` as `veritysetup format` does with the same
/// options (and the same bytes). A hash file that is a device is written in place; a
/// file goes to a temporary file renamed into place, keeping what precedes the hash
/// offset of an existing one and its mode. `uuid` is the superblock's (random if
/// `None`).
pub fn format(
    data: &Path,
    hashfile: &Path,
    o: &TreeOptions,
    uuid: Option<&str>,
) -> Result<FormatOutcome> {
    o.check_offset()?;
    let data_file = File::open(data).map_err(|e| crate::Error::io("open data", data, e))?;
    let data_len = cow::view::file_size(&data_file, data)?;
    let params = o.params(data_len, || Ok(verity::random_bytes(32)?))?;
    let layout = params.layout()?;
    let superblock = !o.no_superblock;
    if !superblock
        && !o
            .hash_offset
            .is_multiple_of(u64::from(params.hash_block_size))
    {
        invalid!(
            "--hash-offset {} is not a multiple of the hash block size {} (needed without a superblock)",
            o.hash_offset,
            params.hash_block_size
        );
    }
    let uuid = match (uuid, superblock) {
        (Some(u), _) => Some(verity::parse_uuid(u)?),
        (None, true) => Some(verity::random_uuid()?),
        (None, false) => None,
    };
    let tree_off = verity::tree_offset(o.hash_offset, superblock, params.hash_block_size);
    let end = tree_off + layout.tree_size();
    let existing = std::fs::metadata(hashfile).ok();
    refuse_overlap(existing.as_ref(), &data_file, data, hashfile, o, &params)?;

    let write_tree = |out: &File, out_name: &Path| -> Result<Vec<u8>> {
        if let Some(uuid) = uuid {
            let sb = Superblock {
                params: params.clone(),
                uuid,
            };
            let mut area = sb.encode().to_vec();
            // Zero the gap up to the tree so a reused file carries no stale bytes.
            area.resize(
                (tree_off - o.hash_offset).max(verity::SUPERBLOCK_SIZE) as usize,
                0,
            );
            out.write_all_at(&area, o.hash_offset).map_err(|e| {
                crate::Error::io(
                    format!("write the superblock at offset {} to", o.hash_offset),
                    out_name,
                    e,
                )
            })?;
        }
        let input = Input {
            reader: &data_file,
            name: data,
            len: data_len,
        };
        let mut w = out;
        Ok(verity::build_tree(
            input, &params, &mut w, out_name, tree_off, None,
        )?)
    };
    let root = match &existing {
        // Devices are written in place: there is nothing to rename.
        Some(md) if !md.file_type().is_file() => {
            let f = File::options()
                .read(true)
                .write(true)
                .open(hashfile)
                .map_err(|e| crate::Error::io("open for writing", hashfile, e))?;
            let len = cow::view::file_size(&f, hashfile)?;
            if len < end {
                invalid!(
                    "{} has {len} bytes, the hash area needs {end}",
                    hashfile.display()
                );
            }
            let root = write_tree(&f, hashfile)?;
            f.sync_all()
                .map_err(|e| crate::Error::io("sync", hashfile, e))?;
            root
        }
        _ => {
            let tmp = crate::output::temp_beside(hashfile)?;
            if existing.is_some() && o.hash_offset > 0 {
                // Keep what precedes the hash area (e.g. the data itself when the
                // tree is appended to the image).
                std::fs::copy(hashfile, tmp.path()).with_context(|| {
                    format!("copy {} to {}", hashfile.display(), tmp.path().display())
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
                // A replaced file keeps its mode; a new one gets tempfile's 0600, as
                // veritysetup's does.
                tmp.as_file()
                    .set_permissions(md.permissions())
                    .context("copy permissions to the temporary file")?;
            }
            crate::output::commit(tmp, hashfile)?;
            root
        }
    };
    Ok(FormatOutcome {
        tree: Formatted {
            hash_blocks: layout.hash_blocks,
            params,
            root,
            uuid: uuid.unwrap_or_default(),
        },
        superblock,
        tree_offset: tree_off,
        end,
    })
}

/// The hash area must not overwrite the data it protects.
fn refuse_overlap(
    existing: Option<&std::fs::Metadata>,
    data_file: &File,
    data: &Path,
    hashfile: &Path,
    o: &TreeOptions,
    params: &Params,
) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let data_md = data_file
        .metadata()
        .map_err(|e| crate::Error::io("stat", data, e))?;
    if let Some(md) = existing
        && md.dev() == data_md.dev()
        && md.ino() == data_md.ino()
        && o.hash_offset < params.data_size()
    {
        invalid!(
            "{} is the data file and --hash-offset {} lies inside the {} protected bytes",
            hashfile.display(),
            o.hash_offset,
            params.data_size()
        );
    }
    Ok(())
}

/// Checks every block of `data` against the tree in `hashfile` and the root hash
/// `root`, as `veritysetup verify` does. `Ok(Err(e))` is a tree that does not match
/// (`e.is_integrity_error()`); `Err` is a failure to check at all.
pub fn verify(
    data: &Path,
    hashfile: &Path,
    root: &[u8],
    o: &TreeOptions,
) -> Result<std::result::Result<Params, verity::Error>> {
    o.check_offset()?;
    let data_file = File::open(data).map_err(|e| crate::Error::io("open data", data, e))?;
    let data_len = cow::view::file_size(&data_file, data)?;
    let hash_file = File::open(hashfile).map_err(|e| crate::Error::io("open", hashfile, e))?;
    let hash_len = cow::view::file_size(&hash_file, hashfile)?;
    let params = o.resolve(hashfile, &hash_file, hash_len, data, data_len)?;
    let tree_off = o.tree_offset(&params);
    let data_in = Input {
        reader: &data_file,
        name: data,
        len: data_len,
    };
    let hash_in = Input {
        reader: &hash_file,
        name: hashfile,
        len: hash_len,
    };
    match verity::verify_tree(data_in, &params, hash_in, tree_off, root, None) {
        Ok(()) => Ok(Ok(params)),
        Err(e) if e.is_integrity_error() => Ok(Err(e)),
        Err(e) => Err(e.into()),
    }
}
