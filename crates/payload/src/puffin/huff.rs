//! Huffing: a puff stream (the format in [`puff`](super::puff)) written back as
//! deflate, with the codes its block metadata defines. Canonical codes make this
//! deterministic: the deflate puffin writes from a puff is the one written here.

use super::bits::BitWriter;
use super::huffman::{DIST_BASE, DIST_EXTRA, Encoder, LENGTH_BASE, LENGTH_EXTRA, PERMUTATION};
use super::{Invalid, invalid};

/// One item of a puff stream.
enum Item<'a> {
    Metadata(&'a [u8]),
    Literals(&'a [u8]),
    Copy { len: u16, dist: u16 },
    End,
}

/// Reads a puff's items, every length checked against what is left.
struct PuffReader<'a> {
    buf: &'a [u8],
    at: usize,
    in_block: bool,
}

impl<'a> PuffReader<'a> {
    fn left(&self) -> usize {
        self.buf.len() - self.at
    }

    fn short(&self, what: &str) -> Invalid {
        invalid(format!(
            "the puff stream ends inside {what} at byte {}",
            self.at
        ))
    }

    fn next(&mut self) -> Result<Item<'a>, Invalid> {
        let b = &self.buf;
        if !self.in_block {
            // A block's metadata: its length, then at least one byte.
            if self.at + 2 >= b.len() {
                return Err(self.short("block metadata"));
            }
            let n = usize::from(u16::from_be_bytes([b[self.at], b[self.at + 1]])) + 1;
            self.at += 2;
            if n > 1 + 3 + 286 + 30 + 19 || self.at + n > b.len() {
                return Err(invalid(format!(
                    "block metadata of {n} bytes at byte {}",
                    self.at - 2
                )));
            }
            let m = &b[self.at..self.at + n];
            self.at += n;
            self.in_block = true;
            return Ok(Item::Metadata(m));
        }
        let Some(&h) = b.get(self.at) else {
            return Err(self.short("a block"));
        };
        if h & 0x80 != 0 {
            let mut len = usize::from(h & 0x7f);
            if len == 127 {
                self.at += 1;
                len = usize::from(*b.get(self.at).ok_or_else(|| self.short("a copy"))?) + 127;
            }
            len += 3;
            if len > 259 {
                return Err(invalid(format!(
                    "a copy of length {len} at byte {}",
                    self.at
                )));
            }
            self.at += 1;
            if len == 259 {
                self.in_block = false;
                return Ok(Item::End);
            }
            if self.at + 1 >= b.len() {
                return Err(self.short("a copy"));
            }
            let d = u16::from_be_bytes([b[self.at], b[self.at + 1]]);
            if d >= 1 << 15 {
                return Err(invalid(format!(
                    "a copy distance of {} at byte {}",
                    d as u32 + 1,
                    self.at
                )));
            }
            self.at += 2;
            Ok(Item::Copy {
                len: len as u16,
                dist: d + 1,
            })
        } else {
            let mut n = usize::from(h);
            self.at += 1;
            if n == 127 {
                if self.at + 1 >= b.len() {
                    return Err(self.short("a literal run"));
                }
                n = usize::from(u16::from_be_bytes([b[self.at], b[self.at + 1]])) + 127;
                self.at += 2;
            }
            n += 1;
            if self.at + n > b.len() {
                return Err(self.short("a literal run"));
            }
            let s = &b[self.at..self.at + n];
            self.at += n;
            Ok(Item::Literals(s))
        }
    }
}

/// Writes the deflate stream of `puff` to `w` and pads its last byte.
pub(crate) fn huff(puff: &[u8], w: &mut BitWriter) -> Result<(), Invalid> {
    let full = |_| invalid("the deflate stream is longer than the patch gives it");
    let mut r = PuffReader {
        buf: puff,
        at: 0,
        in_block: false,
    };
    // The fixed code, made once: a crafted puff can hold a fixed block per few bits.
    let fixed = fixed_encoders()?;
    while r.left() != 0 {
        let Item::Metadata(meta) = r.next()? else {
            return Err(invalid(format!(
                "a block does not start with metadata at byte {}",
                r.at
            )));
        };
        let header = u32::from(meta[0]);
        w.write(1, header >> 7).map_err(full)?;
        w.write(2, (header >> 5) & 3).map_err(full)?;
        let (ll, dist) = match (header >> 5) & 3 {
            0 => {
                w.write_boundary(header & 0x1f).map_err(full)?;
                match r.next()? {
                    Item::Literals(s) => {
                        let n = s.len() as u32;
                        w.write(16, n).map_err(full)?;
                        w.write(16, !n).map_err(full)?;
                        w.write_bytes(s).map_err(full)?;
                        if !matches!(r.next()?, Item::End) {
                            return Err(invalid(format!(
                                "a stored block does not end after its data at byte {}",
                                r.at
                            )));
                        }
                    }
                    Item::End => {
                        w.write(16, 0).map_err(full)?;
                        w.write(16, 0xffff).map_err(full)?;
                    }
                    _ => {
                        return Err(invalid(format!(
                            "a stored block holds a copy or metadata at byte {}",
                            r.at
                        )));
                    }
                }
                continue;
            }
            1 => fixed.clone(),
            2 => {
                let (l, d) = dynamic_header(&meta[1..], w)?;
                (std::rc::Rc::new(l), std::rc::Rc::new(d))
            }
            _ => return Err(invalid(format!("a block of type 3 at byte {}", r.at))),
        };
        let put = |w: &mut BitWriter, e: &Encoder, sym: usize| -> Result<(), Invalid> {
            let (code, n) = e
                .code(sym)
                .ok_or_else(|| invalid(format!("symbol {sym} is outside the block's code")))?;
            w.write(n, code).map_err(full)
        };
        loop {
            match r.next()? {
                Item::Literals(s) => {
                    for &b in s {
                        put(w, &ll, usize::from(b))?;
                    }
                }
                Item::Copy { len, dist: d } => {
                    let i = bucket(&LENGTH_BASE, len);
                    put(w, &ll, 257 + i)?;
                    w.write(u32::from(LENGTH_EXTRA[i]), u32::from(len - LENGTH_BASE[i]))
                        .map_err(full)?;
                    let j = bucket(&DIST_BASE, d);
                    put(w, &dist, j)?;
                    w.write(u32::from(DIST_EXTRA[j]), u32::from(d - DIST_BASE[j]))
                        .map_err(full)?;
                }
                Item::End => {
                    put(w, &ll, 256)?;
                    break;
                }
                Item::Metadata(_) => {
                    return Err(invalid(format!(
                        "block metadata inside a block at byte {}",
                        r.at
                    )));
                }
            }
        }
    }
    w.flush().map_err(full)
}

