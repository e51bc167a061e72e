//! Zucchini ensemble patches (ZUCCHINI operations, brotli-compressed), the format 1.0
//! that Android's copy of Chromium's Zucchini reads.
//!
//! ```text
//! 0   4  "Zucc"          all integers little-endian
//! 4   2  major version (1), then 2: minor version
//! 8   4  old size, then old CRC-32, new size, new CRC-32
//! 24  4  element count, then per element:
//!          old offset, old length, new offset, new length (4 bytes each),
//!          executable type (four ASCII bytes: NoOp, EA64, DEX , ...), version (2)
//!          streams, each a 4-byte length and its bytes: equivalences (source skip
//!          as zigzag LEB128, destination skip and length as LEB128), extra data,
//!          raw delta (skip as LEB128, one signed byte of difference each),
//!          reference delta, then a count of pools: a tag byte and a stream of
//!          extra targets each
//! ```
//!
//! Elements tile the new file in order. Applying one copies its equivalences' source
//! ranges from the old element, fills the bytes between them with the extra data,
//! adds the raw delta to the copied bytes, and, for an executable element, rewrites
//! its references (branch targets, relocations) from a disassembly of both sides.
//! Raw elements (`NoOp`) are applied here; an executable element (ELF or DEX, what
//! update_engine's generator finds in `.so`, `.odex` and `.vdex` files) is refused,
//! naming its type: its reference correction needs Zucchini's disassemblers, which are
//! not written here. The whole patch is parsed and every bound checked first, the old
//! data's CRC-32 is checked before anything is made and the new data's after.
//!
//! Written here from Chromium's public sources because no Rust implementation
//! exists.

use std::io::Read;

/// Why a zucchini patch does not apply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZucchiniError {
    /// The brotli stream around the patch does not decompress.
    #[error("its brotli data does not decompress: {0}")]
    Brotli(#[source] std::io::Error),
    /// The patch is malformed.
    #[error("{0}")]
    Invalid(String),
    /// An element needs a disassembler this crate does not have.
    #[error(
        "element {index} is an executable ({kind}): vabc applies Zucchini's raw elements, \
         not the reference correction of executable ones"
    )]
    Executable {
        /// The element's index.
        index: usize,
        /// Its executable type.
        kind: &'static str,
    },
    /// The old data is not the patch's.
    #[error("the source is not the one the patch was made from: {0}")]
    OldImage(String),
    /// The result is not the patch's.
    #[error("the result does not have the patch's size and CRC-32: {0}")]
    NewImage(String),
}

fn invalid(what: impl Into<String>) -> ZucchiniError {
    ZucchiniError::Invalid(what.into())
}

const MAGIC: u32 = u32::from_le_bytes(*b"Zucc");

/// The executable types format 1.0 knows: four-character code, name, and the element
/// version Android's build accepts (0xffff: compiled out).
const TYPES: [(&[u8; 4], &str, u16); 9] = [
    (b"NoOp", "raw", 1),
    (b"Px86", "Windows x86", 0xffff),
    (b"Px64", "Windows x64", 0xffff),
    (b"Ex86", "ELF x86", 1),
    (b"Ex64", "ELF x86-64", 1),
    (b"EA32", "ELF AArch32", 1),
    (b"EA64", "ELF AArch64", 1),
    (b"DEX ", "DEX", 1),
    (b"ZTF ", "ZTF", 0xffff),
];

/// Reads the patch front to back.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], ZucchiniError> {
        let s = self
            .data
            .get(self.at..self.at.saturating_add(n))
            .ok_or_else(|| invalid(format!("the patch ends inside {what} at byte {}", self.at)))?;
        self.at += n;
        Ok(s)
    }

    fn u16(&mut self, what: &str) -> Result<u16, ZucchiniError> {
        let b = self.bytes(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, ZucchiniError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A stream: its 4-byte length, then its bytes.
    fn stream(&mut self, what: &str) -> Result<&'a [u8], ZucchiniError> {
        let n = self.u32(what)? as usize;
        self.bytes(n, what)
    }
}

