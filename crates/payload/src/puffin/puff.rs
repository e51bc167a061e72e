//! Puffing: a deflate stream rewritten as a puff stream, the form puffin's patches
//! are made between (every Huffman code replaced by its symbol, byte-aligned).
//!
//! A puff stream is a sequence of, per deflate block:
//!
//! ```text
//! u16 BE  n - 1, then n bytes of block metadata:
//!         [0]  final << 7 | type << 5 | (stored blocks) the bits skipped to the
//!              byte boundary
//!         dynamic blocks only: HLIT, HDIST, HCLEN (one byte each), the code-length
//!         code's lengths two per byte (high nibble first), then one byte per
//!         code-length symbol: 0..=15 a length, 16 + r (repeat previous, r = 0..=3),
//!         20 + r (zeros, r = 0..=7), 28 + r (zeros, r = 0..=127)
//! then items until the end of the block:
//!   0b0nnnnnnn                literals: n + 1 bytes follow (n < 127), or
//!   0x7f, u16 BE m            m + 128 bytes follow (at most 65663 per run)
//!   0b1lllllll, u16 BE d      a copy of length l + 3 (l < 127), distance d + 1
//!   0xff, k, u16 BE d         a copy of length k + 130 (k < 129)
//!   0xff, 0x81                the end of the block
//! ```
//!
//! What is puffed must be exactly what puffin puffs (the patch was made against it),
//! including how it decodes a symbol with fewer bits left than the longest code.

use super::bits::BitReader;
use super::huffman::{
    DIST_BASE, DIST_EXTRA, Decoder, LENGTH_BASE, LENGTH_EXTRA, PERMUTATION, fixed_lengths,
};
use super::{Invalid, invalid};

/// The most literals one run holds (its length field's range).
const MAX_RUN: usize = (1 << 16) + 127;

/// Writes puff items, bounded by the puff's length.
pub(crate) struct PuffWriter {
    out: Vec<u8>,
    cap: usize,
    /// The open literal run: where its header is, and its length.
    run: Option<(usize, usize)>,
}

impl PuffWriter {
    pub(crate) fn new(cap: usize) -> Self {
        PuffWriter {
            out: Vec::with_capacity(cap.min(1 << 20)),
            cap,
            run: None,
        }
    }

    fn room(&self, n: usize) -> Result<(), Invalid> {
        if self.out.len().saturating_add(n) > self.cap {
            return Err(invalid(format!(
                "the puff is longer than the {} bytes the patch gives it",
                self.cap
            )));
        }
        Ok(())
    }

    pub(crate) fn literal(&mut self, b: u8) -> Result<(), Invalid> {
        let (at, n) = match self.run {
            Some(r) => r,
            None => {
                self.room(1)?;
                self.out.push(0);
                (self.out.len() - 1, 0)
            }
        };
        if n == 127 {
            // The run outgrows the one-byte header: two length bytes after it.
            self.room(2)?;
            self.out.splice(at + 1..at + 1, [0, 0]);
        }
        self.room(1)?;
        self.out.push(b);
        self.run = Some((at, n + 1));
        if n + 1 == MAX_RUN {
            self.end_run();
        }
        Ok(())
    }

    fn end_run(&mut self) {
        if let Some((at, n)) = self.run.take() {
            if n <= 127 {
                self.out[at] = (n - 1) as u8;
            } else {
                self.out[at] = 0x7f;
                self.out[at + 1..at + 3].copy_from_slice(&((n - 128) as u16).to_be_bytes());
            }
        }
    }

    fn item(&mut self, bytes: &[u8]) -> Result<(), Invalid> {
        self.end_run();
        self.room(bytes.len())?;
        self.out.extend_from_slice(bytes);
        Ok(())
    }

    pub(crate) fn copy(&mut self, len: u16, dist: u16) -> Result<(), Invalid> {
        let d = (dist - 1).to_be_bytes();
        if len < 130 {
            self.item(&[0x80 | (len - 3) as u8, d[0], d[1]])
        } else {
            self.item(&[0xff, (len - 130) as u8, d[0], d[1]])
        }
    }

    pub(crate) fn end_of_block(&mut self) -> Result<(), Invalid> {
        self.item(&[0xff, 0x81])
    }

