//! Signing keys and signatures: Ed25519 through `ed25519-dalek`, keys as PEM files the
//! way OpenSSL writes them:
//!
//! ```text
//! openssl genpkey -algorithm ed25519 -out update-key.pem      # secret, for the host
//! openssl pkey -in update-key.pem -pubout -out update-pub.pem # public, for devices
//! ```
//!
//! Ed25519 because its keys and signatures are small and fixed-size, it has no
//! parameters to get wrong, and OpenSSL, Android's tooling and every maintained crypto
//! library speak it. Verification is `verify_strict` (no malleable signatures, no weak
//! keys).

use std::path::{Path, PathBuf};

use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

use crate::{BundleError, Result, io_err};

/// Bytes of a signature.
pub const SIGNATURE_LEN: usize = ed25519_dalek::SIGNATURE_LENGTH;

/// A secret signing key.
pub struct SecretKey {
    key: SigningKey,
}

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself.
        write!(f, "SecretKey({})", self.public().id())
    }
}

/// A public key that verifies bundles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicKey {
    key: VerifyingKey,
    path: PathBuf,
}

fn read_pem(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(io_err(path, "read the key file", 0))
}

impl SecretKey {
    /// Reads a PKCS#8 PEM private key (`-----BEGIN PRIVATE KEY-----`).
    pub fn load(path: &Path) -> Result<SecretKey> {
        let pem = read_pem(path)?;
        let key = SigningKey::from_pkcs8_pem(&pem).map_err(|e| BundleError::Signature {
            path: path.to_path_buf(),
            msg: format!(
                "not an Ed25519 private key in PKCS#8 PEM ({e}); make one with \
                 `openssl genpkey -algorithm ed25519 -out KEY.pem`"
            ),
        })?;
        Ok(SecretKey { key })
    }

    /// The matching public key.
    pub fn public(&self) -> PublicKey {
        PublicKey {
            key: self.key.verifying_key(),
            path: PathBuf::from("(the signing key)"),
        }
    }

    /// Signs the concatenation of `parts`.
    pub fn sign(&self, parts: &[&[u8]]) -> [u8; SIGNATURE_LEN] {
        self.key.sign(&parts.concat()).to_bytes()
    }
}

impl PublicKey {
    /// Reads a SubjectPublicKeyInfo PEM public key (`-----BEGIN PUBLIC KEY-----`);
    /// a private key file is accepted too (its public half is used).
    pub fn load(path: &Path) -> Result<PublicKey> {
        let pem = read_pem(path)?;
        let key = match VerifyingKey::from_public_key_pem(&pem) {
            Ok(k) => k,
            Err(e) => match SigningKey::from_pkcs8_pem(&pem) {
                Ok(s) => s.verifying_key(),
                Err(_) => {
                    return Err(BundleError::Signature {
                        path: path.to_path_buf(),
                        msg: format!(
                            "not an Ed25519 public key in PEM ({e}); make one with \
                             `openssl pkey -in KEY.pem -pubout -out PUB.pem`"
                        ),
                    });
                }
            },
        };
        Ok(PublicKey {
            key,
            path: path.to_path_buf(),
        })
    }

    /// A short name of the key: the first 16 hex digits of the sha256 of its 32 bytes.
    pub fn id(&self) -> String {
        hex::encode(&Sha256::digest(self.key.to_bytes())[..8])
    }

    /// Checks `sig` over the concatenation of `parts`; the error says why not.
    pub fn verify(&self, parts: &[&[u8]], sig: &[u8]) -> std::result::Result<(), String> {
        let sig = <[u8; SIGNATURE_LEN]>::try_from(sig)
            .map_err(|_| format!("a signature is {SIGNATURE_LEN} bytes, got {}", sig.len()))?;
        self.key
            .verify_strict(&parts.concat(), &Signature::from_bytes(&sig))
            .map_err(|_| {
                format!(
                    "the signature does not verify with key {} ({}): the bundle was changed \
                     after signing or signed with another key",
                    self.id(),
                    self.path.display()
                )
            })
    }
}