/// An unsigned LEB128 number of at most 32 bits (bits past them are dropped, as
/// Zucchini drops them); `None` when the stream ends or runs past 5 bytes.
fn varuint(s: &mut &[u8]) -> Option<u32> {
    let (mut v, mut shift) = (0u32, 0u32);
    loop {
        let (&b, rest) = s.split_first()?;
        *s = rest;
        v |= u32::from(b & 0x7f).checked_shl(shift).unwrap_or(0);
        if b < 0x80 {
            return Some(v);
        }
        shift += 7;
        if shift >= 32 {
            return None;
        }
    }
}

/// A zigzag-encoded signed number.
fn varint(s: &mut &[u8]) -> Option<i32> {
    let t = varuint(s)?;
    let h = (t >> 1) as i32;
    Some(if t & 1 == 1 { !h } else { h })
}

/// Copy `len` bytes from `src` of the old element to `dst` of the new one.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Equivalence {
    src: u32,
    dst: u32,
    len: u32,
}

/// An element, parsed and checked.
struct Element<'a> {
    old: (usize, usize),
    new: (usize, usize),
    kind: usize,
    equivalences: Vec<Equivalence>,
    extra: &'a [u8],
    delta_skip: &'a [u8],
    delta_diff: &'a [u8],
    reference_delta: &'a [u8],
}

/// The equivalences of three streams, or the first that is malformed.
fn equivalences(
    mut src_skip: &[u8],
    mut dst_skip: &[u8],
    mut count: &[u8],
    max: usize,
) -> Result<Vec<Equivalence>, String> {
    let mut out = Vec::new();
    let (mut src_end, mut dst_end) = (0i64, 0u32);
    while !src_skip.is_empty() && !dst_skip.is_empty() && !count.is_empty() {
        let bad = || format!("equivalence {} is malformed", out.len());
        // Each copies at least a byte in any patch Zucchini writes; empty ones would
        // be memory for nothing.
        if out.len() > max {
            return Err(format!("more than {max} equivalences"));
        }
        let len = varuint(&mut count).ok_or_else(bad)?;
        let src = src_end + i64::from(varint(&mut src_skip).ok_or_else(bad)?);
        let src = u32::try_from(src).map_err(|_| bad())?;
        src_end = i64::from(src.checked_add(len).ok_or_else(bad)?);
        let dst = dst_end
            .checked_add(varuint(&mut dst_skip).ok_or_else(bad)?)
            .ok_or_else(bad)?;
        dst_end = dst.checked_add(len).ok_or_else(bad)?;
        out.push(Equivalence { src, dst, len });
    }
    if !(src_skip.is_empty() && dst_skip.is_empty() && count.is_empty()) {
        return Err("the equivalence streams do not end together".into());
    }
    Ok(out)
}

