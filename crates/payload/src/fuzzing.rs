//! The body of the `payload_read` fuzz target, replayed over its corpus by `cargo test`,
//! and a payload writer for the seeds and the tests: it lays a payload out and signs
//! it in update_engine's order (sizes fixed first, then the metadata hash signed,
//! then the payload hash), with whatever signer the caller gives.

use prost::Message as _;

use crate::format::{HEADER_LEN, Payload, sha256};
use crate::proto::{
    CowMergeOperation, CowMergeType, DeltaArchiveManifest, DynamicPartitionMetadata, Extent,
    InstallOperation, OpType, PartitionInfo, PartitionUpdate, Signature, Signatures,
};
use crate::source::Source;

/// Signs a SHA-256, returning the raw signature.
pub type Signer<'a> = &'a dyn Fn(&[u8; 32]) -> Vec<u8>;

/// A payload being written.
#[derive(Debug, Default)]
pub struct Builder {
    /// The manifest so far.
    pub manifest: DeltaArchiveManifest,
    data: Vec<u8>,
    old: Vec<Option<Vec<u8>>>,
}

impl Builder {
    /// A payload of `minor` version (0: full), 4 KiB blocks.
    pub fn new(minor: u32) -> Builder {
        let mut b = Builder::default();
        b.manifest.block_size = Some(4096);
        b.manifest.minor_version = Some(minor);
        b
    }

    /// Adds partition `name` that turns `old` (incremental) into `new`; returns its
    /// index for [`Builder::op`].
    pub fn partition(&mut self, name: &str, old: Option<Vec<u8>>, new: &[u8]) -> usize {
        let info = |d: &[u8]| PartitionInfo {
            size: Some(d.len() as u64),
            hash: Some(sha256(d).to_vec()),
        };
        self.manifest.partitions.push(PartitionUpdate {
            partition_name: name.to_string(),
            old_partition_info: old.as_deref().map(info),
            new_partition_info: Some(info(new)),
            ..Default::default()
        });
        self.old.push(old);
        self.manifest.partitions.len() - 1
    }

    /// Adds an operation to partition `part`: its data appended and hashed, its
    /// source hashed from the partition's old image.
    pub fn op(
        &mut self,
        part: usize,
        t: OpType,
        src: &[Extent],
        dst: &[Extent],
        data: Option<&[u8]>,
    ) {
        let bs = 4096u64;
        let mut op = InstallOperation {
            r#type: t as i32,
            src_extents: src.to_vec(),
            dst_extents: dst.to_vec(),
            ..Default::default()
        };
        if let Some(d) = data {
            op.data_offset = Some(self.data.len() as u64);
            op.data_length = Some(d.len() as u64);
            op.data_sha256_hash = Some(sha256(d).to_vec());
            self.data.extend_from_slice(d);
        }
        if !src.is_empty()
            && let Some(old) = &self.old[part]
        {
            let mut s = Vec::new();
            for e in src {
                let (a, n) = (
                    e.start().saturating_mul(bs) as usize,
                    e.len().saturating_mul(bs).min(1 << 30) as usize,
                );
                let mut chunk = old.get(a..).unwrap_or_default().to_vec();
                chunk.resize(n, 0);
                chunk.truncate(n);
                s.extend(chunk);
            }
            op.src_length = Some(s.len() as u64);
            op.src_sha256_hash = Some(sha256(&s).to_vec());
        }
        if matches!(t, OpType::SourceBsdiff | OpType::BrotliBsdiff) {
            op.dst_length = Some(crate::apply::blocks(dst) * bs);
        }
        self.manifest.partitions[part].operations.push(op);
    }

    /// Adds a merge operation to partition `part`: `dst` from `src` (COW_XOR at byte
    /// `offset` of its first block; the source extent then has one block more).
    pub fn merge(&mut self, part: usize, t: CowMergeType, src: Extent, dst: Extent, offset: u32) {
        self.manifest.partitions[part]
            .merge_operations
            .push(CowMergeOperation {
                r#type: Some(t as i32),
                src_extent: Some(src),
                dst_extent: Some(dst),
                src_offset: (offset != 0).then_some(offset),
            });
    }

