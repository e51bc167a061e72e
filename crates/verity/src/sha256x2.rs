//! Two SHA-256 computations interleaved on the x86 SHA extensions.
//!
//! One SHA-256 stream on SHA-NI is bound by the latency of `sha256rnds2`;
//! running two independent messages through the same loop lets the CPU
//! overlap them, the trick behind the kernel's `sha256_finup_2x` that
//! fs-verity uses. A dm-verity tree is exactly this workload: many messages of
//! one length (salt ‖ block) that can be paired.
//!
//! Only messages of equal length are paired, so both streams run the same
//! number of compression blocks. Results are checked against the `sha2` crate
//! in the tests below and, through the tree tests, against veritysetup.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::sync::OnceLock;

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

pub const IV: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// Whether this CPU has the instructions the fast path needs (checked once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("sha")
            && is_x86_feature_detected!("sse4.1")
            && is_x86_feature_detected!("ssse3")
    })
}

/// A message laid out as `head ‖ data ‖ tail`, following `prefix_bytes` bytes
/// already absorbed into the starting state (whole 64-byte blocks).
#[derive(Clone, Copy)]
pub struct Msg<'a> {
    pub head: &'a [u8],
    pub data: &'a [u8],
    pub tail: &'a [u8],
}

impl Msg<'_> {
    fn len(&self) -> usize {
        self.head.len() + self.data.len() + self.tail.len()
    }

    /// Copies message block `j` (with SHA-256 padding; `total_bits` counts the
    /// absorbed prefix too) into `out`.
    #[inline(always)]
    fn fill_block(&self, j: usize, nblocks: usize, total_bits: u64, out: &mut [u8; 64]) {
        let start = j * 64;
        let end = start + 64;
        out.fill(0);
        let mut seg_start = 0;
        for seg in [self.head, self.data, self.tail] {
            let seg_end = seg_start + seg.len();
            let lo = start.max(seg_start);
            let hi = end.min(seg_end);
            if lo < hi {
                out[lo - start..hi - start].copy_from_slice(&seg[lo - seg_start..hi - seg_start]);
            }
            seg_start = seg_end;
        }
        let len = self.len();
        if (start..end).contains(&len) {
            out[len - start] = 0x80;
        }
        if j + 1 == nblocks {
            out[56..].copy_from_slice(&total_bits.to_be_bytes());
        }
    }
}

/// Hashes two messages of equal length, each starting from `state`
/// (after `prefix_bytes` already-absorbed bytes), writing 32-byte digests.
pub fn hash2(
    state: &[u32; 8],
    prefix_bytes: u64,
    a: Msg<'_>,
    b: Msg<'_>,
    out_a: &mut [u8],
    out_b: &mut [u8],
) {
    assert!(available(), "sha256x2 used without SHA-NI");
    assert_eq!(a.len(), b.len(), "paired messages must have equal length");
    assert_eq!((a.head.len(), a.tail.len()), (b.head.len(), b.tail.len()));
    let (mut sa, mut sb) = (*state, *state);
    // SAFETY: `available()` confirmed SHA, SSE4.1 and SSSE3 at run time, which
    // are all the target features `process2` is compiled with.
    unsafe { process2(&mut sa, &mut sb, prefix_bytes, a, b) };
    for (i, w) in sa.iter().enumerate() {
        out_a[i * 4..i * 4 + 4].copy_from_slice(&w.to_be_bytes());
    }
    for (i, w) in sb.iter().enumerate() {
        out_b[i * 4..i * 4 + 4].copy_from_slice(&w.to_be_bytes());
    }
}

/// State after absorbing the whole 64-byte blocks of `prefix`; returns the
/// state and how many bytes it absorbed.
pub fn absorb_prefix(prefix: &[u8]) -> ([u32; 8], usize) {
    let whole = prefix.len() / 64 * 64;
    let (mut sa, mut sb) = (IV, IV);
    if whole > 0 {
        assert!(available(), "sha256x2 used without SHA-NI");
        let msg = Msg {
            head: &[],
            data: &prefix[..whole],
            tail: &[],
        };
        // SAFETY: as in `hash2`, the features were detected at run time.
        unsafe { absorb2(&mut sa, &mut sb, msg, msg) };
    }
    (sa, whole)
}

/// Compresses the whole blocks of two equal-length, block-multiple messages (no padding).
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
unsafe fn absorb2(sa: &mut [u32; 8], sb: &mut [u32; 8], a: Msg<'_>, b: Msg<'_>) {
    let n = a.data.len() / 64;
    let (mut abef_a, mut cdgh_a) = load_state(sa);
    let (mut abef_b, mut cdgh_b) = load_state(sb);
    for j in 0..n {
        // SAFETY: block j lies inside both data slices (n = len / 64).
        unsafe {
            compress_pair(
                &mut abef_a,
                &mut cdgh_a,
                &mut abef_b,
                &mut cdgh_b,
                a.data.as_ptr().add(j * 64),
                b.data.as_ptr().add(j * 64),
            )
        };
    }
    store_state(sa, abef_a, cdgh_a);
    store_state(sb, abef_b, cdgh_b);
}