fn element<'a>(r: &mut Reader<'a>, index: usize) -> Result<Element<'a>, ZucchiniError> {
    let what = format!("element {index}");
    let bad = |s: String| invalid(format!("{what}: {s}"));
    let (old_offset, old_len) = (r.u32(&what)?, r.u32(&what)?);
    let (new_offset, new_len) = (r.u32(&what)?, r.u32(&what)?);
    let code = r.bytes(4, &what)?;
    let version = r.u16(&what)?;
    let kind = TYPES
        .iter()
        .position(|(c, _, _)| c[..] == code[..])
        .ok_or_else(|| bad(format!("unknown executable type {code:02x?}")))?;
    if version != TYPES[kind].2 {
        return Err(bad(format!(
            "version {version} of a {} element",
            TYPES[kind].1
        )));
    }
    if old_len == 0 || new_len == 0 {
        return Err(bad("an empty side".into()));
    }
    let (src_skip, dst_skip, count) = (r.stream(&what)?, r.stream(&what)?, r.stream(&what)?);
    let extra = r.stream(&what)?;
    let equivalences = equivalences(src_skip, dst_skip, count, new_len as usize).map_err(bad)?;
    let mut copied = 0u64;
    for (i, e) in equivalences.iter().enumerate() {
        if e.src >= old_len
            || e.len > old_len - e.src
            || e.dst >= new_len
            || e.len > new_len - e.dst
        {
            return Err(bad(format!("equivalence {i} lies outside the element")));
        }
        copied += u64::from(e.len);
    }
    if copied > u64::from(new_len) || extra.len() as u64 != u64::from(new_len) - copied {
        return Err(bad(format!(
            "{copied} bytes copied and {} of extra data do not make its {new_len} bytes",
            extra.len()
        )));
    }
    let (delta_skip, delta_diff) = (r.stream(&what)?, r.stream(&what)?);
    let reference_delta = r.stream(&what)?;
    let pools = r.u32(&what)?;
    let mut tags = Vec::new();
    for _ in 0..pools {
        let tag = r.bytes(1, &what)?[0];
        if tag == 0xff || tags.contains(&tag) {
            return Err(bad(format!("pool tag {tag} is invalid or repeated")));
        }
        tags.push(tag);
        r.stream(&what)?;
    }
    Ok(Element {
        old: (old_offset as usize, old_len as usize),
        new: (new_offset as usize, new_len as usize),
        kind,
        equivalences,
        extra,
        delta_skip,
        delta_diff,
        reference_delta,
    })
}

/// Makes a raw element's bytes `n` from its old bytes `o`.
fn apply_raw(e: &Element<'_>, o: &[u8], n: &mut [u8]) -> Result<(), String> {
    let (mut p, mut extra) = (0usize, e.extra);
    for q in &e.equivalences {
        let (src, dst, len) = (q.src as usize, q.dst as usize, q.len as usize);
        let (fill, rest) = extra.split_at(dst - p);
        n[p..dst].copy_from_slice(fill);
        extra = rest;
        n[dst..dst + len].copy_from_slice(&o[src..src + len]);
        p = dst + len;
    }
    n[p..].copy_from_slice(extra);
    // The raw delta: offsets into the equivalences' copied bytes, in order.
    let (mut skip, mut diff) = (e.delta_skip, e.delta_diff);
    let (mut next, mut base, mut q) = (0u32, 0u64, 0usize);
    while !skip.is_empty() && !diff.is_empty() {
        let offset = varuint(&mut skip)
            .and_then(|s| s.checked_add(next))
            .ok_or("the raw delta is malformed")?;
        let (&d, rest) = diff.split_first().ok_or("the raw delta is malformed")?;
        diff = rest;
        if d == 0 {
            return Err("the raw delta holds a zero difference".into());
        }
        next = offset.checked_add(1).ok_or("the raw delta is malformed")?;
        loop {
            let eq = e
                .equivalences
                .get(q)
                .ok_or("the raw delta runs past the copied bytes")?;
            if base + u64::from(eq.len) > u64::from(offset) {
                let at = eq.dst as usize + (u64::from(offset) - base) as usize;
                n[at] = n[at].wrapping_add(d);
                break;
            }
            base += u64::from(eq.len);
            q += 1;
        }
    }
    if !skip.is_empty() || !diff.is_empty() {
        return Err("the raw delta's streams do not end together".into());
    }
    if !e.reference_delta.is_empty() {
        return Err("a raw element has a reference delta".into());
    }
    Ok(())
}

/// The bytes the brotli-compressed zucchini patch `data` makes from `old` (the
/// operation's source blocks); they must be `new_len` bytes (its destination's),
/// as update_engine requires.
pub fn apply(old: &[u8], data: &[u8], new_len: u64) -> Result<Vec<u8>, ZucchiniError> {
    // A patch holds its extra data (at most the new size) and, for each copied byte
    // it changes, a difference and its skip (two bytes in a patch that changes every
    // one): anything decompressing past this is refused before it is held.
    let most = new_len.saturating_mul(4).saturating_add(1 << 20);
    let mut patch = Vec::new();
    brotli::Decompressor::new(data, 64 << 10)
        .take(most + 1)
        .read_to_end(&mut patch)
        .map_err(ZucchiniError::Brotli)?;
    if patch.len() as u64 > most {
        return Err(invalid(format!(
            "it decompresses to more than the {most} bytes a patch of {new_len} bytes can hold"
        )));
    }
    apply_patch(old, &patch, new_len)
}

