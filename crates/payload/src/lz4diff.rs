//! lz4diff: the patches of update_engine's LZ4DIFF_BSDIFF and LZ4DIFF_PUFFDIFF
//! operations, for files EROFS stores LZ4-compressed.
//!
//! A small change in such a file changes every compressed block after it, so the
//! generator diffs the decompressed files and the device compresses the result again,
//! block by block, exactly as EROFS laid the target out; where its compressor would
//! not give the target's bytes, the patch carries a fix for that block.
//!
//! ```text
//! 0   7  "LZ4DIFF"
//! 7   4  version = 1, big-endian
//! 11  4  header length H, big-endian
//! 15  1  (zero)
//! 16  H  Lz4diffHeader (protobuf): the source's and the target's blocks
//!           (uncompressed offset and length, compressed length, and for target
//!           blocks the SHA-256 of the device's recompression and a BSDIFF40 patch
//!           from it to the target's bytes when they differ), the compressor
//!           (LZ4 or LZ4HC and its level), whether blocks are zero-padded in front
//!           (EROFS's 0padding), the inner patch's type (bsdiff or puffin)
//! 16+H   the inner patch, from the decompressed source to the decompressed target
//! ```
//!
//! Applying: each source block is decompressed (a block whose compressed length is
//! not below its length is stored as is); the inner patch makes the decompressed
//! target; each target block is compressed into exactly its compressed length with
//! liblz4's `LZ4_compress_HC_destSize` or `LZ4_compress_destSize` over all the data
//! from the block's start (update_engine's input window, which decides the bytes),
//! padded, checked against its hash and fixed by its patch; bytes after the last
//! block follow as they are.
//!
//! The compressor must be liblz4 itself (the generator's bytes come from it): its
//! fill-to-size functions are called through the C library that `lz4-sys` builds,
//! since neither `lz4` nor `lz4-sys` binds them and no Rust compressor reproduces
//! liblz4's output. update_engine links liblz4 1.9.4; `lz4-sys` builds 1.10.0, whose
//! output a test compares with the system's 1.9.4 at every level it can.

use sha2::{Digest, Sha256};
use std::ffi::{c_char, c_int, c_void};

// The static liblz4 `lz4-sys` builds provides the functions declared below.
use lz4_sys as _;

unsafe extern "C" {
    fn LZ4_compress_HC_destSize(
        state: *mut c_void,
        src: *const c_char,
        dst: *mut c_char,
        src_size: *mut c_int,
        target_dst_size: c_int,
        level: c_int,
    ) -> c_int;
    fn LZ4_compress_destSize(
        src: *const c_char,
        dst: *mut c_char,
        src_size: *mut c_int,
        target_dst_size: c_int,
    ) -> c_int;
    fn LZ4_decompress_safe_partial(
        src: *const c_char,
        dst: *mut c_char,
        src_size: c_int,
        target_output_size: c_int,
        dst_capacity: c_int,
    ) -> c_int;
    fn LZ4_sizeofStateHC() -> c_int;
}

/// Why an lz4diff patch does not apply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Lz4DiffError {
    /// The patch does not start with `LZ4DIFF`.
    #[error("not an lz4diff patch (magic {0:02x?})")]
    Magic([u8; 7]),
    /// The header, a block or the data is invalid.
    #[error("{0}")]
    Invalid(String),
    /// The inner bsdiff patch, or a block's fix, does not apply.
    #[error("{what} does not apply: {source}")]
    Bsdiff {
        /// Which patch.
        what: String,
        /// Why.
        #[source]
        source: crate::bspatch::PatchError,
    },
    /// The inner puffin patch does not apply.
    #[error("its inner puffin patch does not apply: {0}")]
    Puffin(#[source] crate::puffin::PuffError),
}

fn invalid(what: impl Into<String>) -> Lz4DiffError {
    Lz4DiffError::Invalid(what.into())
}

mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CompressionAlgorithm {
        /// 0 uncompressed, 1 LZ4, 2 LZ4HC.
        #[prost(int32, tag = "1")]
        pub r#type: i32,
        #[prost(int32, tag = "2")]
        pub level: i32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CompressedBlockInfo {
        #[prost(uint64, tag = "1")]
        pub uncompressed_offset: u64,
        #[prost(uint64, tag = "2")]
        pub uncompressed_length: u64,
        #[prost(uint64, tag = "3")]
        pub compressed_length: u64,
        #[prost(bytes = "vec", tag = "4")]
        pub sha256_hash: Vec<u8>,
        #[prost(bytes = "vec", tag = "5")]
        pub postfix_bspatch: Vec<u8>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CompressionInfo {
        #[prost(message, optional, tag = "1")]
        pub algo: Option<CompressionAlgorithm>,
        #[prost(message, repeated, tag = "2")]
        pub block_info: Vec<CompressedBlockInfo>,
        #[prost(bool, tag = "3")]
        pub zero_padding_enabled: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Lz4diffHeader {
        #[prost(message, optional, tag = "1")]
        pub src_info: Option<CompressionInfo>,
        #[prost(message, optional, tag = "2")]
        pub dst_info: Option<CompressionInfo>,
        /// 0 bsdiff, 1 puffdiff.
        #[prost(int32, tag = "3")]
        pub inner_type: i32,
    }
}

pub use proto::{CompressedBlockInfo, CompressionAlgorithm, CompressionInfo, Lz4diffHeader};

const MAGIC: &[u8; 7] = b"LZ4DIFF";
/// LZ4's largest ratio is about 255; a block claiming more is crafted.
const MAX_RATIO: u64 = 256;

/// A block's lengths, checked: length, compressed length.
struct Block {
    len: usize,
    clen: usize,
}

fn to_int(v: usize, what: &str) -> Result<c_int, Lz4DiffError> {
    c_int::try_from(v).map_err(|_| invalid(format!("{what} of {v} bytes is more than lz4 takes")))
}

/// The blocks of `info`, contiguous from 0, with their total lengths (uncompressed,
/// compressed).
fn blocks(info: &CompressionInfo, side: &str) -> Result<(Vec<Block>, usize, usize), Lz4DiffError> {
    let mut out = Vec::with_capacity(info.block_info.len());
    let (mut total, mut ctotal) = (0u64, 0u64);
    for (i, b) in info.block_info.iter().enumerate() {
        if b.uncompressed_offset != total {
            return Err(invalid(format!(
                "{side} block {i} starts at {}, not at {total} where the one before ends",
                b.uncompressed_offset
            )));
        }
        if b.uncompressed_length
            > b.compressed_length
                .saturating_mul(MAX_RATIO)
                .saturating_add(16)
        {
            return Err(invalid(format!(
                "{side} block {i} claims {} bytes from {} compressed",
                b.uncompressed_length, b.compressed_length
            )));
        }
        total = total.saturating_add(b.uncompressed_length);
        ctotal = ctotal.saturating_add(b.compressed_length);
        let len = usize::try_from(b.uncompressed_length).map_err(|_| invalid("block length"))?;
        let clen = usize::try_from(b.compressed_length).map_err(|_| invalid("block length"))?;
        to_int(len, "a block")?;
        to_int(clen, "a block")?;
        out.push(Block { len, clen });
    }
    // Either side is held whole in memory: at most what one operation may write.
    if total > crate::apply::MAX_OP_BYTES {
        return Err(invalid(format!(
            "the {side} blocks decompress to {total} bytes; vabc holds at most {} for an \
             operation",
            crate::apply::MAX_OP_BYTES
        )));
    }
    let total = usize::try_from(total).map_err(|_| invalid("total length"))?;
    let ctotal = usize::try_from(ctotal).map_err(|_| invalid("total length"))?;
    Ok((out, total, ctotal))
}

/// The source decompressed: every block, stored or LZ4.
fn decompress(old: &[u8], info: &CompressionInfo) -> Result<Vec<u8>, Lz4DiffError> {
    let (blocks, total, ctotal) = blocks(info, "source")?;
    if blocks.is_empty() {
        return Err(invalid("the source has no blocks"));
    }
    if ctotal != old.len() {
        return Err(invalid(format!(
            "the source blocks hold {ctotal} compressed bytes, the operation reads {}",
            old.len()
        )));
    }
    let mut out = vec![0u8; total];
    let (mut at, mut cat) = (0usize, 0usize);
    for (i, b) in blocks.iter().enumerate() {
        let cluster = &old[cat..cat + b.clen];
        let dst = &mut out[at..at + b.len];
        if b.clen >= b.len {
            if b.clen != b.len || b.len == 0 {
                return Err(invalid(format!(
                    "source block {i} is stored with {} bytes for {}",
                    b.clen, b.len
                )));
            }
            dst.copy_from_slice(cluster);
        } else {
            let margin = if info.zero_padding_enabled {
                cluster.iter().take(4096).take_while(|&&c| c == 0).count()
            } else {
                0
            };
            let data = &cluster[margin..];
            // SAFETY: `data` is readable for `data.len()` bytes and `dst` writable for
            // `dst.len()`; the partial decoder reads and writes within those bounds
            // whatever the data holds (it is lz4's bounds-checked decoder), and the
            // two lengths fit an int (checked in `blocks`).
            let n = unsafe {
                LZ4_decompress_safe_partial(
                    data.as_ptr().cast(),
                    dst.as_mut_ptr().cast(),
                    data.len() as c_int,
                    dst.len() as c_int,
                    dst.len() as c_int,
                )
            };
            if n < 0 || n as usize != b.len {
                return Err(invalid(format!(
                    "source block {i} (compressed bytes {cat}..{}) does not decompress to its \
                     {} bytes",
                    cat + b.clen,
                    b.len
                )));
            }
        }
        at += b.len;
        cat += b.clen;
    }
    Ok(out)
}

/// LZ4HC's working state: `LZ4_sizeofStateHC()` bytes, aligned for the pointers in
/// it.
struct HcState(Vec<u64>);

impl HcState {
    fn new() -> HcState {
        // SAFETY: a size query with no arguments.
        let len = usize::try_from(unsafe { LZ4_sizeofStateHC() }).unwrap_or(0);
        HcState(vec![0u64; len.div_ceil(8)])
    }

    fn as_ptr(&mut self) -> *mut c_void {
        self.0.as_mut_ptr().cast()
    }
}

/// One block compressed into exactly `clen` bytes the way update_engine does it.
fn compress_block(
    algo: &CompressionAlgorithm,
    state: &mut HcState,
    input: &[u8],
    clen: usize,
    zero_padding: bool,
) -> Result<Vec<u8>, String> {
    let mut buf = vec![0u8; clen];
    let mut src_size =
        c_int::try_from(input.len()).map_err(|_| "its input is too large".to_string())?;
    let target = c_int::try_from(clen).map_err(|_| "it is too large".to_string())?;
    let n = match algo.r#type {
        2 => {
            // SAFETY: `input` is readable for `src_size` bytes and `buf` writable for
            // `target`; the destSize functions never write past `target` bytes nor
            // read past `src_size`. `state` is a u64-aligned buffer of
            // LZ4_sizeofStateHC() bytes, which the HC function initialises itself on
            // every call.
            unsafe {
                LZ4_compress_HC_destSize(
                    state.as_ptr(),
                    input.as_ptr().cast(),
                    buf.as_mut_ptr().cast(),
                    &mut src_size,
                    target,
                    algo.level,
                )
            }
        }
        1 => {
            // SAFETY: as above, without a state.
            unsafe {
                LZ4_compress_destSize(
                    input.as_ptr().cast(),
                    buf.as_mut_ptr().cast(),
                    &mut src_size,
                    target,
                )
            }
        }
        t => {
            return Err(format!(
                "the target's compressor is type {t}, neither LZ4 (1) nor LZ4HC (2)"
            ));
        }
    };
    let n = usize::try_from(n).unwrap_or(0);
    if n == 0 || n > clen {
        return Err(format!("lz4 gives {n} bytes for {clen}"));
    }
    if n < clen {
        if zero_padding {
            buf.copy_within(..n, clen - n);
            buf[..clen - n].fill(0);
        } else {
            buf[n..].fill(0);
        }
    }
    Ok(buf)
}

/// The bytes `patch` makes from `old` (the operation's source blocks), at most
/// `max_new` (its destination's size).
pub fn apply(old: &[u8], patch: &[u8], max_new: u64) -> Result<Vec<u8>, Lz4DiffError> {
    if patch.len() < 16 {
        return Err(invalid(format!(
            "{} bytes: shorter than an lz4diff header",
            patch.len()
        )));
    }
    let mut magic = [0u8; 7];
    magic.copy_from_slice(&patch[..7]);
    if &magic != MAGIC {
        return Err(Lz4DiffError::Magic(magic));
    }
    let version = u32::from_be_bytes([patch[7], patch[8], patch[9], patch[10]]);
    if version != 1 {
        return Err(invalid(format!(
            "version {version}: lz4diff patches are version 1"
        )));
    }
    let n = u32::from_be_bytes([patch[11], patch[12], patch[13], patch[14]]) as usize;
    let Some(h) = patch.get(16..16usize.saturating_add(n)) else {
        return Err(invalid(format!(
            "its header of {n} bytes runs past the patch's {}",
            patch.len()
        )));
    };
    let header = <Lz4diffHeader as prost::Message>::decode(h)
        .map_err(|e| invalid(format!("its header does not decode: {e}")))?;
    let inner = &patch[16 + n..];
    if inner.is_empty() {
        return Err(invalid("it has no inner patch"));
    }
    let src_info = header.src_info.unwrap_or_default();
    let dst_info = header.dst_info.unwrap_or_default();
    let (dst_blocks, dst_total, dst_ctotal) = blocks(&dst_info, "target")?;
    if dst_ctotal as u64 > max_new {
        return Err(invalid(format!(
            "the target blocks hold {dst_ctotal} compressed bytes, more than the {max_new} the \
             operation writes"
        )));
    }
    let src = decompress(old, &src_info)?;
    // The decompressed target: its blocks, and what follows them (written as is).
    let most = (dst_total as u64).saturating_add(max_new);
    let raw = match header.inner_type {
        0 => crate::bspatch::apply(&src, inner, most).map_err(|source| Lz4DiffError::Bsdiff {
            what: "its inner bsdiff patch".into(),
            source,
        })?,
        1 => crate::puffin::apply(&src, inner, most).map_err(Lz4DiffError::Puffin)?,
        t => {
            return Err(invalid(format!(
                "inner patch type {t} is neither bsdiff (0) nor puffdiff (1)"
            )));
        }
    };
    drop(src);
    if raw.len() < dst_total {
        return Err(invalid(format!(
            "the inner patch makes {} bytes, the target blocks hold {dst_total}",
            raw.len()
        )));
    }
    let algo = dst_info.algo.clone().unwrap_or_default();
    let mut state = HcState::new();
    let mut out = Vec::with_capacity(dst_ctotal + raw.len() - dst_total);
    let mut at = 0usize;
    for (i, (b, info)) in dst_blocks.iter().zip(&dst_info.block_info).enumerate() {
        let bad = |what: String| invalid(format!("target block {i}: {what}"));
        let block = if b.clen >= b.len {
            // update_engine writes a stored block's length, not its compressed
            // length; the two differ only in a patch that shifts every block after.
            if b.clen != b.len {
                return Err(bad(format!("stored with {} bytes for {}", b.clen, b.len)));
            }
            raw[at..at + b.len].to_vec()
        } else {
            compress_block(
                &algo,
                &mut state,
                &raw[at..dst_total],
                b.clen,
                dst_info.zero_padding_enabled,
            )
            .map_err(bad)?
        };
        at += b.len;
        // update_engine checks the hash only before a fix; checked always, a block
        // compressed otherwise than by the generator is named here rather than by
        // the partition's hash.
        if !info.sha256_hash.is_empty() && Sha256::digest(&block).as_slice() != info.sha256_hash {
            return Err(bad(format!(
                "it compresses to other bytes than the generator's ({} {})",
                if algo.r#type == 2 {
                    "LZ4HC level"
                } else {
                    "LZ4, level"
                },
                algo.level
            )));
        }
        if info.postfix_bspatch.is_empty() {
            out.extend_from_slice(&block);
        } else {
            let fixed = crate::bspatch::apply(&block, &info.postfix_bspatch, b.clen as u64)
                .map_err(|source| Lz4DiffError::Bsdiff {
                    what: format!("target block {i}'s fix"),
                    source,
                })?;
            if fixed.len() != b.clen {
                return Err(bad(format!(
                    "its fix makes {} bytes, not {}",
                    fixed.len(),
                    b.clen
                )));
            }
            out.extend_from_slice(&fixed);
        }
    }
    out.extend_from_slice(&raw[dst_total..]);
    if out.len() as u64 > max_new {
        return Err(invalid(format!(
            "it makes {} bytes, more than the {max_new} the operation writes",
            out.len()
        )));
    }
    Ok(out)
}