    pub(crate) fn metadata(&mut self, m: &[u8]) -> Result<(), Invalid> {
        self.item(&((m.len() - 1) as u16).to_be_bytes())?;
        self.item(m)
    }

    pub(crate) fn finish(mut self) -> Vec<u8> {
        self.end_run();
        self.out
    }
}

/// Puffs every block from `r`'s position while at least a byte's worth of bits is
/// left (puffin's rule: a deflate extent is as many blocks as its bytes hold), into a
/// puff of at most `cap` bytes. `blocks` receives each block's bit extent relative to
/// the reader's start, when asked.
pub(crate) fn puff(
    r: &mut BitReader<'_>,
    cap: usize,
    mut blocks: Option<&mut Vec<(u64, u64)>>,
) -> Result<Vec<u8>, Invalid> {
    let mut w = PuffWriter::new(cap);
    // The fixed code's tables, made once: a crafted stream can hold a fixed block per
    // few bits.
    let (fixed_ll, fixed_d) = fixed_lengths();
    let fixed = match (Decoder::new(&fixed_ll), Decoder::new(&fixed_d)) {
        (Some(l), Some(d)) => (std::rc::Rc::new(l), std::rc::Rc::new(d)),
        _ => return Err(invalid("fixed code")),
    };
    let short = |what: &str, r: &BitReader<'_>| {
        invalid(format!(
            "the deflate stream ends inside {what} at bit {}",
            r.bit_offset()
        ))
    };
    while r.available() >= 8 {
        let start = r.bit_offset();
        let Some(head) = r.read(3) else {
            return Err(short("a block header", r));
        };
        let (final_bit, kind) = (head & 1, head >> 1);
        let header = ((final_bit << 7) | (kind << 5)) as u8;
        let (ll, dist) = match kind {
            0 => {
                let skipped = r.peek(r.to_boundary());
                r.consume(r.to_boundary());
                let Some(lens) = r.read(32) else {
                    return Err(short("a stored block's length", r));
                };
                let (len, nlen) = (lens & 0xffff, lens >> 16);
                if len ^ nlen != 0xffff {
                    return Err(invalid(format!(
                        "a stored block at bit {start} has length {len} and its \
                         complement {nlen}, which do not match"
                    )));
                }
                w.metadata(&[header | skipped as u8])?;
                let Some(bytes) = r.read_bytes(len as usize) else {
                    return Err(short("a stored block's data", r));
                };
                for &b in bytes {
                    w.literal(b)?;
                }
                w.end_of_block()?;
                if let Some(b) = blocks.as_deref_mut() {
                    b.push((start, r.bit_offset() - start));
                }
                continue;
            }
            1 => {
                w.metadata(&[header])?;
                fixed.clone()
            }
            2 => {
                let mut meta = vec![header];
                let (ll, d) = dynamic_header(r, &mut meta)?;
                w.metadata(&meta)?;
                (std::rc::Rc::new(ll), std::rc::Rc::new(d))
            }
            _ => {
                return Err(invalid(format!(
                    "the block at bit {start} has the reserved type 3"
                )));
            }
        };
        loop {
            // Near the end of the data, puffin looks only as far as the end-of-block
            // code's length: decoded the same way here, or the source puffs
            // differently from the one the patch was made against.
            let want = if r.available() >= u64::from(ll.max_bits) {
                ll.max_bits
            } else {
                u32::from(ll.lens.get(256).copied().unwrap_or(0))
            };
            if r.available() < u64::from(want) {
                return Err(short("a block", r));
            }
            let (sym, n) = ll.decode(r.peek(want)).ok_or_else(|| {
                invalid(format!(
                    "no literal/length code matches the bits at bit {}",
                    r.bit_offset()
                ))
            })?;
            if r.available() < u64::from(n) {
                return Err(short("a code", r));
            }
            r.consume(n);
            match sym {
                0..=255 => w.literal(sym as u8)?,
                256 => {
                    w.end_of_block()?;
                    if let Some(b) = blocks.as_deref_mut() {
                        b.push((start, r.bit_offset() - start));
                    }
                    break;
                }
                257..=285 => {
                    let i = usize::from(sym - 257);
                    let extra = r
                        .read(u32::from(LENGTH_EXTRA[i]))
                        .ok_or_else(|| short("a length", r))?;
                    let len = LENGTH_BASE[i] + extra as u16;
                    if r.available() < u64::from(dist.max_bits) {
                        return Err(short("a distance", r));
                    }
                    let (dsym, dn) = dist.decode(r.peek(dist.max_bits)).ok_or_else(|| {
                        invalid(format!(
                            "no distance code matches the bits at bit {}",
                            r.bit_offset()
                        ))
                    })?;
                    r.consume(dn);
                    let j = usize::from(dsym);
                    let (Some(&base), Some(&extra_bits)) = (DIST_BASE.get(j), DIST_EXTRA.get(j))
                    else {
                        return Err(invalid(format!("distance symbol {dsym} is invalid")));
                    };
                    let extra = r
                        .read(u32::from(extra_bits))
                        .ok_or_else(|| short("a distance", r))?;
                    w.copy(len, base + extra as u16)?;
                }
                _ => {
                    return Err(invalid(format!(
                        "literal/length symbol {sym} before bit {} is invalid",
                        r.bit_offset()
                    )));
                }
            }
        }
    }
    Ok(w.finish())
}