/// [`apply`] for a patch already decompressed.
pub fn apply_patch(old: &[u8], patch: &[u8], new_len: u64) -> Result<Vec<u8>, ZucchiniError> {
    let mut r = Reader { data: patch, at: 0 };
    if r.u32("the header")? != MAGIC {
        return Err(invalid(format!(
            "not a zucchini patch (magic {:02x?})",
            &patch[..4]
        )));
    }
    let (major, _minor) = (r.u16("the header")?, r.u16("the header")?);
    if major != 1 {
        return Err(invalid(format!(
            "format {major}: Android's zucchini reads format 1"
        )));
    }
    let (old_size, old_crc) = (r.u32("the header")?, r.u32("the header")?);
    let (new_size, new_crc) = (r.u32("the header")?, r.u32("the header")?);
    if u64::from(new_size) != new_len {
        return Err(invalid(format!(
            "it makes {new_size} bytes; the operation writes {new_len}"
        )));
    }
    let count = r.u32("the element count")? as usize;
    let mut elements = Vec::with_capacity(count.min(1024));
    let mut end = 0usize;
    for i in 0..count {
        let e = element(&mut r, i)?;
        if e.old.0 > old_size as usize || e.old.1 > old_size as usize - e.old.0 {
            return Err(invalid(format!(
                "element {i}'s old range is outside the old data"
            )));
        }
        if e.new.0 != end || e.new.1 > new_size as usize - e.new.0.min(new_size as usize) {
            return Err(invalid(format!(
                "element {i} does not follow the one before inside the new data"
            )));
        }
        end = e.new.0 + e.new.1;
        elements.push(e);
    }
    if end != new_size as usize || r.at != patch.len() {
        return Err(invalid(
            "the elements do not end where the new data and the patch end",
        ));
    }
    if let Some((index, e)) = elements.iter().enumerate().find(|(_, e)| e.kind != 0) {
        return Err(ZucchiniError::Executable {
            index,
            kind: TYPES[e.kind].1,
        });
    }
    if old.len() != old_size as usize || crc32fast::hash(old) != old_crc {
        return Err(ZucchiniError::OldImage(format!(
            "{} bytes with CRC-32 {:08x}, the patch's are {old_size} with {old_crc:08x}",
            old.len(),
            crc32fast::hash(old)
        )));
    }
    let mut new = vec![0u8; new_size as usize];
    for (i, e) in elements.iter().enumerate() {
        let o = &old[e.old.0..e.old.0 + e.old.1];
        apply_raw(e, o, &mut new[e.new.0..e.new.0 + e.new.1])
            .map_err(|s| invalid(format!("element {i}: {s}")))?;
    }
    let crc = crc32fast::hash(&new);
    if crc != new_crc {
        return Err(ZucchiniError::NewImage(format!(
            "CRC-32 {crc:08x}, the patch's is {new_crc:08x}"
        )));
    }
    Ok(new)
}