/// An lz4diff patch from its parts (tests and the fuzz corpus).
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub fn encode(header: &Lz4diffHeader, inner: &[u8]) -> Vec<u8> {
    let h = prost::Message::encode_to_vec(header);
    let mut p = MAGIC.to_vec();
    p.extend(1u32.to_be_bytes());
    p.extend((h.len() as u32).to_be_bytes());
    p.push(0);
    p.extend(h);
    p.extend_from_slice(inner);
    p
}

/// `input` compressed into at most `clen` bytes by the compressor update_engine calls
/// (`algo`), and how much of it that consumed.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub fn dest_size(algo: &CompressionAlgorithm, input: &[u8], clen: usize) -> (Vec<u8>, usize) {
    let mut state = HcState::new();
    let mut src_size = input.len() as c_int;
    let mut buf = vec![0u8; clen];
    // SAFETY: as in `compress_block`.
    let n = unsafe {
        match algo.r#type {
            2 => LZ4_compress_HC_destSize(
                state.as_ptr(),
                input.as_ptr().cast(),
                buf.as_mut_ptr().cast(),
                &mut src_size,
                clen as c_int,
                algo.level,
            ),
            _ => LZ4_compress_destSize(
                input.as_ptr().cast(),
                buf.as_mut_ptr().cast(),
                &mut src_size,
                clen as c_int,
            ),
        }
    };
    buf.truncate(usize::try_from(n).unwrap_or(0));
    (buf, usize::try_from(src_size).unwrap_or(0))
}