    /// The payload's bytes, signed by `signer` when one is given.
    pub fn finish(mut self, signer: Option<Signer<'_>>) -> Vec<u8> {
        // An EC signature's DER length varies by a few bytes: every signature is
        // padded to one size, with its own length beside it, as update_engine does.
        let pad_to = signer.map_or(0, |s| s(&[0; 32]).len() + 8);
        let wrap = |sig: Vec<u8>| {
            let n = sig.len() as u32;
            let mut data = sig;
            data.resize(pad_to.max(data.len()), 0);
            Signatures {
                signatures: vec![Signature {
                    version: None,
                    unpadded_signature_size: Some(n),
                    data: Some(data),
                }],
            }
            .encode_to_vec()
        };
        let sig_len = signer.map_or(0, |s| wrap(s(&[0; 32])).len());
        if signer.is_some() {
            self.manifest.signatures_offset = Some(self.data.len() as u64);
            self.manifest.signatures_size = Some(sig_len as u64);
        }
        let manifest = self.manifest.encode_to_vec();
        let mut out = Vec::new();
        out.extend_from_slice(b"CrAU");
        out.extend_from_slice(&2u64.to_be_bytes());
        out.extend_from_slice(&(manifest.len() as u64).to_be_bytes());
        out.extend_from_slice(&(sig_len as u32).to_be_bytes());
        out.extend_from_slice(&manifest);
        let metadata_len = out.len();
        debug_assert_eq!(metadata_len as u64, HEADER_LEN + manifest.len() as u64);
        let Some(signer) = signer else {
            out.extend_from_slice(&self.data);
            return out;
        };
        let meta_sig = wrap(signer(&sha256(&out)));
        let mut signed = out.clone();
        signed.extend_from_slice(&self.data);
        let payload_sig = wrap(signer(&sha256(&signed)));
        out.extend_from_slice(&meta_sig);
        out.extend_from_slice(&self.data);
        out.extend_from_slice(&payload_sig);
        out
    }
}

/// Opens `data` as a payload (a file of those bytes).
pub fn open(data: &[u8]) -> crate::Result<Payload> {
    Payload::open(Source::from_reader(
        "fuzz input",
        Box::new(data.to_vec()),
        data.len() as u64,
    ))
}

/// The fuzz target's body: any bytes, opened, described and applied against an old
/// image of zeros; partitions over 16 MiB are skipped (the work, not the checks, is
/// what grows with them). Nothing may panic.
pub fn exercise_read(data: &[u8]) {
    let Ok(p) = open(data) else { return };
    let _ = crate::info::Info::of(&p);
    let _ = crate::verify::metadata_hash(&p);
    let zeros = vec![0u8; 16 << 20];
    for part in &p.manifest.partitions {
        let new = part.new_partition_info.as_ref().and_then(|i| i.size);
        if new.is_none_or(|n| n > 16 << 20) {
            continue;
        }
        let Ok(out) = tempfile::tempfile() else {
            return;
        };
        let old = crate::apply::Old {
            image: &zeros,
            size: zeros.len() as u64,
        };
        let _ = crate::apply::apply_partition(
            &p,
            part,
            Some(old),
            &out,
            std::path::Path::new("fuzz output"),
            crate::apply::Trust::Unverified,
            &|_| {},
        );
    }
}

/// A test key pair made with `openssl genrsa` in `dir`: (private, public) PEM paths.
pub fn openssl_key(dir: &std::path::Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let key = dir.join(format!("{name}.pem"));
    let public = dir.join(format!("{name}.pub.pem"));
    run("openssl", &["genrsa", "-out", s(&key), "2048"], &[]);
    run(
        "openssl",
        &["rsa", "-in", s(&key), "-pubout", "-out", s(&public)],
        &[],
    );
    (key, public)
}

