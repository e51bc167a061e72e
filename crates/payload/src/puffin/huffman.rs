//! Deflate's Huffman codes (RFC 1951 §3.2): canonical codes from code lengths, a
//! table to decode them and the bit-reversed codes to write them.

/// The order the code-length code's lengths are stored in.
pub(crate) const PERMUTATION: [usize; 19] = [
    16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15,
];

/// Base length of length symbols 257..=285, and their extra bits.
pub(crate) const LENGTH_BASE: [u16; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
pub(crate) const LENGTH_EXTRA: [u8; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];
/// Base distance of distance symbols 0..=29, and their extra bits.
pub(crate) const DIST_BASE: [u16; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537,
    2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577,
];
pub(crate) const DIST_EXTRA: [u8; 30] = [
    0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13,
    13,
];

/// The fixed code's lengths (RFC 1951 §3.2.6): 288 literal/length, 30 distance.
pub(crate) fn fixed_lengths() -> (Vec<u8>, Vec<u8>) {
    let mut ll = vec![8u8; 288];
    ll[144..256].fill(9);
    ll[256..280].fill(7);
    (ll, vec![5u8; 30])
}

/// Bit-reversed canonical codes of `lens` (0: no code) and the longest length.
/// Lengths that claim more codes of one length than it has are refused; an
/// oversubscribed set otherwise gets codes by the canonical rule in 16-bit arithmetic,
/// as puffin's encoder does (a decoder refuses it).
pub(crate) fn reversed_codes(lens: &[u8]) -> Option<(Vec<u16>, u32)> {
    let mut count = [0u16; 16];
    for &l in lens {
        *count.get_mut(usize::from(l))? += 1;
    }
    let max = (1..16).rev().find(|&l| count[l] != 0).unwrap_or(0);
    if (1..=max).any(|l| u32::from(count[l]) > 1u32 << l) {
        return None;
    }
    count[0] = 0;
    let mut next = [0u16; 16];
    let mut code = 0u16;
    for bits in 1..16 {
        code = code.wrapping_add(count[bits - 1]) << 1;
        next[bits] = code;
    }
    let codes = lens
        .iter()
        .map(|&l| {
            if l == 0 {
                return 0;
            }
            let c = next[usize::from(l)];
            next[usize::from(l)] = c.wrapping_add(1);
            reverse(c, u32::from(l))
        })
        .collect();
    Some((codes, max as u32))
}

fn reverse(code: u16, len: u32) -> u16 {
    code.reverse_bits() >> (16 - len)
}

/// Codes of at most this many bits decode by one table lookup; longer ones by
/// walking the canonical code. The table costs its size to build for every dynamic
/// block, and a crafted stream can hold a block per few bytes: 2^10 entries keep
/// that small where 2^15 (the longest code) would not.
const PRIMARY: u32 = 10;

/// Decodes a canonical code: the next bits of the stream give the symbol whose code
/// they start with.
pub(crate) struct Decoder {
    /// Symbol + 1 (0: no code of at most `PRIMARY` bits starts so).
    table: Vec<u16>,
    /// Codes of each length.
    count: [u16; 16],
    /// Symbols in canonical order (by code length, then symbol).
    sorted: Vec<u16>,
    pub(crate) lens: Vec<u8>,
    pub(crate) max_bits: u32,
}

impl Decoder {
    /// The decoder of `lens`; `None` if they are oversubscribed (no valid deflate
    /// stream has such a code). An incomplete code is accepted; its unused bit
    /// patterns decode to nothing.
    pub(crate) fn new(lens: &[u8]) -> Option<Decoder> {
        let mut kraft = 0u32;
        let mut count = [0u16; 16];
        for &l in lens {
            if l > 15 {
                return None;
            }
            if l > 0 {
                kraft += 1 << (15 - l);
                count[usize::from(l)] += 1;
            }
        }
        if kraft > 1 << 15 {
            return None;
        }
        let (codes, max_bits) = reversed_codes(lens)?;
        let p = max_bits.min(PRIMARY);
        let mut table = vec![0u16; 1 << p];
        for (sym, (&l, &c)) in lens.iter().zip(&codes).enumerate() {
            if l == 0 || u32::from(l) > p {
                continue;
            }
            let step = 1usize << l;
            let mut i = usize::from(c);
            while i < table.len() {
                table[i] = sym as u16 + 1;
                i += step;
            }
        }
        let mut offset = [0usize; 16];
        for l in 1..15 {
            offset[l + 1] = offset[l] + usize::from(count[l]);
        }
        let mut sorted = vec![0u16; lens.iter().filter(|&&l| l > 0).count()];
        for (sym, &l) in lens.iter().enumerate() {
            if l > 0 {
                sorted[offset[usize::from(l)]] = sym as u16;
                offset[usize::from(l)] += 1;
            }
        }
        Some(Decoder {
            table,
            count,
            sorted,
            lens: lens.to_vec(),
            max_bits,
        })
    }

    /// The symbol `bits` (the next `max_bits` bits or fewer, zero-extended, first
    /// bit lowest) start with, and its code's length.
    pub(crate) fn decode(&self, bits: u32) -> Option<(u16, u32)> {
        let mask = self.table.len() as u32 - 1;
        if let Some(sym) = self.table[(bits & mask) as usize].checked_sub(1) {
            return Some((sym, u32::from(self.lens[usize::from(sym)])));
        }
        // A longer code, or none: the canonical walk (codes of one length are
        // consecutive numbers, each length's first following the last one's).
        let (mut code, mut first, mut index) = (0i32, 0i32, 0usize);
        for len in 1..=self.max_bits {
            code |= ((bits >> (len - 1)) & 1) as i32;
            let n = i32::from(self.count[len as usize]);
            if code - first < n {
                let sym = self.sorted[index + (code - first) as usize];
                return Some((sym, len));
            }
            index += n as usize;
            first = (first + n) << 1;
            code <<= 1;
        }
        None
    }
}

/// Codes to write symbols with: reversed code and length per symbol.
pub(crate) struct Encoder {
    codes: Vec<u16>,
    lens: Vec<u8>,
}

impl Encoder {
    pub(crate) fn new(lens: &[u8]) -> Option<Encoder> {
        let (codes, _) = reversed_codes(lens)?;
        Some(Encoder {
            codes,
            lens: lens.to_vec(),
        })
    }

    /// `sym`'s code and length; a symbol the table has no length for is written with
    /// no bits, as puffin does.
    pub(crate) fn code(&self, sym: usize) -> Option<(u32, u32)> {
        Some((
            u32::from(*self.codes.get(sym)?),
            u32::from(*self.lens.get(sym)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_codes_are_rfc_1951s() {
        let (ll, _) = fixed_lengths();
        let (codes, max) = reversed_codes(&ll).unwrap();
        assert_eq!(max, 9);
        // 0 -> 00110000 (8 bits), 144 -> 110010000 (9), 256 -> 0000000 (7), 280 -> 11000000.
        assert_eq!(codes[0], reverse(0b0011_0000, 8));
        assert_eq!(codes[144], reverse(0b1_1001_0000, 9));
        assert_eq!(codes[256], 0);
        assert_eq!(codes[280], reverse(0b1100_0000, 8));
        let d = Decoder::new(&ll).unwrap();
        for (sym, (&c, &l)) in codes.iter().zip(&ll).enumerate() {
            // Any bits past the code decode the same symbol.
            let bits = u32::from(c) | (0b1_0110_1101 << l) & 0x1ff;
            assert_eq!(d.decode(bits), Some((sym as u16, u32::from(l))));
        }
    }

    #[test]
    fn long_codes_decode_past_the_table() {
        // A code with lengths 1..=15 (and two of 15): every symbol decodes from its
        // code followed by any bits, short codes by the table, long ones by the walk.
        let mut lens: Vec<u8> = (1..=15).collect();
        lens.push(15);
        let d = Decoder::new(&lens).unwrap();
        let (codes, max) = reversed_codes(&lens).unwrap();
        assert_eq!(max, 15);
        for (sym, (&c, &l)) in codes.iter().zip(&lens).enumerate() {
            for junk in [0u32, 0x7fff, 0x2aaa] {
                let bits = (u32::from(c) | (junk << l)) & 0x7fff;
                assert_eq!(d.decode(bits), Some((sym as u16, u32::from(l))), "{sym}");
            }
        }
        // An incomplete code: the unused pattern decodes to nothing.
        let d = Decoder::new(&[2, 2, 2]).unwrap();
        assert_eq!(d.decode(0b11), None);
    }

    #[test]
    fn oversubscribed_codes_do_not_decode() {
        assert!(Decoder::new(&[1, 1, 1]).is_none());
        assert!(Decoder::new(&[1, 2, 2, 2]).is_none());
        let d = Decoder::new(&[0, 1]).unwrap();
        assert_eq!(d.decode(0), Some((1, 1)));
        assert_eq!(d.decode(1), None);
    }
}