/// A raw ensemble patch from `old` to `new` (tests and fuzz seeds): one element over
/// both whole files; each 4 KiB chunk of `new` that some chunk of `old` equals, or
/// differs from at the same offset in at most 64 bytes, is copied (and its differences
/// added), the rest is extra data.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub fn raw_patch_for_tests(old: &[u8], new: &[u8]) -> Vec<u8> {
    fn leb(v: &mut Vec<u8>, mut x: u32) {
        while x >= 0x80 {
            v.push(x as u8 | 0x80);
            x >>= 7;
        }
        v.push(x as u8);
    }
    const C: usize = 4096;
    let (mut src_skip, mut dst_skip, mut count, mut extra) = (vec![], vec![], vec![], vec![]);
    let (mut d_skip, mut d_diff) = (vec![], vec![]);
    let (mut src_end, mut dst_end, mut copied, mut next) = (0i64, 0usize, 0u32, 0u32);
    for (i, chunk) in new.chunks(C).enumerate() {
        let at = i * C;
        let same = old
            .chunks(C)
            .position(|o| o == chunk)
            .map(|j| (j * C, Vec::new()));
        let near = || {
            let o = old.get(at..at + chunk.len())?;
            let d: Vec<(usize, u8)> = o
                .iter()
                .zip(chunk)
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .map(|(k, (a, b))| (k, b.wrapping_sub(*a)))
                .collect();
            (d.len() <= 64).then_some((at, d))
        };
        let Some((src, diffs)) = same.or_else(near) else {
            extra.extend_from_slice(chunk);
            continue;
        };
        let s = src as i64 - src_end;
        leb(&mut src_skip, ((s << 1) ^ (s >> 63)) as u32);
        leb(&mut dst_skip, (at - dst_end) as u32);
        leb(&mut count, chunk.len() as u32);
        for (k, d) in diffs {
            let offset = copied + k as u32;
            leb(&mut d_skip, offset - next);
            d_diff.push(d);
            next = offset + 1;
        }
        src_end = (src + chunk.len()) as i64;
        dst_end = at + chunk.len();
        copied += chunk.len() as u32;
    }
    let mut p = MAGIC.to_le_bytes().to_vec();
    p.extend(1u16.to_le_bytes());
    p.extend(0u16.to_le_bytes());
    for v in [
        old.len() as u32,
        crc32fast::hash(old),
        new.len() as u32,
        crc32fast::hash(new),
        1,
        0,
        old.len() as u32,
        0,
        new.len() as u32,
    ] {
        p.extend(v.to_le_bytes());
    }
    p.extend_from_slice(b"NoOp");
    p.extend(1u16.to_le_bytes());
    for stream in [src_skip, dst_skip, count, extra, d_skip, d_diff, vec![]] {
        p.extend((stream.len() as u32).to_le_bytes());
        p.extend(stream);
    }
    p.extend(0u32.to_le_bytes());
    p
}