/// Signs a SHA-256 as update_engine's signer does. RSA: the DER DigestInfo prefix and
/// the hash, signed raw with PKCS#1 v1.5 padding by `openssl pkeyutl` (`rsautl
/// -sign`). EC: the hash signed by `openssl pkeyutl` (a DER ECDSA signature).
pub fn openssl_sign(key: &std::path::Path, hash: &[u8; 32]) -> Vec<u8> {
    let pem = std::fs::read_to_string(key).unwrap_or_default();
    let ec = run("openssl", &["pkey", "-in", s(key), "-noout", "-text"], &[])
        .windows(5)
        .any(|w| w == b"ASN1 ");
    if ec || pem.contains("EC PRIVATE KEY") {
        return run("openssl", &["pkeyutl", "-sign", "-inkey", s(key)], hash);
    }
    const SHA256_DIGEST_INFO: [u8; 19] = [
        0x30, 0x31, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01,
        0x05, 0x00, 0x04, 0x20,
    ];
    let mut input = SHA256_DIGEST_INFO.to_vec();
    input.extend_from_slice(hash);
    run("openssl", &["pkeyutl", "-sign", "-inkey", s(key)], &input)
}

fn s(p: &std::path::Path) -> &str {
    p.to_str().unwrap_or_default()
}

