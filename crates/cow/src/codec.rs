//! The five payload codecs and their exact stream formats (§2.6): zlib (not
//! gzip) for `gz`, a raw Brotli stream, a raw LZ4 *block* without size header,
//! and one zstd frame. Decoders always know the output size and insist on
//! producing exactly that many bytes.

use std::cell::RefCell;
use std::fmt;
use std::io::{Read, Write};
use std::str::FromStr;

use crate::error::CowError;

/// Compression algorithm ids as stored in the v3 header and v2 op records.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    #[default]
    None,
    Gz,
    Brotli,
    Lz4,
    Zstd,
}

impl Codec {
    pub fn id(self) -> u32 {
        match self {
            Codec::None => 0,
            Codec::Gz => 1,
            Codec::Brotli => 2,
            Codec::Lz4 => 3,
            Codec::Zstd => 4,
        }
    }

    pub fn from_id(id: u32) -> Option<Codec> {
        Some(match id {
            0 => Codec::None,
            1 => Codec::Gz,
            2 => Codec::Brotli,
            3 => Codec::Lz4,
            4 => Codec::Zstd,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Gz => "gz",
            Codec::Brotli => "brotli",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }

    /// AOSP's writer defaults (`cow_compress.cpp`).
    pub fn default_level(self) -> i32 {
        match self {
            Codec::None | Codec::Lz4 => 0,
            Codec::Gz => 9,
            Codec::Brotli => 11,
            Codec::Zstd => 3,
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A codec with an optional level, written `zstd:19` (or AOSP's `zstd,19`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Compression {
    pub codec: Codec,
    pub level: Option<i32>,
}

impl Compression {
    pub fn new(codec: Codec) -> Self {
        Compression { codec, level: None }
    }

    pub fn level(&self) -> i32 {
        self.level.unwrap_or_else(|| self.codec.default_level())
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.level {
            Some(l) => write!(f, "{}:{}", self.codec, l),
            None => write!(f, "{}", self.codec),
        }
    }
}

impl FromStr for Compression {
    type Err = CowError;

    fn from_str(s: &str) -> Result<Self, CowError> {
        let (name, level) = match s.split_once([':', ',']) {
            Some((n, l)) => {
                let level = l.trim().parse::<i32>().map_err(|_| {
                    CowError::InvalidOption(format!("compression level {l:?} is not an integer"))
                })?;
                (n, Some(level))
            }
            None => (s, None),
        };
        let codec = match name.trim() {
            "" | "none" => Codec::None,
            "gz" | "gzip" | "zlib" => Codec::Gz,
            "brotli" => Codec::Brotli,
            "lz4" => Codec::Lz4,
            "zstd" => Codec::Zstd,
            other => {
                return Err(CowError::InvalidOption(format!(
                    "unknown compression {other:?} (expected none, gz, brotli, lz4 or zstd)"
                )));
            }
        };
        if let Some(l) = level {
            let ok = match codec {
                Codec::None => l == 0,
                Codec::Lz4 => (0..=12).contains(&l),
                Codec::Gz => (0..=9).contains(&l),
                Codec::Brotli => (0..=11).contains(&l),
                Codec::Zstd => (-131072..=22).contains(&l),
            };
            if !ok {
                return Err(CowError::InvalidOption(format!(
                    "level {l} is out of range for {codec}"
                )));
            }
        }
        Ok(Compression { codec, level })
    }
}

/// A compressor with reusable state (zstd contexts are expensive to build).
/// One per worker thread.
pub struct Encoder {
    comp: Compression,
    window_log: u32,
    zstd: Option<zstd::bulk::Compressor<'static>>,
}

impl Encoder {
    /// `unit_size` is the largest input this encoder will see; zstd's window
    /// is sized to it like AOSP does (windowLog = log2 of the unit).
    pub fn new(comp: Compression, unit_size: usize) -> Self {
        let window_log = unit_size.max(1 << 10).next_power_of_two().trailing_zeros();
        Encoder {
            comp,
            window_log,
            zstd: None,
        }
    }

    /// Compress `input` into a new buffer. The caller decides whether to
    /// store the result or the raw input (the rules differ by version).
    pub fn compress(&mut self, input: &[u8]) -> Result<Vec<u8>, CowError> {
        let level = self.comp.level();
        let fail = |codec: Codec, e: &dyn fmt::Display| CowError::Compress {
            codec: codec.name(),
            msg: e.to_string(),
        };
        match self.comp.codec {
            Codec::None => Ok(input.to_vec()),
            Codec::Gz => {
                let mut enc = flate2::write::ZlibEncoder::new(
                    Vec::with_capacity(input.len() / 2 + 64),
                    flate2::Compression::new(level as u32),
                );
                enc.write_all(input).map_err(|e| fail(Codec::Gz, &e))?;
                enc.finish().map_err(|e| fail(Codec::Gz, &e))
            }
            Codec::Brotli => {
                let params = brotli::enc::BrotliEncoderParams {
                    quality: level,
                    lgwin: 22,
                    ..Default::default()
                };
                let mut out = Vec::with_capacity(input.len() / 2 + 64);
                let mut src = input;
                brotli::BrotliCompress(&mut src, &mut out, &params)
                    .map_err(|e| fail(Codec::Brotli, &e))?;
                Ok(out)
            }
            // Level 0 is AOSP's only lz4 setting, liblz4's LZ4_compress_default (so our
            // lz4 payloads are the bytes AOSP's writer would store); 1-12 are LZ4HC
            // levels. Same block format; on the system pair level 9 stores 16% less for
            // a diff 1.5x as long, and the served image costs no more CPU to decode.
            Codec::Lz4 => {
                let mode = match level {
                    ..=0 => lz4::block::CompressionMode::DEFAULT,
                    l => lz4::block::CompressionMode::HIGHCOMPRESSION(l),
                };
                lz4::block::compress(input, Some(mode), false).map_err(|e| fail(Codec::Lz4, &e))
            }
            Codec::Zstd => {
                if self.zstd.is_none() {
                    let mut c =
                        zstd::bulk::Compressor::new(level).map_err(|e| fail(Codec::Zstd, &e))?;
                    c.set_parameter(zstd::zstd_safe::CParameter::WindowLog(self.window_log))
                        .map_err(|e| fail(Codec::Zstd, &e))?;
                    self.zstd = Some(c);
                }
                match self.zstd.as_mut() {
                    Some(c) => c.compress(input).map_err(|e| fail(Codec::Zstd, &e)),
                    None => Err(fail(Codec::Zstd, &"no compressor")),
                }
            }
        }
    }
}

thread_local! {
    static ZSTD_DCTX: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// Decode `input` into exactly `out.len()` bytes. The error string is
/// wrapped with file/offset context by the caller.
pub fn decompress(codec: Codec, input: &[u8], out: &mut [u8]) -> Result<(), String> {
    match codec {
        Codec::None => {
            if input.len() != out.len() {
                return Err(format!(
                    "raw payload is {} bytes, expected {}",
                    input.len(),
                    out.len()
                ));
            }
            out.copy_from_slice(input);
            Ok(())
        }
        Codec::Gz => {
            let mut d = flate2::Decompress::new(true);
            let status = d
                .decompress(input, out, flate2::FlushDecompress::Finish)
                .map_err(|e| format!("zlib: {e}"))?;
            let produced = d.total_out() as usize;
            if status != flate2::Status::StreamEnd {
                return Err(if produced == out.len() {
                    format!("zlib stream decodes to more than {} bytes", out.len())
                } else {
                    format!("zlib stream ended early after {produced} bytes")
                });
            }
            check_len(produced, out.len())
        }
        Codec::Brotli => {
            let mut dec = brotli::Decompressor::new(input, 4096);
            dec.read_exact(out).map_err(|e| format!("brotli: {e}"))?;
            let mut extra = [0u8; 1];
            match dec.read(&mut extra) {
                Ok(0) => Ok(()),
                Ok(_) => Err(format!(
                    "brotli stream decodes to more than {} bytes",
                    out.len()
                )),
                Err(e) => Err(format!("brotli: {e}")),
            }
        }
        Codec::Lz4 => {
            // liblz4's LZ4_decompress_safe (bounds-checked against corrupt input):
            // 40% faster than lz4_flex's safe decoder on 4 KiB blocks here, and every
            // served XOR/REPLACE block pays it.
            let (Ok(_), Ok(want)) = (i32::try_from(input.len()), i32::try_from(out.len())) else {
                return Err(format!("lz4: block of {} bytes too large", input.len()));
            };
            let n = lz4::block::decompress_to_buffer(input, Some(want), out)
                .map_err(|e| format!("lz4: {e}"))?;
            check_len(n, out.len())
        }
        Codec::Zstd => ZSTD_DCTX.with(|cell| {
            let mut slot = cell.borrow_mut();
            if slot.is_none() {
                *slot = Some(zstd::bulk::Decompressor::new().map_err(|e| format!("zstd: {e}"))?);
            }
            let Some(d) = slot.as_mut() else {
                return Err("zstd: no decompressor".to_string());
            };
            let n = d
                .decompress_to_buffer(input, out)
                .map_err(|e| format!("zstd: {e}"))?;
            check_len(n, out.len())
        }),
    }
}

fn check_len(got: usize, want: usize) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("decoded {got} bytes, expected {want}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| ((i / 7) % 251) as u8 ^ (i % 3) as u8)
            .collect()
    }

    #[test]
    fn round_trip_every_codec() {
        for codec in [
            Codec::None,
            Codec::Gz,
            Codec::Brotli,
            Codec::Lz4,
            Codec::Zstd,
        ] {
            for size in [4096usize, 65536] {
                let input = sample(size);
                let mut enc = Encoder::new(Compression::new(codec), size);
                let packed = enc.compress(&input).unwrap();
                let mut out = vec![0u8; size];
                decompress(codec, &packed, &mut out).unwrap();
                assert_eq!(out, input, "{codec} {size}");
                // A short output buffer must be an error, not a truncation.
                if codec != Codec::None {
                    let mut short = vec![0u8; size - 1];
                    assert!(decompress(codec, &packed, &mut short).is_err(), "{codec}");
                }
            }
        }
    }

    #[test]
    fn garbage_is_an_error() {
        let garbage = [0xffu8; 37];
        for codec in [Codec::Gz, Codec::Brotli, Codec::Lz4, Codec::Zstd] {
            let mut out = vec![0u8; 4096];
            assert!(decompress(codec, &garbage, &mut out).is_err(), "{codec}");
        }
    }

    #[test]
    fn parse_compression() {
        let c: Compression = "zstd:19".parse().unwrap();
        assert_eq!((c.codec, c.level), (Codec::Zstd, Some(19)));
        let c: Compression = "gz,9".parse().unwrap();
        assert_eq!((c.codec, c.level), (Codec::Gz, Some(9)));
        assert!("xz".parse::<Compression>().is_err());
        assert!("gz:12".parse::<Compression>().is_err());
        assert_eq!("lz4".parse::<Compression>().unwrap().to_string(), "lz4");
        let c: Compression = "lz4:9".parse().unwrap();
        assert_eq!((c.codec, c.level), (Codec::Lz4, Some(9)));
        assert!("lz4:13".parse::<Compression>().is_err());
        assert!("none:1".parse::<Compression>().is_err());
    }

    #[test]
    fn lz4_levels_are_plain_lz4_blocks() {
        // Levels pick LZ4HC on the writer side only: the stored block is the same format,
        // decoded by the same call, and smaller on repetitive data.
        let input = sample(65536);
        let fast = Encoder::new(Compression::new(Codec::Lz4), input.len())
            .compress(&input)
            .unwrap();
        for level in [1, 9, 12] {
            let comp = Compression {
                codec: Codec::Lz4,
                level: Some(level),
            };
            let packed = Encoder::new(comp, input.len()).compress(&input).unwrap();
            assert!(packed.len() <= fast.len(), "level {level}");
            let mut out = vec![0u8; input.len()];
            decompress(Codec::Lz4, &packed, &mut out).unwrap();
            assert_eq!(out, input, "level {level}");
        }
    }
}