/// Compresses `data` into EROFS-like blocks of `clen` bytes each (test data for
/// the patch tests; update_engine's own recompression is [`apply`]'s).
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub fn compress_for_tests(
    algo: &CompressionAlgorithm,
    data: &[u8],
    clen: usize,
    zero_padding: bool,
) -> (Vec<u8>, Vec<CompressedBlockInfo>) {
    let mut state = HcState::new();
    let (mut out, mut info, mut at) = (Vec::new(), Vec::new(), 0usize);
    while at < data.len() {
        let mut src_size = (data.len() - at) as c_int;
        let mut buf = vec![0u8; clen];
        // SAFETY: as in `compress_block`.
        let n = unsafe {
            LZ4_compress_HC_destSize(
                state.as_ptr(),
                data[at..].as_ptr().cast(),
                buf.as_mut_ptr().cast(),
                &mut src_size,
                clen as c_int,
                algo.level,
            )
        } as usize;
        let used = src_size as usize;
        let (block, len, c) = if n == 0 || used <= clen {
            // Incompressible: stored.
            let len = clen.min(data.len() - at);
            (data[at..at + len].to_vec(), len, len)
        } else {
            if zero_padding {
                buf.copy_within(..n, clen - n);
                buf[..clen - n].fill(0);
            } else {
                buf[n..].fill(0);
            }
            (buf, used, clen)
        };
        info.push(CompressedBlockInfo {
            uncompressed_offset: at as u64,
            uncompressed_length: len as u64,
            compressed_length: c as u64,
            ..Default::default()
        });
        out.extend_from_slice(&block);
        at += len;
    }
    (out, info)
}