/// Runs a reference tool with `input` on stdin; its stdout. Panics on failure (test
/// support).
pub fn run(tool: &str, args: &[&str], input: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut child = Command::new(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{tool}: {e} (scripts/install-deps.sh installs it)"));
    let mut stdin = child.stdin.take();
    let data = input.to_vec();
    let writer = std::thread::spawn(move || {
        if let Some(si) = stdin.as_mut() {
            let _ = si.write_all(&data);
        }
    });
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
    let _ = writer.join();
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// `blocks` 4 KiB blocks of varied data (runs of text, noise, zeros), from `seed`.
pub fn image(seed: u64, blocks: usize) -> Vec<u8> {
    let mut rng = fastrand_lite(seed);
    let mut v = Vec::with_capacity(blocks * 4096);
    for b in 0..blocks {
        match b % 5 {
            0 => v.extend((0..4096).map(|_| rng() as u8)),
            1 => v.extend(
                format!("block {b} of seed {seed} ")
                    .bytes()
                    .cycle()
                    .take(4096),
            ),
            2 => v.extend(std::iter::repeat_n(0u8, 4096)),
            _ => {
                v.extend((0..4096).map(|i| (i as u64 * seed + b as u64) as u8 ^ (rng() as u8 & 3)))
            }
        }
    }
    v
}

/// A small deterministic generator (xorshift), so the fuzzing feature needs no
/// random crate.
fn fastrand_lite(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// `data`'s blocks `[from, from + n)`, the last one padded with zeros to a whole block.
pub fn blocks_of(data: &[u8], from: usize, n: usize) -> Vec<u8> {
    let mut v = data.get(from * 4096..).unwrap_or_default().to_vec();
    v.resize(n * 4096, 0);
    v.truncate(n * 4096);
    v
}

/// A BSDIFF40 patch from `old` to `new`, made by the `bsdiff` tool.
pub fn bsdiff_tool(dir: &std::path::Path, old: &[u8], new: &[u8]) -> Vec<u8> {
    let (o, n, p) = (dir.join("bs.old"), dir.join("bs.new"), dir.join("bs.patch"));
    std::fs::write(&o, old).expect("write");
    std::fs::write(&n, new).expect("write");
    run("bsdiff", &[s(&o), s(&n), s(&p)], &[]);
    std::fs::read(&p).expect("read the patch")
}

/// The same patch in AOSP's BSDF2 container, its three streams recompressed with
/// brotli (as BROTLI_BSDIFF carries them).
pub fn bsdf2_from_bsdiff40(patch: &[u8]) -> Vec<u8> {
    use std::io::{Read as _, Write as _};
    let num = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&patch[at..at + 8]);
        b[7] &= 0x7f;
        u64::from_le_bytes(b) as usize
    };
    let (c, d) = (num(8), num(16));
    let body = &patch[32..];
    let streams = [&body[..c], &body[c..c + d], &body[c + d..]];
    let mut out = b"BSDF2\x02\x02\x02".to_vec();
    let mut packed = Vec::new();
    for (i, st) in streams.iter().enumerate() {
        let mut raw = Vec::new();
        bzip2::read::BzDecoder::new(*st)
            .read_to_end(&mut raw)
            .expect("bzip2");
        let mut z = Vec::new();
        {
            let mut w = brotli::CompressorWriter::new(&mut z, 4096, 9, 22);
            w.write_all(&raw).expect("brotli");
        }
        if i < 2 {
            out.extend((z.len() as u64).to_le_bytes());
        }
        packed.push(z);
    }
    out.extend_from_slice(&patch[24..32]);
    for z in packed {
        out.extend(z);
    }
    out
}

/// A full payload of two partitions (system: 40 blocks, vendor: 9 blocks less 1000
/// bytes) using every data operation a full payload has: REPLACE, REPLACE_BZ,
/// REPLACE_XZ and REPLACE_ZSTD (compressed by the reference tools), ZERO and
/// DISCARD. Returns it and the two images.
pub fn sample_full(signer: Option<Signer<'_>>) -> (Vec<u8>, Vec<(String, Vec<u8>)>) {
    let mut system = image(1, 40);
    system[24 * 4096..32 * 4096].fill(0);
    let mut vendor = image(2, 9);
    vendor.truncate(9 * 4096 - 1000);
    let mut b = Builder::new(0);
    let sys = b.partition("system", None, &system);
    let e = Extent::new;
    b.op(
        sys,
        OpType::Replace,
        &[],
        &[e(0, 4)],
        Some(&blocks_of(&system, 0, 4)),
    );
    let bz = run("bzip2", &["-c"], &blocks_of(&system, 4, 8));
    b.op(sys, OpType::ReplaceBz, &[], &[e(4, 8)], Some(&bz));
    let xz = run("xz", &["-c"], &blocks_of(&system, 12, 12));
    b.op(sys, OpType::ReplaceXz, &[], &[e(12, 12)], Some(&xz));
    b.op(sys, OpType::Zero, &[], &[e(24, 4)], None);
    b.op(sys, OpType::Discard, &[], &[e(28, 4)], None);
    // Two destination runs, the later one first.
    let mut z = blocks_of(&system, 36, 4);
    z.extend(blocks_of(&system, 32, 4));
    let zst = run("zstd", &["-c", "-q"], &z);
    b.op(
        sys,
        OpType::ReplaceZstd,
        &[],
        &[e(36, 4), e(32, 4)],
        Some(&zst),
    );
    let ven = b.partition("vendor", None, &vendor);
    let xz = run("xz", &["-c"], &blocks_of(&vendor, 0, 9));
    b.op(ven, OpType::ReplaceXz, &[], &[e(0, 9)], Some(&xz));
    (
        b.finish(signer),
        vec![("system".into(), system), ("vendor".into(), vendor)],
    )
}

/// An incremental payload of one partition (system, 40 blocks) with SOURCE_COPY,
/// SOURCE_BSDIFF (a BSDIFF40 patch from the `bsdiff` tool), BROTLI_BSDIFF (that
/// tool's patch in BSDF2 with brotli streams, across two source runs) and REPLACE.
/// Returns it, the old image and the new one.
pub fn sample_incremental(
    dir: &std::path::Path,
    signer: Option<Signer<'_>>,
) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let old = image(3, 40);
    let mut new = vec![0u8; 40 * 4096];
    // 0..8: old 24..32 moved.
    new[..8 * 4096].copy_from_slice(&old[24 * 4096..32 * 4096]);
    // 8..24: old 0..16 with a few bytes changed and a run inserted.
    let mut edited = old[..16 * 4096].to_vec();
    for i in (100..edited.len()).step_by(3001) {
        edited[i] ^= 0x5a;
    }
    edited.splice(5000..5000, b"inserted text".iter().copied());
    edited.truncate(16 * 4096);
    new[8 * 4096..24 * 4096].copy_from_slice(&edited);
    // 24..32: old 32..36 and 16..20 (two runs) edited.
    let mut two = old[32 * 4096..36 * 4096].to_vec();
    two.extend_from_slice(&old[16 * 4096..20 * 4096]);
    let mut two_new = two.clone();
    for i in (7..two_new.len()).step_by(777) {
        two_new[i] = two_new[i].wrapping_add(1);
    }
    new[24 * 4096..32 * 4096].copy_from_slice(&two_new);
    // 32..40: new data.
    new[32 * 4096..].copy_from_slice(&image(4, 8));

    let mut b = Builder::new(8);
    let sys = b.partition("system", Some(old.clone()), &new);
    let e = Extent::new;
    b.op(sys, OpType::SourceCopy, &[e(24, 8)], &[e(0, 8)], None);
    let p40 = bsdiff_tool(dir, &old[..16 * 4096], &edited);
    b.op(
        sys,
        OpType::SourceBsdiff,
        &[e(0, 16)],
        &[e(8, 16)],
        Some(&p40),
    );
    let p2 = bsdf2_from_bsdiff40(&bsdiff_tool(dir, &two, &two_new));
    b.op(
        sys,
        OpType::BrotliBsdiff,
        &[e(32, 4), e(16, 4)],
        &[e(24, 8)],
        Some(&p2),
    );
    b.op(
        sys,
        OpType::Replace,
        &[],
        &[e(32, 8)],
        Some(&new[32 * 4096..]),
    );
    // The merge order update_engine's generator would give: the self-overlapping
    // XOR split in two, back half first; the COPY before the XOR that overwrites
    // its source; an XOR at a byte offset.
    b.merge(sys, CowMergeType::CowXor, e(8, 8), e(16, 8), 0);
    b.merge(sys, CowMergeType::CowXor, e(0, 8), e(8, 8), 0);
    b.merge(sys, CowMergeType::CowCopy, e(24, 8), e(0, 8), 0);
    b.merge(sys, CowMergeType::CowXor, e(32, 5), e(24, 4), 100);
    b.manifest.dynamic_partition_metadata = Some(DynamicPartitionMetadata {
        snapshot_enabled: Some(true),
        vabc_enabled: Some(true),
        vabc_compression_param: Some("lz4".into()),
        cow_version: Some(3),
        compression_factor: Some(65536),
        ..Default::default()
    });
    (b.finish(signer), old, new)
}