type Codes = (std::rc::Rc<Encoder>, std::rc::Rc<Encoder>);

fn fixed_encoders() -> Result<Codes, Invalid> {
    let (l, d) = super::huffman::fixed_lengths();
    let enc = |lens: &[u8]| {
        Encoder::new(lens)
            .map(std::rc::Rc::new)
            .ok_or_else(|| invalid("fixed code"))
    };
    Ok((enc(&l)?, enc(&d)?))
}

/// The last entry of `bases` not above `v` (bases ascend; `v` is at least the first).
fn bucket(bases: &[u16], v: u16) -> usize {
    bases.partition_point(|&b| b <= v).saturating_sub(1)
}

/// Writes a dynamic block's header from its puffed form `m` (without the header byte)
/// and returns the block's codes.
fn dynamic_header(m: &[u8], w: &mut BitWriter) -> Result<(Encoder, Encoder), Invalid> {
    let full = |_| invalid("the deflate stream is longer than the patch gives it");
    let bad = |what: &str| invalid(format!("dynamic block metadata: {what}"));
    if m.len() < 3 {
        return Err(bad("shorter than its three counts"));
    }
    let (n_ll, n_d, n_c) = (
        usize::from(m[0]) + 257,
        usize::from(m[1]) + 1,
        usize::from(m[2]) + 4,
    );
    w.write(5, u32::from(m[0])).map_err(full)?;
    w.write(5, u32::from(m[1])).map_err(full)?;
    w.write(4, u32::from(m[2])).map_err(full)?;
    if n_ll > 286 || n_d > 30 || n_c > 19 {
        return Err(bad("its counts are out of range"));
    }
    let mut at = 3;
    if m.len() - at < n_c.div_ceil(2) {
        return Err(bad("it is cut short"));
    }
    let mut code_lens = [0u8; 19];
    for (i, &p) in PERMUTATION.iter().enumerate().take(n_c) {
        let l = if i % 2 == 0 { m[at] >> 4 } else { m[at] & 0x0f };
        if i % 2 == 1 {
            at += 1;
        }
        code_lens[p] = l;
        w.write(3, u32::from(l)).map_err(full)?;
    }
    if n_c % 2 == 1 {
        at += 1;
    }
    let codes = Encoder::new(&code_lens).ok_or_else(|| bad("its code-length code is invalid"))?;
    let mut lens: Vec<u8> = Vec::with_capacity(n_ll + n_d);
    while lens.len() < n_ll + n_d {
        let Some(&p) = m.get(at) else {
            return Err(bad("it is cut short"));
        };
        at += 1;
        if p > 155 {
            return Err(bad("a code-length symbol is out of range"));
        }
        let sym = match p {
            0..=15 => usize::from(p),
            16..=19 => 16,
            20..=27 => 17,
            _ => 18,
        };
        let (code, n) = codes
            .code(sym)
            .ok_or_else(|| bad("a code-length symbol is out of range"))?;
        w.write(n, code).map_err(full)?;
        let (count, value, extra_bits, extra) = match sym {
            0..=15 => {
                lens.push(p);
                continue;
            }
            16 => {
                let prev = *lens
                    .last()
                    .ok_or_else(|| bad("it repeats a length before the first"))?;
                (3 + p - 16, prev, 2, p - 16)
            }
            17 => (3 + p - 20, 0, 3, p - 20),
            _ => (11 + p - 28, 0, 7, p - 28),
        };
        w.write(extra_bits, u32::from(extra)).map_err(full)?;
        lens.extend(std::iter::repeat_n(value, usize::from(count)));
    }
    if lens.len() != n_ll + n_d || at != m.len() {
        return Err(bad("its lengths do not match its counts"));
    }
    let ll =
        Encoder::new(&lens[..n_ll]).ok_or_else(|| bad("its literal/length code is invalid"))?;
    let d = Encoder::new(&lens[n_ll..]).ok_or_else(|| bad("its distance code is invalid"))?;
    Ok((ll, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_deflates() {
        assert_eq!(bucket(&LENGTH_BASE, 3), 0);
        assert_eq!(bucket(&LENGTH_BASE, 12), 8);
        assert_eq!(bucket(&LENGTH_BASE, 257), 27);
        assert_eq!(bucket(&LENGTH_BASE, 258), 28);
        assert_eq!(bucket(&DIST_BASE, 1), 0);
        assert_eq!(bucket(&DIST_BASE, 6), 4);
        assert_eq!(bucket(&DIST_BASE, 32768), 29);
    }
}