/// `patch` brotli-compressed, as update_engine's generator stores it.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub fn brotli_for_tests(patch: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut w = brotli::CompressorWriter::new(Vec::new(), 4096, 9, 22);
    w.write_all(patch).expect("writing to memory");
    w.into_inner()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn numbers_decode_as_zucchinis_unit_tests_say() {
        let mut s: &[u8] = &[0x54, 0x2f];
        assert_eq!((varint(&mut s), varint(&mut s)), (Some(42), Some(-24)));
        assert_eq!(varint(&mut &[0x0d][..]), Some(-7));
        for bad in [
            &[][..],
            &[0x80; 4],
            &[0x80; 6],
            &[0x80, 0x80, 0x80, 0x80, 0x80, 0x2a],
        ] {
            assert_eq!(varuint(&mut &bad[..]), None, "{bad:02x?}");
        }
        for b in [0x10, 0x20, 0x40] {
            assert_eq!(varuint(&mut &[0x80, 0x80, 0x80, 0x80, b][..]), Some(0));
        }
        let e = equivalences(&[0x06, 0x07], &[0x07, 0x01], &[0x02, 0x01], 16).unwrap();
        let eq = |src, dst, len| Equivalence { src, dst, len };
        assert_eq!(e, [eq(3, 7, 2), eq(1, 10, 1)]);
    }

    /// Zucchini's `EnsemblePatchTest.CheckFile` patch, its element raw (the test's is
    /// Windows x86, compiled out of Android's build).
    fn check_file(extra: &[u8]) -> Vec<u8> {
        let mut p = hex(
            "5a756363 01000000 05000000 df13e410 03000000 dcf70040 01000000
             01000000 02000000 00000000 03000000 4e6f4f70 0100
             00000000 00000000 00000000 03000000",
        );
        p.extend_from_slice(extra);
        p.extend(hex("00000000 00000000 00000000 00000000"));
        p
    }

    #[test]
    fn zucchinis_ensemble_test_patch_checks_both_crcs() {
        let old = [0x10, 0x32, 0x54, 0x76, 0x98];
        assert_eq!(
            apply_patch(&old, &check_file(&[0xba, 0xdc, 0xfe]), 3).unwrap(),
            [0xba, 0xdc, 0xfe]
        );
        assert!(matches!(
            apply_patch(&old, &check_file(b"ABC"), 3),
            Err(ZucchiniError::NewImage(_))
        ));
        let other = [0x10, 0x32, 0x54, 0x76, 0x99];
        assert!(matches!(
            apply_patch(&other, &check_file(&[0xba, 0xdc, 0xfe]), 3),
            Err(ZucchiniError::OldImage(_))
        ));
        // The same with the test's Windows x86 element: refused at its version.
        let mut px86 = check_file(&[0xba, 0xdc, 0xfe]);
        px86[44..48].copy_from_slice(b"Px86");
        assert!(matches!(
            apply_patch(&old, &px86, 3),
            Err(ZucchiniError::Invalid(_))
        ));
        // Zucchini's fuzzer seed `empty.zuc` (an element with an empty old side).
        let empty = hex(
            "5a756363 0100 0000 05000000 df13e410 03000000 dcf70040 01000000
             01000000 00000000 02000000 03000000 01000000 0100",
        );
        let mut empty = empty;
        empty.extend([0u8; 32]);
        assert!(apply_patch(&old, &empty, 3).is_err());
    }

    #[test]
    fn two_raw_elements_copy_fill_and_add() {
        // Two raw elements: a negative source skip, a wrapping difference, an unused
        // pool.
        let p = hex(
            "5a75636301000000100000004dffe8e00c000000c4ff06fa02000000000000001000000000000000\
             080000004e6f4f70010002000000080d0200000001010200000003020300000078797a02000000\
             01020200000001bd00000000000000000a0000000600000008000000040000004e6f4f70010001\
             000000040100000000010000000202000000213f0100000000010000008000000000010000000001\
             00000005",
        );
        let old = b"ABCDEFGHIJKLMNOP";
        let new = apply_patch(old, &p, 12).unwrap();
        assert_eq!(
            new,
            [
                0x78, 0x45, 0x47, 0x47, 0x79, 0x41, 0xff, 0x7a, 0xcd, 0x4e, 0x21, 0x3f
            ]
        );
        // Any changed byte: an error, never a panic.
        for i in 0..p.len() {
            for bit in 0..8 {
                let mut q = p.clone();
                q[i] ^= 1 << bit;
                let _ = apply_patch(old, &q, 12);
            }
        }
    }

    #[test]
    fn a_raw_patch_of_blocks_applies() {
        let old = crate::fuzzing::image(11, 6);
        let mut new = old[4096..].to_vec();
        new.extend_from_slice(&old[..4096]);
        new[100] ^= 0x80;
        new[9000..9010].fill(7);
        new[20_000..20_100].fill(1);
        let p = brotli_for_tests(&raw_patch_for_tests(&old, &new));
        assert_eq!(apply(&old, &p, new.len() as u64).unwrap(), new);
        assert!(apply(&old, &p, new.len() as u64 + 1).is_err());
        assert!(matches!(
            apply(&old[1..], &p, new.len() as u64),
            Err(ZucchiniError::OldImage(_))
        ));
        assert!(apply(&old, &p[..p.len() / 2], new.len() as u64).is_err());
    }

    #[test]
    fn executable_elements_are_named() {
        let mut p = check_file(&[0xba, 0xdc, 0xfe]);
        p[44..48].copy_from_slice(b"EA64");
        let e = apply_patch(&[0x10, 0x32, 0x54, 0x76, 0x98], &p, 3).unwrap_err();
        assert!(e.to_string().contains("ELF AArch64"), "{e}");
    }
}
