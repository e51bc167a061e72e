//! The 512-byte dm-verity superblock veritysetup writes (cryptsetup
//! `struct verity_sb`, little-endian). The kernel never reads it and it holds
//! no root hash; it only saves the user from repeating the parameters.

use std::path::Path;

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::error::{Error, Result};
use crate::params::{Format, HashAlgorithm, MAX_SALT_SIZE, Params, SUPERBLOCK_SIZE};

const SIGNATURE: &[u8; 8] = b"verity\0\0";

/// cryptsetup's `struct verity_sb` as it lies on disk.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct WireSuperblock {
    signature: [u8; 8],
    version: U32,
    hash_type: U32,
    uuid: [u8; 16],
    /// NUL-padded.
    algorithm: [u8; 32],
    data_block_size: U32,
    hash_block_size: U32,
    data_blocks: U64,
    salt_size: U16,
    pad1: [u8; 6],
    salt: [u8; MAX_SALT_SIZE],
    pad2: [u8; 168],
}

// A struct that drifts from cryptsetup's size does not build.
const _: () = assert!(size_of::<WireSuperblock>() == SUPERBLOCK_SIZE as usize);

/// Parameters plus the UUID, as stored in a superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub params: Params,
    pub uuid: [u8; 16],
}

impl Superblock {
    pub fn encode(&self) -> [u8; SUPERBLOCK_SIZE as usize] {
        let p = &self.params;
        let mut algorithm = [0u8; 32];
        let name = p.algorithm.name().as_bytes();
        algorithm[..name.len()].copy_from_slice(name);
        // Params::validate refuses a salt longer than the field; unvalidated
        // params get theirs cut rather than a panic.
        let mut salt = [0u8; MAX_SALT_SIZE];
        let n = p.salt.len().min(MAX_SALT_SIZE);
        salt[..n].copy_from_slice(&p.salt[..n]);
        zerocopy::transmute!(WireSuperblock {
            signature: *SIGNATURE,
            version: U32::new(1),
            hash_type: U32::new(p.format.as_u32()),
            uuid: self.uuid,
            algorithm,
            data_block_size: U32::new(p.data_block_size),
            hash_block_size: U32::new(p.hash_block_size),
            data_blocks: U64::new(p.data_blocks),
            // Params::validate caps the salt at 256 bytes, so this fits in u16.
            salt_size: U16::new(p.salt.len() as u16),
            pad1: [0; 6],
            salt,
            pad2: [0; 168],
        })
    }

    /// Parses a superblock read from `path` at `offset` (used in messages only).
    pub fn decode(b: &[u8], path: &Path, offset: u64) -> Result<Self> {
        let bad = |reason: String| Error::BadSuperblock {
            path: path.to_path_buf(),
            offset,
            reason,
        };
        let (w, _) = WireSuperblock::ref_from_prefix(b)
            .map_err(|_| bad(format!("only {} bytes", b.len())))?;
        if &w.signature != SIGNATURE {
            return Err(bad(
                "no \"verity\" signature (use --no-superblock for a bare tree)".into(),
            ));
        }
        let version = w.version.get();
        if version != 1 {
            return Err(bad(format!("unsupported superblock version {version}")));
        }
        let format = Format::from_u32(w.hash_type.get()).map_err(|e| bad(e.to_string()))?;
        let name_end = w.algorithm.iter().position(|&c| c == 0).unwrap_or(32);
        let name = String::from_utf8_lossy(&w.algorithm[..name_end]).into_owned();
        let algorithm: HashAlgorithm = name.parse().map_err(|e: Error| bad(e.to_string()))?;
        let salt_size = usize::from(w.salt_size.get());
        if salt_size > MAX_SALT_SIZE {
            return Err(bad(format!(
                "salt size {salt_size} exceeds {MAX_SALT_SIZE}"
            )));
        }
        let params = Params {
            format,
            algorithm,
            data_block_size: w.data_block_size.get(),
            hash_block_size: w.hash_block_size.get(),
            data_blocks: w.data_blocks.get(),
            salt: w.salt[..salt_size].to_vec(),
        };
        params.validate().map_err(|e| bad(e.to_string()))?;
        Ok(Superblock {
            params,
            uuid: w.uuid,
        })
    }
}

