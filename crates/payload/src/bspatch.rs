//! bspatch for both containers update_engine's bsdiff operations carry:
//!
//! - `BSDIFF40` (SOURCE_BSDIFF): Colin Percival's format, three bzip2 streams;
//! - `BSDF2` (BROTLI_BSDIFF): AOSP's, the same three streams each compressed by the
//!   codec its header names (0 none, 1 bzip2, 2 brotli).
//!
//! ```text
//! 0   8  "BSDIFF40", or "BSDF2" and three codec bytes (control, diff, extra)
//! 8   8  control stream length     (each length and every control number:
//! 16  8  diff stream length          8 bytes little-endian, top bit the sign)
//! 24  8  new size
//! 32  .. control, diff, extra streams
//! ```
//!
//! The control stream is triples (x, y, z): add x bytes of the diff stream to x bytes
//! of the old data, copy y bytes of the extra stream, move the old position by z.
//!
//! Written here because no maintained crate reads BSDF2 (`qbsdiff` and `bsdiff` read
//! only their own or the BSDIFF40 container); one loop serves both containers. Every
//! length is checked against the output and the streams before it is used: a patch
//! is attacker input until its hash is checked, and even then a crafted one must not
//! make us read or write out of bounds.

use std::io::Read;

/// Why a patch does not apply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PatchError {
    /// The header is not a bsdiff header.
    #[error("not a bsdiff patch (magic {0:02x?})")]
    Magic([u8; 8]),
    /// A header or control number is out of range, or a stream ends early.
    #[error("{0}")]
    Invalid(String),
    /// A stream does not decompress.
    #[error("the {stream} stream does not decompress: {source}")]
    Codec {
        /// control, diff or extra.
        stream: &'static str,
        /// The codec's error.
        #[source]
        source: std::io::Error,
    },
}

const HEADER: usize = 32;

/// Sign and magnitude, little-endian (bsdiff's `offtin`).
fn int(b: &[u8]) -> i64 {
    let mut m = [0u8; 8];
    m.copy_from_slice(&b[..8]);
    let neg = m[7] & 0x80 != 0;
    m[7] &= 0x7f;
    let v = i64::from_le_bytes(m);
    if neg { -v } else { v }
}

/// The new data that `patch` makes from `old`; `max_new` bounds the size the header
/// may claim (the operation's destination).
pub fn apply(old: &[u8], patch: &[u8], max_new: u64) -> Result<Vec<u8>, PatchError> {
    let invalid = |s: String| PatchError::Invalid(s);
    if patch.len() < HEADER {
        return Err(invalid(format!(
            "{} bytes: shorter than a header",
            patch.len()
        )));
    }
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&patch[..8]);
    let codecs = if &magic == b"BSDIFF40" {
        [1u8; 3]
    } else if &magic[..5] == b"BSDF2" {
        [magic[5], magic[6], magic[7]]
    } else {
        return Err(PatchError::Magic(magic));
    };
    let (ctrl_len, diff_len, new_len) = (int(&patch[8..]), int(&patch[16..]), int(&patch[24..]));
    let len = |v: i64, what: &str| -> Result<usize, PatchError> {
        usize::try_from(v).map_err(|_| invalid(format!("{what} {v} is negative")))
    };
    let (ctrl_len, diff_len, new_len) = (
        len(ctrl_len, "control length")?,
        len(diff_len, "diff length")?,
        len(new_len, "new size")?,
    );
    if new_len as u64 > max_new {
        return Err(invalid(format!(
            "new size {new_len} is more than the {max_new} bytes the operation writes"
        )));
    }
    let body = &patch[HEADER..];
    let ctrl_end = ctrl_len;
    let diff_end = ctrl_end.checked_add(diff_len).filter(|&e| e <= body.len());
    let Some(diff_end) = diff_end.filter(|_| ctrl_end <= body.len()) else {
        return Err(invalid(format!(
            "control ({ctrl_len}) and diff ({diff_len}) streams run past the patch's {} bytes",
            body.len()
        )));
    };
    // The streams are decoded as the control numbers consume them: memory is the
    // output, which the data written into it backs, never what a stream claims (a
    // few KB of bzip2 can expand to gigabytes).
    let mut ctrl = Stream::new(codecs[0], &body[..ctrl_end], "control")?;
    let mut diff = Stream::new(codecs[1], &body[ctrl_end..diff_end], "diff")?;
    let mut extra = Stream::new(codecs[2], &body[diff_end..], "extra")?;

    let mut new: Vec<u8> = Vec::with_capacity(new_len.min(64 << 20));
    let mut old_pos = 0i64;
    while new.len() < new_len {
        let new_pos = new.len();
        let mut c = [0u8; 24];
        ctrl.read(&mut c, new_pos)?;
        let (x, y, z) = (int(&c), int(&c[8..]), int(&c[16..]));
        let x = len(x, "diff run")?;
        let y = len(y, "extra run")?;
        if x > new_len - new_pos {
            return Err(invalid(format!(
                "a diff run of {x} bytes at output byte {new_pos} runs past the output"
            )));
        }
        new.resize(new_pos + x, 0);
        let out = &mut new[new_pos..];
        diff.read(out, new_pos)?;
        // Bytes of the old data outside it add nothing (bsdiff's rule).
        for (i, b) in out.iter_mut().enumerate() {
            let o = old_pos.wrapping_add(i as i64);
            if let Some(&ob) = usize::try_from(o).ok().and_then(|o| old.get(o)) {
                *b = b.wrapping_add(ob);
            }
        }
        old_pos = old_pos.saturating_add(x as i64);
        let new_pos = new.len();
        if y > new_len - new_pos {
            return Err(invalid(format!(
                "an extra run of {y} bytes at output byte {new_pos} runs past the output"
            )));
        }
        new.resize(new_pos + y, 0);
        extra.read(&mut new[new_pos..], new_pos)?;
        old_pos = old_pos.saturating_add(z);
    }
    Ok(new)
}

