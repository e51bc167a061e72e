//! Salted block hashing in the two dm-verity formats.

use sha1::Digest as _;

use crate::params::{Format, HashAlgorithm, Params};

/// The largest digest we produce (sha512).
pub const MAX_DIGEST_SIZE: usize = 64;

#[derive(Clone)]
enum State {
    Sha1(sha1::Sha1),
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl State {
    fn new(alg: HashAlgorithm) -> Self {
        match alg {
            HashAlgorithm::Sha1 => State::Sha1(sha1::Sha1::new()),
            HashAlgorithm::Sha256 => State::Sha256(sha2::Sha256::new()),
            HashAlgorithm::Sha512 => State::Sha512(sha2::Sha512::new()),
        }
    }

    fn update(&mut self, data: &[u8]) {
        match self {
            State::Sha1(h) => h.update(data),
            State::Sha256(h) => h.update(data),
            State::Sha512(h) => h.update(data),
        }
    }

    fn finish_into(self, out: &mut [u8]) {
        match self {
            State::Sha1(h) => out.copy_from_slice(&h.finalize()),
            State::Sha256(h) => out.copy_from_slice(&h.finalize()),
            State::Sha512(h) => out.copy_from_slice(&h.finalize()),
        }
    }
}

/// Computes `H(salt ‖ block)` (format 1) or `H(block ‖ salt)` (format 0).
///
/// In format 1 the salt is absorbed once and the state cloned per block, so a
/// long salt costs nothing per block beyond the compression it forces.
#[derive(Clone)]
pub struct BlockHasher {
    format: Format,
    digest_size: usize,
    salted: State,
    salt: Vec<u8>,
    /// Two-way interleaved SHA-256 when the CPU has SHA-NI.
    #[cfg(target_arch = "x86_64")]
    x2: Option<X2>,
}

/// Precomputed input for [`crate::sha256x2`]: the state after the salt's whole
/// blocks, and what remains of the salt before and after each block.
#[cfg(target_arch = "x86_64")]
#[derive(Clone)]
struct X2 {
    state: [u32; 8],
    absorbed: u64,
    head: Vec<u8>,
    tail: Vec<u8>,
}

impl BlockHasher {
    pub fn new(params: &Params) -> Self {
        Self::with(params.algorithm, params.format, &params.salt)
    }

    pub fn with(algorithm: HashAlgorithm, format: Format, salt: &[u8]) -> Self {
        let mut salted = State::new(algorithm);
        if format == Format::V1 {
            salted.update(salt);
        }
        #[cfg(target_arch = "x86_64")]
        let x2 = (algorithm == HashAlgorithm::Sha256 && crate::sha256x2::available()).then(|| {
            match format {
                Format::V1 => {
                    let (state, absorbed) = crate::sha256x2::absorb_prefix(salt);
                    X2 {
                        state,
                        absorbed: absorbed as u64,
                        head: salt[absorbed..].to_vec(),
                        tail: Vec::new(),
                    }
                }
                Format::ChromeOs => X2 {
                    state: crate::sha256x2::IV,
                    absorbed: 0,
                    head: Vec::new(),
                    tail: salt.to_vec(),
                },
            }
        });
        BlockHasher {
            format,
            digest_size: algorithm.digest_size(),
            salted,
            salt: salt.to_vec(),
            #[cfg(target_arch = "x86_64")]
            x2,
        }
    }

    /// Digests of two equal-length blocks; faster than two [`Self::hash_into`]
    /// calls where the CPU allows interleaving them.
    pub fn hash_pair_into(&self, a: &[u8], b: &[u8], out_a: &mut [u8], out_b: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(x) = &self.x2
            && a.len() == b.len()
        {
            use crate::sha256x2::{Msg, hash2};
            let msg = |data| Msg {
                head: &x.head,
                data,
                tail: &x.tail,
            };
            hash2(&x.state, x.absorbed, msg(a), msg(b), out_a, out_b);
            return;
        }
        self.hash_into(a, out_a);
        self.hash_into(b, out_b);
    }

    /// Hashes consecutive `block_size` blocks of `src` into `out`, packed at
    /// `digest_size` each, two at a time where possible.
    pub fn hash_blocks_into(&self, src: &[u8], block_size: usize, out: &mut [u8]) {
        let d = self.digest_size;
        let mut blocks = src.chunks_exact(block_size);
        let mut outs = out.chunks_exact_mut(d);
        while let (Some(a), Some(oa)) = (blocks.next(), outs.next()) {
            match (blocks.next(), outs.next()) {
                (Some(b), Some(ob)) => self.hash_pair_into(a, b, oa, ob),
                _ => self.hash_into(a, oa),
            }
        }
    }

    pub fn digest_size(&self) -> usize {
        self.digest_size
    }

    /// Writes the digest of `block` into `out[..digest_size]`.
    pub fn hash_into(&self, block: &[u8], out: &mut [u8]) {
        let mut st = self.salted.clone();
        st.update(block);
        if self.format == Format::ChromeOs {
            st.update(&self.salt);
        }
        st.finish_into(&mut out[..self.digest_size]);
    }

    /// Digest of `block` as a fixed buffer; only the first `digest_size` bytes are meaningful.
    pub fn hash(&self, block: &[u8]) -> [u8; MAX_DIGEST_SIZE] {
        let mut out = [0u8; MAX_DIGEST_SIZE];
        self.hash_into(block, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsalted_v1_is_plain_hash() {
        let p = Params::new(1, vec![]);
        let h = BlockHasher::new(&p);
        let d = h.hash(b"abc");
        assert_eq!(
            hex::encode(&d[..32]),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn salt_position_depends_on_format() {
        let mut p = Params::new(1, b"s".to_vec());
        let v1 = BlockHasher::new(&p).hash(b"x");
        p.format = Format::ChromeOs;
        let v0 = BlockHasher::new(&p).hash(b"x");
        let plain = BlockHasher::with(HashAlgorithm::Sha256, Format::V1, b"");
        assert_eq!(v1, plain.hash(b"sx"));
        assert_eq!(v0, plain.hash(b"xs"));
    }
}