/// Parses a textual UUID (`01234567-89ab-...`, hyphens optional) into its 16 raw bytes.
pub fn parse_uuid(s: &str) -> Result<[u8; 16]> {
    let hexdigits: String = s.chars().filter(|&c| c != '-').collect();
    let mut out = [0u8; 16];
    hex::decode_to_slice(&hexdigits, &mut out)
        .map_err(|e| Error::InvalidParams(format!("bad UUID {s:?}: {e}")))?;
    Ok(out)
}

/// Formats 16 raw bytes as a textual UUID.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h = hex::encode(u);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// A random version-4 UUID, like the one veritysetup makes by default.
pub fn random_uuid() -> Result<[u8; 16]> {
    let mut u = [0u8; 16];
    getrandom::fill(&mut u).map_err(|e| Error::Random(e.to_string()))?;
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    Ok(u)
}

/// `n` random bytes, for a default salt.
pub fn random_bytes(n: usize) -> Result<Vec<u8>> {
    let mut v = vec![0u8; n];
    getrandom::fill(&mut v).map_err(|e| Error::Random(e.to_string()))?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_superblock_has_cryptsetup_layout() {
        use std::mem::offset_of;
        assert_eq!(size_of::<WireSuperblock>(), 512);
        assert_eq!(offset_of!(WireSuperblock, algorithm), 32);
        assert_eq!(offset_of!(WireSuperblock, data_block_size), 64);
        assert_eq!(offset_of!(WireSuperblock, salt_size), 80);
        assert_eq!(offset_of!(WireSuperblock, salt), 88);
    }

    /// A superblock veritysetup wrote (shared/verity-vectors, read in place)
    /// decodes to its parameters and encodes back to the same 512 bytes.
    #[test]
    fn veritysetup_superblock_round_trips() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/verity-vectors/veritysetup/1blk__sha256-salt1__sb.hash");
        let file = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let b = &file[..SUPERBLOCK_SIZE as usize];
        let sb = Superblock::decode(b, &path, 0).unwrap();
        assert_eq!(sb.params.algorithm, HashAlgorithm::Sha256);
        assert_eq!(sb.params.salt, [0xa5]);
        assert_eq!(
            (
                sb.params.data_block_size,
                sb.params.hash_block_size,
                sb.params.data_blocks
            ),
            (4096, 4096, 1)
        );
        assert_eq!(
            format_uuid(&sb.uuid),
            "01234567-89ab-4cde-8f01-23456789abcd"
        );
        assert_eq!(sb.encode(), b);
        let e = Superblock::decode(&b[..100], &path, 0).unwrap_err();
        assert!(e.to_string().contains("only 100 bytes"), "{e}");
    }

    #[test]
    fn roundtrip() {
        let mut p = Params::new(1000, vec![0xa5]);
        p.algorithm = HashAlgorithm::Sha512;
        let sb = Superblock {
            params: p,
            uuid: parse_uuid("01234567-89ab-4cde-8f01-23456789abcd").unwrap(),
        };
        let enc = sb.encode();
        assert_eq!(Superblock::decode(&enc, Path::new("x"), 0).unwrap(), sb);
        assert_eq!(
            format_uuid(&sb.uuid),
            "01234567-89ab-4cde-8f01-23456789abcd"
        );
        let mut bad = enc;
        bad[0] = b'X';
        let e = Superblock::decode(&bad, Path::new("x.hash"), 4096).unwrap_err();
        assert!(
            e.to_string().contains("x.hash") && e.to_string().contains("4096"),
            "{e}"
        );
    }
}
