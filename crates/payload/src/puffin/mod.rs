//! puffpatch: the patches of update_engine's PUFFDIFF operations (and the inner
//! patches of LZ4DIFF_PUFFDIFF), made by Chromium OS's puffin.
//!
//! Files full of deflate streams (APKs, zips, gzip) change completely in their
//! compressed bytes when a little changes inside. puffin diffs them in a form where
//! that does not happen: each deflate stream is *puffed* (its Huffman codes replaced
//! by the symbols they stand for, byte-aligned, every choice the compressor made kept)
//! and bsdiff runs between the puffed sources; applying the patch puffs the source,
//! runs bspatch, and *huffs* the result back to the exact deflate bytes.
//!
//! ```text
//! 0  4  "PUF1"
//! 4  4  header length H, big-endian
//! 8  H  PatchHeader (protobuf): version = 1; src, dst: StreamInfo; type (0 bsdiff)
//!          StreamInfo: deflates (bit extents in the file), puffs (extents in the
//!          puffed form, in bits), puff_length (the puffed form's size)
//! 8+H   the bsdiff patch (BSDIFF40 or BSDF2) from the puffed source to the puffed
//!       destination
//! ```
//!
//! Written here from puffin's public sources because no Rust implementation exists.
//! Only puffin's output is a specification: the puffed source must be byte for byte
//! the one the patch was made against, and the huffed destination the deflate the
//! generator started from, so every quirk of puffin's reader and writer that valid
//! patches can reach is reproduced (the `stream`, `puff` and `huff` modules). Every length and
//! extent comes from the patch and is checked before use; a malformed patch is an
//! error, never a panic or an allocation it chose.

mod bits;
mod huff;
mod huffman;
mod puff;
mod stream;

use crate::bspatch::PatchError;
use stream::Layout;

/// Why a puffin patch does not apply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PuffError {
    /// The patch does not start with `PUF1`.
    #[error("not a puffin patch (magic {0:02x?})")]
    Magic([u8; 4]),
    /// The header, the extents or a deflate or puff stream is invalid.
    #[error("{0}")]
    Invalid(String),
    /// The inner patch is of a kind vabc does not apply.
    #[error("its inner patch is {0}, which vabc does not apply")]
    Unsupported(String),
    /// The inner bsdiff patch does not apply.
    #[error("its inner bsdiff patch does not apply: {0}")]
    Bsdiff(#[source] PatchError),
}

pub(crate) type Invalid = PuffError;

pub(crate) fn invalid(what: impl Into<String>) -> PuffError {
    PuffError::Invalid(what.into())
}

/// A deflate's or puff's extent (both in bits in the header).
#[derive(Clone, PartialEq, prost::Message)]
struct BitExtent {
    #[prost(uint64, tag = "1")]
    offset: u64,
    #[prost(uint64, tag = "2")]
    length: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StreamInfo {
    #[prost(message, repeated, tag = "1")]
    deflates: Vec<BitExtent>,
    #[prost(message, repeated, tag = "2")]
    puffs: Vec<BitExtent>,
    #[prost(uint64, tag = "3")]
    puff_length: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PatchHeader {
    #[prost(int32, tag = "1")]
    version: i32,
    #[prost(message, optional, tag = "2")]
    src: Option<StreamInfo>,
    #[prost(message, optional, tag = "3")]
    dst: Option<StreamInfo>,
    /// 0 bsdiff, 1 zucchini.
    #[prost(int32, tag = "4")]
    r#type: i32,
}

const MAGIC: &[u8; 4] = b"PUF1";

/// A puffed form is at most this many times its deflated one, plus a MiB: a code of
/// one bit becomes a byte, a copy of two bits three (what a header claims past this
/// is refused before anything is allocated for it).
const PUFF_GROWTH: u64 = 16;

/// A parsed patch: both streams' layouts and the inner bsdiff patch.
struct Patch<'a> {
    src: Layout,
    dst: Layout,
    bsdiff: &'a [u8],
}

fn layout(info: Option<StreamInfo>, side: &str, deflated_max: u64) -> Result<Layout, PuffError> {
    let info = info.unwrap_or_default();
    let deflates: Vec<(u64, u64)> = info.deflates.iter().map(|e| (e.offset, e.length)).collect();
    // Puffs are byte extents written in bits (puffin's generator writes whole bytes;
    // its reader drops the rest, which would misplace every byte after).
    if let Some(e) = info
        .puffs
        .iter()
        .find(|e| e.offset % 8 != 0 || e.length % 8 != 0)
    {
        return Err(invalid(format!(
            "the {side} stream's puff at bit {} is not whole bytes",
            e.offset
        )));
    }
    let puffs: Vec<(u64, u64)> = info
        .puffs
        .iter()
        .map(|e| (e.offset / 8, e.length / 8))
        .collect();
    // A puffed form is held whole: bounded by what its side can puff to, and by
    // what an operation may hold.
    let most = deflated_max
        .min(crate::apply::MAX_OP_BYTES)
        .saturating_mul(PUFF_GROWTH)
        .saturating_add(1 << 20);
    if info.puff_length > most {
        return Err(invalid(format!(
            "the {side} stream's puffed size {} is more than its {deflated_max} bytes can puff to",
            info.puff_length
        )));
    }
    Layout::new(&deflates, &puffs, info.puff_length).map_err(|e| invalid(format!("{side}: {e}")))
}

fn parse(patch: &[u8], old_len: u64, max_new: u64) -> Result<Patch<'_>, PuffError> {
    if patch.len() < 8 {
        return Err(invalid(format!(
            "{} bytes: shorter than a puffin header",
            patch.len()
        )));
    }
    let mut magic = [0u8; 4];
    magic.copy_from_slice(&patch[..4]);
    if &magic != MAGIC {
        return Err(PuffError::Magic(magic));
    }
    let n = u32::from_be_bytes([patch[4], patch[5], patch[6], patch[7]]) as usize;
    let Some(h) = patch.get(8..8usize.saturating_add(n)) else {
        return Err(invalid(format!(
            "its header of {n} bytes runs past the patch's {}",
            patch.len()
        )));
    };
    let header = <PatchHeader as prost::Message>::decode(h)
        .map_err(|e| invalid(format!("its header does not decode: {e}")))?;
    if header.version != 1 {
        return Err(invalid(format!(
            "header version {}: puffin patches are version 1",
            header.version
        )));
    }
    match header.r#type {
        0 => {}
        1 => return Err(PuffError::Unsupported("zucchini".into())),
        t => return Err(PuffError::Unsupported(format!("of type {t}"))),
    }
    Ok(Patch {
        src: layout(header.src, "source", old_len)?,
        dst: layout(header.dst, "destination", max_new)?,
        bsdiff: &patch[8 + n..],
    })
}

/// The bytes `patch` makes from `old` (the operation's source blocks), at most
/// `max_new` (its destination's size).
pub fn apply(old: &[u8], patch: &[u8], max_new: u64) -> Result<Vec<u8>, PuffError> {
    let p = parse(patch, old.len() as u64, max_new)?;
    let src = stream::puff_stream(old, &p.src)
        .map_err(|e| invalid(format!("the source does not puff as the patch says: {e}")))?;
    let new =
        crate::bspatch::apply(&src, p.bsdiff, p.dst.puff_size()).map_err(PuffError::Bsdiff)?;
    drop(src);
    let out = stream::huff_stream(&new, &p.dst, max_new)?;
    if out.len() as u64 > max_new {
        return Err(invalid(format!(
            "it makes {} bytes, more than the {max_new} the operation writes",
            out.len()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