/// A file of puffin's reference vectors (tests/vectors/puffin).
pub fn puffin_vector(name: &str) -> Vec<u8> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/vectors/puffin")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Text-like data with some random runs (LZ4 blocks of it compress unevenly).
pub fn lz4_text(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = fastrand_lite(seed);
    let words: [&[u8]; 5] = [b"erofs ", b"lz4 ", b"block ", b"update ", b"\n"];
    let mut v = Vec::new();
    while v.len() < len {
        let r = rng();
        if r.is_multiple_of(25) {
            v.extend((0..1 + (r >> 8) % 30).map(|_| rng() as u8));
        } else {
            v.extend_from_slice(words[(r >> 8) as usize % words.len()]);
        }
    }
    v.truncate(len);
    v
}

/// An incremental payload of one partition (vendor) whose files are compressed or
/// executable: a zip changed by a PUFFDIFF operation (puffin's own patch of its
/// blocks, its `blocks` vector), an EROFS-like LZ4HC file changed by an
/// LZ4DIFF_BSDIFF operation (made as update_engine's generator makes it, with fixes
/// for blocks compressed at another level), and a binary changed by a ZUCCHINI
/// operation (a raw ensemble patch, brotli-compressed). Returns it, the old image and
/// the new one.
pub fn sample_incremental_compressed(dir: &std::path::Path) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    use crate::lz4diff::{CompressionAlgorithm, compress_for_tests, make_patch};
    let bs = 4096usize;
    let pad = |mut v: Vec<u8>| {
        v.resize(v.len().div_ceil(bs) * bs, 0);
        v
    };
    let (zip_old, zip_new) = (puffin_vector("blocks.src"), puffin_vector("blocks.dst"));
    let hc = |level| CompressionAlgorithm { r#type: 2, level };
    let text = lz4_text(21, 120_000);
    let mut edited = text.clone();
    edited.splice(40_000..40_000, lz4_text(22, 2000));
    edited[90_000..90_500].fill(b'-');
    let (lz_old, old_blocks) = compress_for_tests(&hc(9), &text, bs, true);
    let (lz_new, new_blocks) = compress_for_tests(&hc(12), &edited, bs, true);
    assert!(lz_old.len() % bs == 0 && lz_new.len() % bs == 0);
    let lz_patch = make_patch(
        (&lz_old, &old_blocks),
        (&lz_new, &new_blocks),
        &hc(9),
        true,
        dir,
    );
    let zo = pad(zip_old);
    let zn = pad(zip_new);
    let bin_old = image(31, 6);
    let mut bin_new = bin_old[4096..].to_vec();
    bin_new.extend_from_slice(&bin_old[..4096]);
    bin_new[300..340].fill(0x90);
    let zuc = crate::zucchini::brotli_for_tests(&crate::zucchini::raw_patch_for_tests(
        &bin_old, &bin_new,
    ));
    let old = [zo.clone(), lz_old.clone(), bin_old.clone()].concat();
    let new = [zn.clone(), lz_new.clone(), bin_new.clone()].concat();
    let blocks = |v: &[u8]| (v.len() / bs) as u64;
    let e = Extent::new;
    let mut b = Builder::new(9);
    let part = b.partition("vendor", Some(old.clone()), &new);
    b.op(
        part,
        OpType::Puffdiff,
        &[e(0, blocks(&zo))],
        &[e(0, blocks(&zn))],
        Some(&puffin_vector("zip.patch")),
    );
    b.op(
        part,
        OpType::Lz4diffBsdiff,
        &[e(blocks(&zo), blocks(&lz_old))],
        &[e(blocks(&zn), blocks(&lz_new))],
        Some(&lz_patch),
    );
    let at = blocks(&zo) + blocks(&lz_old);
    b.op(
        part,
        OpType::Zucchini,
        &[e(at, blocks(&bin_old))],
        &[e(blocks(&zn) + blocks(&lz_new), blocks(&bin_new))],
        Some(&zuc),
    );
    (b.finish(None), old, new)
}