/// One of the three streams, decoded as it is read.
struct Stream<'a> {
    name: &'static str,
    reader: Box<dyn Read + 'a>,
}

impl<'a> Stream<'a> {
    fn new(codec: u8, data: &'a [u8], name: &'static str) -> Result<Stream<'a>, PatchError> {
        let reader: Box<dyn Read + 'a> = match codec {
            0 => Box::new(data),
            1 => Box::new(bzip2::read::BzDecoder::new(data)),
            2 => Box::new(brotli::Decompressor::new(data, 64 << 10)),
            c => {
                return Err(PatchError::Invalid(format!(
                    "the {name} stream's codec {c} is none of 0 (none), 1 (bzip2), 2 (brotli)"
                )));
            }
        };
        Ok(Stream { name, reader })
    }

    /// Fills `buf` (for output byte `at`), or says the stream ended or is corrupt.
    fn read(&mut self, buf: &mut [u8], at: usize) -> Result<(), PatchError> {
        self.reader.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                PatchError::Invalid(format!(
                    "the {} stream ends before output byte {at} of the patch",
                    self.name
                ))
            } else {
                PatchError::Codec {
                    stream: self.name,
                    source: e,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(v: i64) -> [u8; 8] {
        let mut b = v.unsigned_abs().to_le_bytes();
        if v < 0 {
            b[7] |= 0x80;
        }
        b
    }

    /// A BSDF2 patch with uncompressed streams.
    fn plain(ctrl: &[(i64, i64, i64)], diff: &[u8], extra: &[u8], new_len: i64) -> Vec<u8> {
        let c: Vec<u8> = ctrl
            .iter()
            .flat_map(|&(x, y, z)| [put(x), put(y), put(z)].concat())
            .collect();
        let mut p = b"BSDF2\0\0\0".to_vec();
        p.extend(put(c.len() as i64));
        p.extend(put(diff.len() as i64));
        p.extend(put(new_len));
        p.extend(c);
        p.extend(diff);
        p.extend(extra);
        p
    }

    #[test]
    fn a_stream_that_expands_hugely_is_read_only_as_far_as_used() {
        // 256 MiB of zero triples in a few hundred bytes of bzip2: read as consumed,
        // they make no progress and end the patch with an error, never a 256 MiB
        // buffer.
        let mut ctrl = Vec::new();
        let mut e = bzip2::write::BzEncoder::new(&mut ctrl, bzip2::Compression::best());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..256 {
            std::io::Write::write_all(&mut e, &zeros).unwrap();
        }
        e.finish().unwrap();
        assert!(ctrl.len() < 4096, "{}", ctrl.len());
        let mut p = b"BSDF2\x01\0\0".to_vec();
        p.extend(put(ctrl.len() as i64));
        p.extend(put(0));
        p.extend(put(1));
        p.extend(ctrl);
        let e = apply(b"a", &p, 1).unwrap_err().to_string();
        assert!(
            e.contains("extra stream ends") || e.contains("control stream ends"),
            "{e}"
        );
    }

    #[test]
    fn numbers_are_sign_and_magnitude() {
        for v in [0, 1, -1, 300, -300, i64::MAX, -i64::MAX] {
            assert_eq!(int(&put(v)), v);
        }
    }

    #[test]
    fn a_patch_adds_copies_and_seeks() {
        let old = b"abcdefgh";
        // "abc" + 1 each -> "bcd"; then "XY" from extra; seek back 3 from old pos 3.
        let p = plain(&[(3, 2, -3), (2, 0, 0)], &[1, 1, 1, 0, 0], b"XY", 7);
        assert_eq!(apply(old, &p, 7).unwrap(), b"bcdXYab");
    }

    #[test]
    fn lengths_past_the_streams_or_the_output_are_refused() {
        let old = b"abcdefgh";
        for (ctrl, diff, extra, n, max) in [
            (vec![(9, 0, 0)], vec![0u8; 9], vec![], 8, 8),
            (vec![(4, 0, 0)], vec![0; 2], vec![], 4, 4),
            (vec![(0, 4, 0)], vec![], vec![1, 2], 4, 4),
            (vec![(-1, 0, 0)], vec![], vec![], 1, 1),
            (vec![], vec![], vec![], 1, 1),
            (vec![(1, 0, 0)], vec![0], vec![], 2, 1),
        ] {
            let p = plain(&ctrl, &diff, &extra, n);
            assert!(apply(old, &p, max).is_err(), "{ctrl:?} {n}");
        }
        assert!(matches!(
            apply(old, b"BSDIFF41", 1),
            Err(PatchError::Invalid(_))
        ));
        assert!(matches!(
            apply(old, &[b'x'; 40], 1),
            Err(PatchError::Magic(_))
        ));
    }
}
