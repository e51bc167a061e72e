//! A whole stream (a file's bytes, with deflate streams at given bit extents) and its
//! puffed form (each deflate replaced by its puff at given byte extents, the bytes
//! between kept), converted both ways.
//!
//! Between two deflates the puffed form holds the bytes in between; a byte a deflate
//! ends or starts inside holds only its bits outside the deflates, shifted down. When
//! one deflate ends and the next starts at the same unaligned bit, that byte is not in
//! the puffed form at all. The conversions follow puffin's stream (`PuffinStream`)
//! position by position, so that a puffed form made by puffin's generator converts
//! back to the same bytes here, and the same source puffs to the same puffed form.

use super::bits::{BitReader, BitWriter};
use super::{Invalid, huff::huff, invalid, puff::puff};

/// A stream's deflates (bit extents) and puffs (byte extents) as a patch header gives
/// them, each list ending with an empty entry at the stream's end.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    deflates: Vec<(u64, u64)>,
    puffs: Vec<(u64, u64)>,
    puff_size: u64,
    /// The stream's size in its deflated form.
    pub(crate) deflated_size: u64,
}

fn end(e: (u64, u64)) -> Option<u64> {
    e.0.checked_add(e.1)
}

impl Layout {
    /// Checks the extents (as many deflates as puffs, each list sorted and disjoint,
    /// the puffs inside `puff_size`).
    pub(crate) fn new(
        deflates: &[(u64, u64)],
        puffs: &[(u64, u64)],
        puff_size: u64,
    ) -> Result<Layout, Invalid> {
        if deflates.len() != puffs.len() {
            return Err(invalid(format!(
                "{} deflates but {} puffs",
                deflates.len(),
                puffs.len()
            )));
        }
        for (what, list) in [("deflate", deflates), ("puff", puffs)] {
            for (i, e) in list.iter().enumerate() {
                let e_end = end(*e).ok_or_else(|| invalid(format!("{what} {i} overflows")))?;
                if list.get(i + 1).is_some_and(|n| n.0 < e_end) {
                    return Err(invalid(format!(
                        "{what} {i} overlaps the next or they are out of order"
                    )));
                }
            }
        }
        let deflated_size = match (deflates.last(), puffs.last()) {
            (Some(&d), Some(&p)) => {
                let p_end = end(p).unwrap_or(u64::MAX);
                if puff_size < p_end {
                    return Err(invalid(format!(
                        "the last puff ends at {p_end}, past the puffed size {puff_size}"
                    )));
                }
                (end(d).unwrap_or(u64::MAX) / 8)
                    .checked_add(puff_size - p_end)
                    .ok_or_else(|| invalid("the deflated size overflows"))?
            }
            _ => puff_size,
        };
        let mut deflates = deflates.to_vec();
        let mut puffs = puffs.to_vec();
        deflates.push((
            deflated_size
                .checked_mul(8)
                .ok_or_else(|| invalid("the deflated size overflows"))?,
            0,
        ));
        puffs.push((puff_size, 0));
        Ok(Layout {
            deflates,
            puffs,
            puff_size,
            deflated_size,
        })
    }

    pub(crate) fn puff_size(&self) -> u64 {
        self.puff_size
    }

    /// The puffs, without the end's empty one.
    #[cfg(test)]
    pub(crate) fn puffs_for_tests(&self) -> Vec<(u64, u64)> {
        self.puffs[..self.puffs.len() - 1].to_vec()
    }

    /// Where the stream's start is, in puffin's terms: the first puff not ending at
    /// 0, the puffed position and the deflated bit position.
    fn start(&self) -> Result<(usize, u64, u64), Invalid> {
        let last = self.puffs.len() - 1;
        let i = (0..last)
            .find(|&i| end(self.puffs[i]).is_some_and(|e| e > 0))
            .unwrap_or(last);
        let (p, d) = (self.puffs[i], self.deflates[i]);
        if p.0 == 0 {
            return Ok((i, 0, d.0));
        }
        let mut bit =
            d.0.div_ceil(8)
                .checked_sub(p.0)
                .ok_or_else(|| invalid("the first puff starts past its deflate"))?
                * 8;
        if let Some(prev) = i.checked_sub(1).map(|j| self.deflates[j]) {
            bit = bit.max(end(prev).unwrap_or(u64::MAX));
        }
        Ok((i, 0, bit))
    }
}

fn byte_range(src: &[u8], from: u64, to: u64) -> Result<&[u8], Invalid> {
    usize::try_from(from)
        .ok()
        .zip(usize::try_from(to).ok())
        .and_then(|(f, t)| src.get(f..t))
        .ok_or_else(|| {
            invalid(format!(
                "bytes {from}..{to} are outside the {} bytes of the source",
                src.len()
            ))
        })
}