/// A one-file HTTP/1.1 server on 127.0.0.1 answering `Range: bytes=A-B` with 206 (and
/// without a range, the whole file with 200). Returns the URL (ending in `name`) and
/// the byte ranges sent (first, last).
pub fn range_server(data: Vec<u8>, name: &str) -> (String, Ranges) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}/{name}", listener.local_addr().expect("address"));
    let sent = Ranges::default();
    let count = sent.clone();
    let data = std::sync::Arc::new(data);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let (data, count) = (data.clone(), count.clone());
            // A thread per connection: the client keeps idle connections open.
            std::thread::spawn(move || serve_ranges(conn, &data, &count));
        }
    });
    (url, sent)
}

/// The ranges a [`range_server`] sent.
pub type Ranges = std::sync::Arc<std::sync::Mutex<Vec<(u64, u64)>>>;

fn serve_ranges(conn: std::net::TcpStream, data: &[u8], count: &Ranges) {
    use std::io::{BufRead as _, BufReader, Write as _};
    let Ok(read_half) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut conn = conn;
    loop {
        let mut range = None;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(r) = lower.strip_prefix("range: bytes=") {
                let (a, b) = r.trim().split_once('-').unwrap_or(("0", ""));
                let a: usize = a.parse().unwrap_or(0);
                let b: usize = b.parse().unwrap_or(usize::MAX);
                range = Some((a, b.min(data.len().saturating_sub(1))));
            }
        }
        let (head, body) = match range {
            Some((a, b)) if a <= b => (
                format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{}\r\n",
                    data.len()
                ),
                &data[a..=b],
            ),
            _ => ("HTTP/1.1 200 OK\r\n".to_string(), data),
        };
        let head = format!("{head}Content-Length: {}\r\n\r\n", body.len());
        if let Ok(mut log) = count.lock() {
            let first = (body.as_ptr() as usize - data.as_ptr() as usize) as u64;
            log.push((first, first + body.len() as u64 - 1));
        }
        if conn.write_all(head.as_bytes()).is_err() || conn.write_all(body).is_err() {
            return;
        }
    }
}