#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
unsafe fn process2(
    sa: &mut [u32; 8],
    sb: &mut [u32; 8],
    prefix_bytes: u64,
    a: Msg<'_>,
    b: Msg<'_>,
) {
    let len = a.len();
    let nblocks = (len + 9).div_ceil(64);
    let total_bits = (prefix_bytes + len as u64) * 8;
    let h = a.head.len();
    let d = a.data.len();
    let (mut abef_a, mut cdgh_a) = load_state(sa);
    let (mut abef_b, mut cdgh_b) = load_state(sb);
    let mut tmp_a = [0u8; 64];
    let mut tmp_b = [0u8; 64];
    for j in 0..nblocks {
        let start = j * 64;
        let (pa, pb) = if start >= h && start + 64 <= h + d {
            // Inside the data: hash it in place, whatever its alignment.
            (a.data[start - h..].as_ptr(), b.data[start - h..].as_ptr())
        } else {
            a.fill_block(j, nblocks, total_bits, &mut tmp_a);
            b.fill_block(j, nblocks, total_bits, &mut tmp_b);
            (tmp_a.as_ptr(), tmp_b.as_ptr())
        };
        // SAFETY: pa and pb each point at 64 readable bytes: either inside
        // the data slices (checked just above) or at the 64-byte buffers.
        unsafe { compress_pair(&mut abef_a, &mut cdgh_a, &mut abef_b, &mut cdgh_b, pa, pb) };
    }
    store_state(sa, abef_a, cdgh_a);
    store_state(sb, abef_b, cdgh_b);
}

#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn load_state(s: &[u32; 8]) -> (__m128i, __m128i) {
    // SAFETY: `s` is 32 readable bytes; loadu has no alignment requirement.
    let (dcba, efgh) = unsafe {
        (
            _mm_loadu_si128(s.as_ptr().cast()),
            _mm_loadu_si128(s.as_ptr().add(4).cast()),
        )
    };
    let cdab = _mm_shuffle_epi32(dcba, 0xB1);
    let efgh = _mm_shuffle_epi32(efgh, 0x1B);
    (
        _mm_alignr_epi8(cdab, efgh, 8),
        _mm_blend_epi16(efgh, cdab, 0xF0),
    )
}

#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn store_state(s: &mut [u32; 8], abef: __m128i, cdgh: __m128i) {
    let feba = _mm_shuffle_epi32(abef, 0x1B);
    let dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    let dcba = _mm_blend_epi16(feba, dchg, 0xF0);
    let hgef = _mm_alignr_epi8(dchg, feba, 8);
    // SAFETY: `s` is 32 writable bytes; storeu has no alignment requirement.
    unsafe {
        _mm_storeu_si128(s.as_mut_ptr().cast(), dcba);
        _mm_storeu_si128(s.as_mut_ptr().add(4).cast(), hgef);
    }
}

#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn schedule(w0: __m128i, w1: __m128i, w2: __m128i, w3: __m128i) -> __m128i {
    let t1 = _mm_sha256msg1_epu32(w0, w1);
    let t2 = _mm_alignr_epi8(w3, w2, 4);
    _mm_sha256msg2_epu32(_mm_add_epi32(t1, t2), w3)
}

