//! The 512-byte dm-verity superblock veritysetup writes (cryptsetup
//! `struct verity_sb`, little-endian). The kernel never reads it and it holds
//! no root hash; it only saves the user from repeating the parameters.

use std::path::Path;

use crate::error::{Error, Result};
use crate::params::{Format, HashAlgorithm, MAX_SALT_SIZE, Params, SUPERBLOCK_SIZE};

const SIGNATURE: &[u8; 8] = b"verity\0\0";

/// Parameters plus the UUID, as stored in a superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub params: Params,
    pub uuid: [u8; 16],
}

impl Superblock {
    pub fn encode(&self) -> [u8; SUPERBLOCK_SIZE as usize] {
        let p = &self.params;
        let mut b = [0u8; SUPERBLOCK_SIZE as usize];
        b[0..8].copy_from_slice(SIGNATURE);
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        b[12..16].copy_from_slice(&p.format.as_u32().to_le_bytes());
        b[16..32].copy_from_slice(&self.uuid);
        let name = p.algorithm.name().as_bytes();
        b[32..32 + name.len()].copy_from_slice(name);
        b[64..68].copy_from_slice(&p.data_block_size.to_le_bytes());
        b[68..72].copy_from_slice(&p.hash_block_size.to_le_bytes());
        b[72..80].copy_from_slice(&p.data_blocks.to_le_bytes());
        // Params::validate caps the salt at 256 bytes, so this fits in u16.
        b[80..82].copy_from_slice(&(p.salt.len() as u16).to_le_bytes());
        b[88..88 + p.salt.len()].copy_from_slice(&p.salt);
        b
    }

    /// Parses a superblock read from `path` at `offset` (used in messages only).
    pub fn decode(b: &[u8], path: &Path, offset: u64) -> Result<Self> {
        let bad = |reason: String| Error::BadSuperblock {
            path: path.to_path_buf(),
            offset,
            reason,
        };
        if b.len() < SUPERBLOCK_SIZE as usize {
            return Err(bad(format!("only {} bytes", b.len())));
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        if &b[0..8] != SIGNATURE {
            return Err(bad(
                "no \"verity\" signature (use --no-superblock for a bare tree)".into(),
            ));
        }
        let version = u32_at(8);
        if version != 1 {
            return Err(bad(format!("unsupported superblock version {version}")));
        }
        let format = Format::from_u32(u32_at(12)).map_err(|e| bad(e.to_string()))?;
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[16..32]);
        let name_end = b[32..64].iter().position(|&c| c == 0).unwrap_or(32);
        let name = String::from_utf8_lossy(&b[32..32 + name_end]).into_owned();
        let algorithm: HashAlgorithm = name.parse().map_err(|e: Error| bad(e.to_string()))?;
        let data_block_size = u32_at(64);
        let hash_block_size = u32_at(68);
        let mut blocks = [0u8; 8];
        blocks.copy_from_slice(&b[72..80]);
        let data_blocks = u64::from_le_bytes(blocks);
        let salt_size = usize::from(u16::from_le_bytes([b[80], b[81]]));
        if salt_size > MAX_SALT_SIZE {
            return Err(bad(format!(
                "salt size {salt_size} exceeds {MAX_SALT_SIZE}"
            )));
        }
        let params = Params {
            format,
            algorithm,
            data_block_size,
            hash_block_size,
            data_blocks,
            salt: b[88..88 + salt_size].to_vec(),
        };
        params.validate().map_err(|e| bad(e.to_string()))?;
        Ok(Superblock { params, uuid })
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