/// update_engine's sample payloads and images (tests/vectors/update_engine/,
/// PROVENANCE.md there), unpacked into `dir` with `tar`: `full_payload.bin`,
/// `delta_payload.bin`, and under `images/` the old images (`disk_ext2_4k_empty.img`
/// for kernel, `disk_sqfs_empty.img` for root) and the new ones (`disk_ext2_4k.img`,
/// `disk_sqfs_default.img`).
pub fn update_engine_samples(dir: &std::path::Path) {
    let vectors =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/update_engine");
    let images = dir.join("images");
    std::fs::create_dir_all(&images).expect("create the images folder");
    let payloads = vectors.join("sample_payloads.tar.xz");
    let imgs = vectors.join("sample_images.tar.bz2");
    run("tar", &["-xJf", s(&payloads), "-C", s(dir)], &[]);
    run("tar", &["-xjf", s(&imgs), "-C", s(&images)], &[]);
}

/// The body of the `bspatch` fuzz target: the first two bytes give the old data's
/// length, the old data follows, then the patch (BSDIFF40 or BSDF2). Nothing may
/// panic, and nothing larger than 1 MiB may be made.
pub fn exercise_bspatch(data: &[u8]) {
    exercise_patch(data, |old, patch| {
        crate::bspatch::apply(old, patch, 1 << 20).ok()
    });
}

/// Splits a patch fuzz input (see [`bspatch_input`]) and checks that `apply` makes at
/// most 1 MiB.
fn exercise_patch(data: &[u8], apply: impl Fn(&[u8], &[u8]) -> Option<Vec<u8>>) {
    let Some((len, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let n = usize::from(u16::from_le_bytes(*len)).min(rest.len());
    let (old, patch) = rest.split_at(n);
    if let Some(new) = apply(old, patch) {
        assert!(new.len() <= 1 << 20);
    }
}

/// The body of the `puffpatch` fuzz target: the input as [`exercise_bspatch`] reads
/// it, the patch a puffin patch. Nothing may panic, and nothing larger than 1 MiB may
/// be made.
pub fn exercise_puffpatch(data: &[u8]) {
    exercise_patch(data, |old, patch| {
        crate::puffin::apply(old, patch, 1 << 20).ok()
    });
}

/// The body of the `lz4diff` fuzz target: the input as [`exercise_bspatch`] reads
/// it, the patch an lz4diff patch. Nothing may panic, and nothing larger than 1 MiB
/// may be made.
pub fn exercise_lz4diff(data: &[u8]) {
    exercise_patch(data, |old, patch| {
        crate::lz4diff::apply(old, patch, 1 << 20).ok()
    });
}

/// The body of the `zucchini` fuzz target: the input as [`exercise_bspatch`] reads
/// it, the patch a zucchini patch (not brotli-compressed, so that the fuzzer reaches
/// the parser). Nothing may panic, and nothing larger than 1 MiB may be made.
pub fn exercise_zucchini(data: &[u8]) {
    exercise_patch(data, |old, patch| {
        // The size it claims, so that a patch can apply; bounded.
        let n = patch
            .get(16..20)
            .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        crate::zucchini::apply_patch(old, patch, u64::from(n).min(1 << 20)).ok()
    });
}

/// A `bspatch`, `puffpatch`, `lz4diff` or `zucchini` fuzz input: `old` and `patch` as [`exercise_bspatch`]
/// reads them.
pub fn bspatch_input(old: &[u8], patch: &[u8]) -> Vec<u8> {
    let mut v = (old.len().min(u16::MAX as usize) as u16)
        .to_le_bytes()
        .to_vec();
    v.extend_from_slice(&old[..old.len().min(u16::MAX as usize)]);
    v.extend_from_slice(patch);
    v
}

/// An OTA zip at `zip` holding `payload` as Android stores it (uncompressed, after a
/// deflated metadata entry), written by Python's `zipfile` as the reference writer.
pub fn ota_zip(payload: &std::path::Path, zip: &std::path::Path) {
    run(
        "python3",
        &[
            "-c",
            "import sys, zipfile\n\
             z = zipfile.ZipFile(sys.argv[1], 'w')\n\
             z.writestr('META-INF/com/android/metadata', 'ota-type=AB\\n', zipfile.ZIP_DEFLATED)\n\
             z.write(sys.argv[2], 'payload.bin', zipfile.ZIP_STORED)\n\
             z.writestr('payload_properties.txt', 'FILE_SIZE=1\\n', zipfile.ZIP_DEFLATED)\n",
            s(zip),
            s(payload),
        ],
        &[],
    );
}