/// The patch update_engine's generator makes (lz4diff.cc): the inner patch (the
/// `bsdiff` tool's, in `dir`) between the decompressed files, and for each target
/// block the hash of the device's recompression and a BSDIFF40 fix where it differs
/// from the target's bytes. For tests and fuzz seeds.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub fn make_patch(
    src: (&[u8], &[CompressedBlockInfo]),
    dst: (&[u8], &[CompressedBlockInfo]),
    algo: &CompressionAlgorithm,
    zero_padding: bool,
    dir: &std::path::Path,
) -> Vec<u8> {
    let src_info = CompressionInfo {
        algo: Some(algo.clone()),
        block_info: src.1.to_vec(),
        zero_padding_enabled: zero_padding,
    };
    let mut dst_info = CompressionInfo {
        algo: Some(algo.clone()),
        block_info: dst.1.to_vec(),
        zero_padding_enabled: zero_padding,
    };
    let raw_src = decompress(src.0, &src_info).unwrap();
    let raw_dst = decompress(dst.0, &dst_info).unwrap();
    let inner = crate::fuzzing::bsdiff_tool(dir, &raw_src, &raw_dst);
    let (blocks, total, _) = blocks(&dst_info, "target").unwrap();
    let mut state = HcState::new();
    let (mut at, mut cat) = (0, 0);
    for (b, info) in blocks.iter().zip(dst_info.block_info.iter_mut()) {
        let want = &dst.0[cat..cat + b.clen];
        let got = if b.clen >= b.len {
            raw_dst[at..at + b.len].to_vec()
        } else {
            compress_block(algo, &mut state, &raw_dst[at..total], b.clen, zero_padding).unwrap()
        };
        info.sha256_hash = Sha256::digest(&got).to_vec();
        if got != want {
            info.postfix_bspatch = crate::fuzzing::bsdiff_tool(dir, &got, want);
        }
        at += b.len;
        cat += b.clen;
    }
    encode(
        &Lz4diffHeader {
            src_info: Some(src_info),
            dst_info: Some(dst_info),
            inner_type: 0,
        },
        &inner,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hc(level: i32) -> CompressionAlgorithm {
        CompressionAlgorithm { r#type: 2, level }
    }

    use crate::fuzzing::lz4_text as text;

    #[test]
    fn a_patch_recompresses_its_target_with_and_without_fixes() {
        let dir = tempfile::tempdir().unwrap();
        let old = text(1, 200_000);
        let mut new = old.clone();
        new.splice(50_000..50_000, text(2, 3000));
        new[120_000..121_000].fill(b'z');
        for zero_padding in [true, false] {
            let (sc, si) = compress_for_tests(&hc(9), &old, 4096, zero_padding);
            // Compressed as the header says: recompression matches, no fixes.
            let (dc, di) = compress_for_tests(&hc(9), &new, 4096, zero_padding);
            let p = make_patch((&sc, &si), (&dc, &di), &hc(9), zero_padding, dir.path());
            assert!(apply(&sc, &p, dc.len() as u64).unwrap() == dc);
            // Compressed at another level: blocks differ, their fixes apply.
            let (dc, di) = compress_for_tests(&hc(12), &new, 4096, zero_padding);
            let p = make_patch((&sc, &si), (&dc, &di), &hc(9), zero_padding, dir.path());
            let h: Lz4diffHeader = prost::Message::decode(
                &p[16..16 + u32::from_be_bytes(p[11..15].try_into().unwrap()) as usize],
            )
            .unwrap();
            let fixed = h
                .dst_info
                .unwrap()
                .block_info
                .iter()
                .filter(|b| !b.postfix_bspatch.is_empty())
                .count();
            assert!(fixed > 0, "no block needed a fix");
            assert!(apply(&sc, &p, dc.len() as u64).unwrap() == dc);
        }
    }

    #[test]
    fn stored_blocks_and_lz4_fast_apply() {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = fastrand::Rng::with_seed(5);
        let mut old: Vec<u8> = (0..20_000).map(|_| rng.u8(..)).collect();
        old.extend(text(3, 30_000));
        let mut new = old.clone();
        new[25_000..25_100].fill(1);
        let (sc, si) = compress_for_tests(&hc(9), &old, 4096, true);
        assert!(
            si.iter()
                .any(|b| b.compressed_length >= b.uncompressed_length)
        );
        let (dc, di) = compress_for_tests(&hc(9), &new, 4096, true);
        let fast = CompressionAlgorithm {
            r#type: 1,
            level: 0,
        };
        let p = make_patch((&sc, &si), (&dc, &di), &fast, true, dir.path());
        assert!(apply(&sc, &p, dc.len() as u64).unwrap() == dc);
    }

    #[test]
    fn damaged_patches_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let old = text(6, 30_000);
        let new = text(7, 30_000);
        let (sc, si) = compress_for_tests(&hc(9), &old, 4096, true);
        let (dc, di) = compress_for_tests(&hc(12), &new, 4096, true);
        let p = make_patch((&sc, &si), (&dc, &di), &hc(9), true, dir.path());
        let max = dc.len() as u64;
        assert!(matches!(
            apply(&sc, b"LZ4DIFX\0\0\0\x01\0\0\0\0\0", max),
            Err(Lz4DiffError::Magic(_))
        ));
        assert!(apply(&sc, &p[..15], max).is_err());
        // Cut inside the inner patch's control stream (its trailing bytes may go
        // unread, as bspatch reads only what the control numbers ask for).
        let h = u32::from_be_bytes([p[11], p[12], p[13], p[14]]) as usize;
        assert!(apply(&sc, &p[..16 + h + 40], max).is_err());
        assert!(apply(&sc[..sc.len() - 4096], &p, max).is_err());
        assert!(apply(&sc, &p, max - 1).is_err());
        // A stored target block longer than its data, and blocks claiming more than
        // an operation may hold: refused before anything is made.
        let header =
            |p: &[u8]| -> Lz4diffHeader { prost::Message::decode(&p[16..16 + h]).unwrap() };
        let inner = &p[16 + h..];
        let mut x = header(&p);
        let b = x.dst_info.as_mut().unwrap().block_info.last_mut().unwrap();
        b.uncompressed_length = b.compressed_length - 1;
        let e = apply(&sc, &encode(&x, inner), max).unwrap_err().to_string();
        assert!(e.contains("stored with"), "{e}");
        let mut x = header(&p);
        let b = &mut x.src_info.as_mut().unwrap().block_info[0];
        b.compressed_length = u64::MAX / 2;
        b.uncompressed_length = u64::MAX / 2;
        assert!(apply(&sc, &encode(&x, inner), max).is_err());
        let mut other = sc.clone();
        other[100] ^= 0x55;
        let _ = apply(&other, &p, max);
        let mut rng = fastrand::Rng::with_seed(9);
        for _ in 0..200 {
            let mut q = p.clone();
            let i = rng.usize(..q.len());
            q[i] ^= 1 << rng.u8(0..8);
            let _ = apply(&sc, &q, max);
        }
    }
}