/// One 64-byte block for each of two streams, rounds interleaved.
///
/// # Safety
/// `pa` and `pb` must each point at 64 readable bytes.
#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
unsafe fn compress_pair(
    abef_a: &mut __m128i,
    cdgh_a: &mut __m128i,
    abef_b: &mut __m128i,
    cdgh_b: &mut __m128i,
    pa: *const u8,
    pb: *const u8,
) {
    let mask = _mm_set_epi64x(0x0c0d_0e0f_0809_0a0b, 0x0405_0607_0001_0203);
    let (save_abef_a, save_cdgh_a, save_abef_b, save_cdgh_b) = (*abef_a, *cdgh_a, *abef_b, *cdgh_b);
    let load = |p: *const u8, i: usize| {
        // SAFETY: the caller guarantees 64 readable bytes at pa and pb, and every
        // call here has i < 4.
        let v = unsafe { _mm_loadu_si128(p.add(i * 16).cast()) };
        _mm_shuffle_epi8(v, mask)
    };
    let (mut a0, mut a1, mut a2, mut a3) = (load(pa, 0), load(pa, 1), load(pa, 2), load(pa, 3));
    let (mut b0, mut b1, mut b2, mut b3) = (load(pb, 0), load(pb, 1), load(pb, 2), load(pb, 3));
    // Four rounds of both streams with message words `wa`/`wb` and constants K[4i..4i+4].
    macro_rules! quad {
        ($wa:expr, $wb:expr, $i:expr) => {{
            // SAFETY: K has 64 entries and 4*i+4 <= 64.
            let k = unsafe { _mm_loadu_si128(K.as_ptr().add(4 * $i).cast()) };
            let ta = _mm_add_epi32($wa, k);
            let tb = _mm_add_epi32($wb, k);
            *cdgh_a = _mm_sha256rnds2_epu32(*cdgh_a, *abef_a, ta);
            *cdgh_b = _mm_sha256rnds2_epu32(*cdgh_b, *abef_b, tb);
            *abef_a = _mm_sha256rnds2_epu32(*abef_a, *cdgh_a, _mm_shuffle_epi32(ta, 0x0E));
            *abef_b = _mm_sha256rnds2_epu32(*abef_b, *cdgh_b, _mm_shuffle_epi32(tb, 0x0E));
        }};
    }
    // Message schedule for the next four words, in place of the oldest.
    macro_rules! sched_quad {
        ($a0:ident, $a1:ident, $a2:ident, $a3:ident, $b0:ident, $b1:ident, $b2:ident, $b3:ident, $i:expr) => {{
            $a0 = schedule($a0, $a1, $a2, $a3);
            $b0 = schedule($b0, $b1, $b2, $b3);
            quad!($a0, $b0, $i);
        }};
    }
    quad!(a0, b0, 0);
    quad!(a1, b1, 1);
    quad!(a2, b2, 2);
    quad!(a3, b3, 3);
    sched_quad!(a0, a1, a2, a3, b0, b1, b2, b3, 4);
    sched_quad!(a1, a2, a3, a0, b1, b2, b3, b0, 5);
    sched_quad!(a2, a3, a0, a1, b2, b3, b0, b1, 6);
    sched_quad!(a3, a0, a1, a2, b3, b0, b1, b2, 7);
    sched_quad!(a0, a1, a2, a3, b0, b1, b2, b3, 8);
    sched_quad!(a1, a2, a3, a0, b1, b2, b3, b0, 9);
    sched_quad!(a2, a3, a0, a1, b2, b3, b0, b1, 10);
    sched_quad!(a3, a0, a1, a2, b3, b0, b1, b2, 11);
    sched_quad!(a0, a1, a2, a3, b0, b1, b2, b3, 12);
    sched_quad!(a1, a2, a3, a0, b1, b2, b3, b0, 13);
    sched_quad!(a2, a3, a0, a1, b2, b3, b0, b1, 14);
    sched_quad!(a3, a0, a1, a2, b3, b0, b1, b2, 15);
    *abef_a = _mm_add_epi32(*abef_a, save_abef_a);
    *cdgh_a = _mm_add_epi32(*cdgh_a, save_cdgh_a);
    *abef_b = _mm_add_epi32(*abef_b, save_abef_b);
    *cdgh_b = _mm_add_epi32(*cdgh_b, save_cdgh_b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest;

    fn reference(parts: &[&[u8]]) -> [u8; 32] {
        let mut h = sha2::Sha256::new();
        for p in parts {
            h.update(p);
        }
        h.finalize().into()
    }

    #[test]
    fn matches_sha2_for_many_shapes() {
        if !available() {
            eprintln!("no SHA-NI on this CPU: the fast path is not used here");
            return;
        }
        let bytes: Vec<u8> = (0..5000u32).map(|i| (i * 31 + 7) as u8).collect();
        for salt_len in [0usize, 1, 31, 32, 55, 56, 63, 64, 65, 127, 128, 200, 256] {
            let salt = &bytes[3000..3000 + salt_len];
            for data_len in [0usize, 1, 55, 56, 63, 64, 100, 512, 4096] {
                let a = &bytes[..data_len];
                let b = &bytes[1..1 + data_len];
                // Salt first (format 1): whole salt blocks pre-absorbed.
                let (state, absorbed) = absorb_prefix(salt);
                let (mut oa, mut ob) = ([0u8; 32], [0u8; 32]);
                let head = &salt[absorbed..];
                hash2(
                    &state,
                    absorbed as u64,
                    Msg {
                        head,
                        data: a,
                        tail: &[],
                    },
                    Msg {
                        head,
                        data: b,
                        tail: &[],
                    },
                    &mut oa,
                    &mut ob,
                );
                assert_eq!(oa, reference(&[salt, a]), "salt {salt_len} data {data_len}");
                assert_eq!(ob, reference(&[salt, b]), "salt {salt_len} data {data_len}");
                // Salt last (format 0).
                hash2(
                    &IV,
                    0,
                    Msg {
                        head: &[],
                        data: a,
                        tail: salt,
                    },
                    Msg {
                        head: &[],
                        data: b,
                        tail: salt,
                    },
                    &mut oa,
                    &mut ob,
                );
                assert_eq!(oa, reference(&[a, salt]));
                assert_eq!(ob, reference(&[b, salt]));
            }
        }
    }
}