/// The puffed form of `src`.
pub(crate) fn puff_stream(src: &[u8], l: &Layout) -> Result<Vec<u8>, Invalid> {
    let total = usize::try_from(l.puff_size).map_err(|_| invalid("puffed size"))?;
    // Grown as puffing backs it, not reserved as the header claims.
    let mut out = Vec::with_capacity(total.min(64 << 20));
    let (mut i, mut puff_pos, mut bit) = l.start()?;
    while out.len() < total {
        let (p, d) = (l.puffs[i], l.deflates[i]);
        if puff_pos < p.0 {
            // Bytes between deflates; the first may hold the end of the last deflate
            // and the last the start of the next: their bits are masked out.
            let first = bit / 8;
            let last = d.0.div_ceil(8);
            let n = (total - out.len()) as u64;
            let n = n.min(
                last.checked_sub(first)
                    .ok_or_else(|| invalid("extents out of order"))?,
            );
            if n == 0 {
                return Err(invalid(format!(
                    "puffed bytes {puff_pos}..{} have no bytes between deflates to hold",
                    p.0
                )));
            }
            let at = out.len();
            out.extend_from_slice(byte_range(src, first, first + n)?);
            if (first + n) * 8 > d.0 {
                out[at + n as usize - 1] &= ((1u32 << (d.0 % 8)) - 1) as u8;
            }
            if first * 8 < bit {
                out[at] >>= bit % 8;
            }
            bit = (bit - bit % 8 + n * 8).min(d.0);
            puff_pos += n;
            if puff_pos > p.0 {
                return Err(invalid(format!(
                    "the bytes before puff {i} run past its start {}",
                    p.0
                )));
            }
        } else {
            let (first, last) = (d.0 / 8, end(d).unwrap_or(u64::MAX).div_ceil(8));
            let bytes = byte_range(src, first, last)?;
            let mut r = BitReader::new(bytes);
            r.consume((d.0 % 8) as u32);
            let cap = usize::try_from(p.1).map_err(|_| invalid("puff size"))?;
            let puffed = puff(&mut r, cap, None).map_err(|e| {
                invalid(format!(
                    "the deflate at source bit {} does not puff: {e}",
                    d.0
                ))
            })?;
            if r.bytes_touched() != last - first || puffed.len() != cap {
                return Err(invalid(format!(
                    "the deflate at source bit {} is {} bytes and puffs to {} bytes, not the \
                     {} and {cap} the patch says",
                    d.0,
                    r.bytes_touched(),
                    puffed.len(),
                    last - first
                )));
            }
            let n = cap.min(total - out.len());
            out.extend_from_slice(&puffed[..n]);
            if n < cap {
                break;
            }
            puff_pos += p.1;
            bit = end(d).unwrap_or(u64::MAX);
            i += 1;
            if i == l.puffs.len() {
                break;
            }
        }
    }
    if out.len() != total {
        return Err(invalid(format!(
            "the source puffs to {} bytes, not {total}",
            out.len()
        )));
    }
    Ok(out)
}