/// Reads a dynamic block's code definitions, appending their puffed form to `meta`.
fn dynamic_header(
    r: &mut BitReader<'_>,
    meta: &mut Vec<u8>,
) -> Result<(Decoder, Decoder), Invalid> {
    let at = r.bit_offset();
    let bad = |what: String| invalid(format!("the dynamic block header at bit {at}: {what}"));
    let Some(h) = r.read(14) else {
        return Err(bad("it is cut short".into()));
    };
    let (hlit, hdist, hclen) = (h & 0x1f, (h >> 5) & 0x1f, h >> 10);
    let (n_ll, n_d, n_c) = (hlit as usize + 257, hdist as usize + 1, hclen as usize + 4);
    if n_ll > 286 || n_d > 30 {
        return Err(bad(format!(
            "{n_ll} literal/length and {n_d} distance codes"
        )));
    }
    meta.extend([hlit as u8, hdist as u8, hclen as u8]);
    let mut code_lens = [0u8; 19];
    for i in 0..n_c {
        let l = r.read(3).ok_or_else(|| bad("it is cut short".into()))? as u8;
        code_lens[PERMUTATION[i]] = l;
        if i % 2 == 0 {
            meta.push(l << 4);
        } else if let Some(last) = meta.last_mut() {
            *last |= l;
        }
    }
    let codes =
        Decoder::new(&code_lens).ok_or_else(|| bad("its code-length code is invalid".into()))?;
    let mut lens: Vec<u8> = Vec::with_capacity(n_ll + n_d);
    while lens.len() < n_ll + n_d {
        if r.available() < u64::from(codes.max_bits) {
            return Err(bad("it is cut short".into()));
        }
        let (sym, n) = codes.decode(r.peek(codes.max_bits)).ok_or_else(|| {
            bad(format!(
                "no code-length code matches at bit {}",
                r.bit_offset()
            ))
        })?;
        r.consume(n);
        let (count, value, extra_bits, puffed) = match sym {
            0..=15 => {
                lens.push(sym as u8);
                meta.push(sym as u8);
                continue;
            }
            16 => {
                let Some(&prev) = lens.last() else {
                    return Err(bad("it repeats a length before the first".into()));
                };
                (3, prev, 2, 16u8)
            }
            17 => (3, 0, 3, 20),
            18 => (11, 0, 7, 28),
            _ => return Err(bad(format!("code-length symbol {sym}"))),
        };
        let extra = r
            .read(extra_bits)
            .ok_or_else(|| bad("it is cut short".into()))?;
        meta.push(puffed + extra as u8);
        lens.extend(std::iter::repeat_n(value, count + extra as usize));
    }
    if lens.len() != n_ll + n_d {
        return Err(bad(format!(
            "its lengths run past the {} codes it declares",
            n_ll + n_d
        )));
    }
    let ll = Decoder::new(&lens[..n_ll])
        .ok_or_else(|| bad("its literal/length code is invalid".into()))?;
    let d =
        Decoder::new(&lens[n_ll..]).ok_or_else(|| bad("its distance code is invalid".into()))?;
    Ok((ll, d))
}
