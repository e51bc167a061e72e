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
