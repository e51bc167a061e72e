//! The payload's two signatures, checked as update_engine checks them: RSA PKCS#1 v1.5
//! over a SHA-256 (the padded hash signed raw, `openssl rsautl -sign` style), through
//! the `rsa` crate, or ECDSA P-256 over the SHA-256 (a DER signature, padded to a
//! fixed size with its length in `unpadded_signature_size`), through `p256`.
//!
//! - The **metadata signature** covers the header and the manifest. The manifest
//!   holds every operation's data hash and each partition's old and new hash, so once
//!   it verifies, every operation's data is checked against it as it is read: a
//!   partition can be extracted from a URL with only its own bytes fetched.
//! - The **payload signature** covers every byte before it except the metadata
//!   signature: checking it reads the whole payload.

use rsa::PublicKey as RsaPublicKey;
use rsa::pkcs1::DecodeRsaPublicKey as _;
use sha2::{Digest as _, Sha256};

use prost::Message as _;

use crate::error::{Error, Result};
use crate::format::{HEADER_LEN, Payload};
use crate::proto::Signatures;

/// One public key.
#[derive(Debug, Clone)]
enum Key {
    Rsa(RsaPublicKey),
    Ec(p256::ecdsa::VerifyingKey),
}

impl Key {
    fn verifies(&self, hash: &[u8; 32], sig: &[u8]) -> bool {
        match self {
            Key::Rsa(k) => k
                .verify(rsa::Pkcs1v15Sign::new::<Sha256>(), hash, sig)
                .is_ok(),
            Key::Ec(k) => {
                use p256::ecdsa::signature::hazmat::PrehashVerifier as _;
                p256::ecdsa::Signature::from_der(sig)
                    .is_ok_and(|s| k.verify_prehash(hash, &s).is_ok())
            }
        }
    }
}

/// Public keys, any of which may have signed.
#[derive(Debug, Clone, Default)]
pub struct Keys(Vec<Key>);

impl Keys {
    /// Reads a PEM file: `PUBLIC KEY` (RSA as update_engine's
    /// `update-payload-key.pub.pem` and `openssl rsa -pubout` write it, or EC P-256 as
    /// `openssl ec -pubout` writes it) or `RSA PUBLIC KEY`.
    pub fn from_pem_file(path: &std::path::Path) -> Result<Keys> {
        let text = std::fs::read_to_string(path).map_err(vabc_io::error::on("read", path))?;
        Keys::from_pem(&text).map_err(|e| Error::signature(format!("{}: {e}", path.display())))
    }

    /// Parses a PEM key, or the key of a PEM certificate (as an OTA package's
    /// `otacert`: the certificate of the key that signed it, to be taken from a place
    /// the payload does not control).
    pub fn from_pem(text: &str) -> Result<Keys> {
        use p256::pkcs8::DecodePublicKey as _;
        if text.contains("-----BEGIN CERTIFICATE-----") {
            use x509_cert::der::{DecodePem as _, EncodePem as _};
            let cert = x509_cert::Certificate::from_pem(text)
                .map_err(|e| Error::signature(format!("not a readable PEM certificate: {e}")))?;
            let spki = cert
                .tbs_certificate()
                .subject_public_key_info()
                .to_pem(x509_cert::der::pem::LineEnding::LF)
                .map_err(|e| Error::signature(format!("the certificate's key: {e}")))?;
            return Keys::from_pem(&spki);
        }
        let key = match RsaPublicKey::from_public_key_pem(text)
            .or_else(|_| RsaPublicKey::from_pkcs1_pem(text))
        {
            Ok(k) => Key::Rsa(k),
            Err(rsa_error) => match p256::ecdsa::VerifyingKey::from_public_key_pem(text) {
                Ok(k) => Key::Ec(k),
                Err(_) => {
                    return Err(Error::signature(format!(
                        "not an RSA or EC P-256 public key in PEM (PUBLIC KEY or RSA PUBLIC \
                         KEY): {rsa_error}"
                    )));
                }
            },
        };
        Ok(Keys(vec![key]))
    }

    /// Adds the keys of `other`.
    pub fn extend(&mut self, other: Keys) {
        self.0.extend(other.0);
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether one of the signatures in `sigs` (a `Signatures` message) is a key's
    /// signature of `hash`; `what` names the signature in errors.
    pub fn verify(&self, what: &str, sigs: &[u8], hash: &[u8; 32]) -> Result<()> {
        if sigs.is_empty() {
            return Err(Error::signature(format!("the payload has no {what}")));
        }
        let sigs = Signatures::decode(sigs)
            .map_err(|e| Error::signature(format!("the {what} does not decode: {e}")))?;
        if sigs.signatures.is_empty() {
            return Err(Error::signature(format!("the {what} holds no signature")));
        }
        for s in &sigs.signatures {
            let data = s.data.as_deref().unwrap_or_default();
            let data = match s.unpadded_signature_size {
                Some(n) if (n as usize) <= data.len() => &data[..n as usize],
                _ => data,
            };
            if self.0.iter().any(|k| k.verifies(hash, data)) {
                return Ok(());
            }
        }
        Err(Error::signature(format!(
            "the {what} does not verify with the given key ({} signature(s) tried): the \
             payload was altered or signed by another key",
            sigs.signatures.len()
        )))
    }
}

/// SHA-256 of the header and manifest as they were read and decoded: what the
/// metadata signature signs.
pub fn metadata_hash(p: &Payload) -> [u8; 32] {
    Sha256::digest(p.metadata_bytes()).into()
}

/// Checks the metadata signature with `keys`.
pub fn verify_metadata(p: &Payload, keys: &Keys) -> Result<()> {
    keys.verify(
        "metadata signature",
        &p.metadata_signature,
        &metadata_hash(p),
    )
}

/// Checks the payload signature with `keys`, reading the whole payload; `progress`
/// hears of every chunk hashed (bytes).
pub fn verify_payload(p: &Payload, keys: &Keys, progress: &dyn Fn(u64)) -> Result<()> {
    let name = p.source().name();
    let Some((sig_at, sig_len)) = p.payload_signature_range() else {
        return Err(Error::signature(
            "the payload has no payload signature (the manifest gives no signatures_offset)",
        ));
    };
    if sig_at
        .checked_add(sig_len)
        .is_none_or(|e| e > p.source().len())
    {
        return Err(Error::format(
            name,
            sig_at,
            format!("the payload signature ({sig_len} bytes) runs past the end"),
        ));
    }
    // The header and manifest as decoded, then the data.
    let mut h = Sha256::new();
    let metadata = p.metadata_bytes();
    h.update(metadata);
    progress(metadata.len() as u64);
    let mut hash_range = |from: u64, to: u64| -> Result<()> {
        let mut at = from;
        while at < to {
            let n = (to - at).min(4 << 20);
            let chunk = p.source().read_vec(at, n)?;
            h.update(&chunk);
            progress(n);
            at += n;
        }
        Ok(())
    };
    hash_range(p.header.data_offset(), sig_at)?;
    let hash: [u8; 32] = h.finalize().into();
    let sigs = p.source().read_vec(sig_at, sig_len)?;
    keys.verify("payload signature", &sigs, &hash)
}

/// Bytes [`verify_payload`] reads: all but the two signatures.
pub fn payload_hashed_len(p: &Payload) -> u64 {
    let sig_at = p.payload_signature_range().map_or(0, |(at, _)| at);
    HEADER_LEN + p.header.manifest_len + sig_at.saturating_sub(p.header.data_offset())
}