/// The deflated form of the puffed stream `puffed`, at most `max` bytes.
pub(crate) fn huff_stream(puffed: &[u8], l: &Layout, max: u64) -> Result<Vec<u8>, Invalid> {
    if puffed.len() as u64 != l.puff_size {
        return Err(invalid(format!(
            "the patch makes {} puffed bytes, its header says {}",
            puffed.len(),
            l.puff_size
        )));
    }
    if l.deflated_size > max {
        return Err(invalid(format!(
            "the deflated stream would be {} bytes, more than the {max} the operation writes",
            l.deflated_size
        )));
    }
    let mut out: Vec<u8> = Vec::with_capacity((l.deflated_size as usize).min(64 << 20));
    let (mut i, mut puff_pos, mut bit) = l.start()?;
    let n = l.puffs.len();
    // Whether the byte after a puff holds the bits after its deflate (the next
    // deflate does not start inside that byte).
    let extra_byte = |i: usize| -> u64 {
        if i + 1 == n {
            return 0;
        }
        let e = end(l.deflates[i]).unwrap_or(u64::MAX);
        u64::from(!e.is_multiple_of(8) && e.div_ceil(8) * 8 <= l.deflates[i + 1].0)
    };
    let mut extra = extra_byte(i);
    let mut last_byte = 0u8;
    let mut buf: Vec<u8> = Vec::new();
    let mut at = 0usize;
    while at < puffed.len() {
        let (p, d) = (l.puffs[i], l.deflates[i]);
        if bit < d.0 & !7 {
            if bit % 8 != 0 {
                return Err(invalid(format!("puff {i} is not after a whole byte")));
            }
            let k = ((d.0 / 8 - bit / 8) as usize).min(puffed.len() - at);
            out.extend_from_slice(&puffed[at..at + k]);
            at += k;
            puff_pos += k as u64;
            bit += k as u64 * 8;
        } else {
            if bit < d.0 {
                // The byte the deflate starts inside: its bits before the deflate.
                last_byte |= (u32::from(puffed[at]) << (bit % 8)) as u8;
                at += 1;
                buf.clear();
                bit = d.0;
                puff_pos += 1;
                if puff_pos != p.0 {
                    return Err(invalid(format!(
                        "puff {i} starts at {}, not after the byte before it",
                        p.0
                    )));
                }
            }
            let want = (p.1 + extra) as usize;
            let k = (want - buf.len()).min(puffed.len() - at);
            buf.extend_from_slice(&puffed[at..at + k]);
            at += k;
            if buf.len() < want {
                continue;
            }
            let (first, last) = (d.0 / 8, end(d).unwrap_or(u64::MAX).div_ceil(8));
            let size = usize::try_from(last - first).map_err(|_| invalid("deflate size"))?;
            if size == 0 {
                return Err(invalid(format!("deflate {i} is empty")));
            }
            let mut w = BitWriter::new(size);
            w.write((d.0 % 8) as u32, u32::from(last_byte))
                .map_err(|_| invalid("deflate size"))?;
            last_byte = 0;
            huff(&buf[..p.1 as usize], &mut w)
                .map_err(|e| invalid(format!("puff {i} does not huff: {e}")))?;
            if w.len() != size {
                return Err(invalid(format!(
                    "puff {i} huffs to {} bytes, not the {size} of its deflate",
                    w.len()
                )));
            }
            let mut bytes = w.into_bytes();
            bit = end(d).unwrap_or(u64::MAX);
            if extra == 1 {
                bytes[size - 1] |= (u32::from(buf[p.1 as usize]) << (bit % 8)) as u8;
                bit = bit.div_ceil(8) * 8;
            } else if bit % 8 != 0 {
                // The next deflate starts inside this byte: it is written with it.
                last_byte = bytes[size - 1];
                bytes.pop();
            }
            out.extend_from_slice(&bytes);
            puff_pos += buf.len() as u64;
            buf.clear();
            i += 1;
            if i == n {
                break;
            }
            extra = extra_byte(i);
        }
    }
    if at != puffed.len() {
        return Err(invalid("puffed bytes are left after the last puff"));
    }
    // Puffin would stop short where the extents are inconsistent; a patch that makes
    // fewer bytes than its header says is refused instead.
    if out.len() as u64 != l.deflated_size {
        return Err(invalid(format!(
            "the puffed stream huffs to {} bytes, the patch says {}",
            out.len(),
            l.deflated_size
        )));
    }
    Ok(out)
}

#[cfg(test)]
/// Where the puffs of `deflates` in `src` lie in its puffed form, and that form's
/// size (puffin's `FindPuffLocations`): the layout a patch generator writes.
pub(crate) fn locate_puffs(src: &[u8], deflates: &[(u64, u64)]) -> Result<Layout, Invalid> {
    let mut puffs = Vec::with_capacity(deflates.len());
    let mut diff: i64 = 0;
    for (i, &d) in deflates.iter().enumerate() {
        let (first, last) = (d.0 / 8, end(d).unwrap_or(u64::MAX).div_ceil(8));
        let bytes = byte_range(src, first, last)?;
        let mut r = BitReader::new(bytes);
        r.consume((d.0 % 8) as u32);
        let puffed = puff(&mut r, usize::MAX, None)?;
        if r.bytes_touched() != last - first {
            return Err(invalid(format!("deflate {i} does not end where it says")));
        }
        let gap = i64::from(i > 0 && end(deflates[i - 1]) == Some(d.0) && !d.0.is_multiple_of(8));
        let deflate_bytes = (end(d).unwrap_or(u64::MAX) / 8) as i64 - d.0.div_ceil(8) as i64;
        let at = d.0.div_ceil(8) as i64 - gap + diff;
        puffs.push((at as u64, puffed.len() as u64));
        diff += puffed.len() as i64 - deflate_bytes - gap;
    }
    let size = src.len() as i64 + diff;
    if size < 0 {
        return Err(invalid("the puffed size is negative"));
    }
    Layout::new(deflates, &puffs, size as u64)
}
