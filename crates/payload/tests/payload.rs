//! Payloads laid out and signed in update_engine's order, with every piece made by a
//! reference tool (RSA signatures by `openssl pkeyutl` as update_engine's signer makes
//! them, bzip2/xz/zstd streams by those tools, BSDIFF40 patches by `bsdiff`, the OTA
//! zip by Python's `zipfile`): every operation applies to the exact new image; a
//! changed byte anywhere, another key, a wrong old image or an operation we do not
//! apply is refused, naming where, before anything is written.

use std::path::Path;

use payload::apply::{Old, Trust, apply_partition};
use payload::fuzzing::{self, Builder};
use payload::proto::{Extent, OpType};
use payload::{Keys, Payload, Source};

fn open_bytes(data: &[u8]) -> payload::Result<Payload> {
    fuzzing::open(data)
}

/// Applies every partition of `p` (old images from `olds`) into memory.
fn apply_all(
    p: &Payload,
    olds: &[(&str, &Vec<u8>)],
    trust: Trust,
) -> payload::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for part in &p.manifest.partitions {
        let f = tempfile::tempfile().unwrap();
        let old = olds
            .iter()
            .find(|(n, _)| *n == part.partition_name)
            .map(|(_, d)| Old {
                image: *d,
                size: d.len() as u64,
            });
        apply_partition(p, part, old, &f, Path::new("out"), trust, &|_| {})?;
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut &f, &mut v).unwrap();
        out.push((part.partition_name.clone(), v));
    }
    Ok(out)
}

struct Key {
    _dir: tempfile::TempDir,
    private: std::path::PathBuf,
    public: std::path::PathBuf,
}

fn key(name: &str) -> Key {
    let dir = tempfile::tempdir().unwrap();
    let (private, public) = fuzzing::openssl_key(dir.path(), name);
    Key {
        _dir: dir,
        private,
        public,
    }
}

fn keys(k: &Key) -> Keys {
    Keys::from_pem_file(&k.public).unwrap()
}

#[test]
fn a_signed_full_payload_extracts_exactly_and_verifies() {
    let k = key("k");
    let sign = |h: &[u8; 32]| fuzzing::openssl_sign(&k.private, h);
    let (bytes, images) = fuzzing::sample_full(Some(&sign));
    let p = open_bytes(&bytes).unwrap();
    assert!(!p.is_incremental());
    payload::verify::verify_metadata(&p, &keys(&k)).unwrap();
    payload::verify::verify_payload(&p, &keys(&k), &|_| {}).unwrap();
    let got = apply_all(&p, &[], Trust::Verified).unwrap();
    assert_eq!(got, images);
    let info = payload::info::Info::of(&p);
    assert_eq!(info.kind, "full");
    let sys = &info.partitions[0].operations_by_type;
    for t in [
        "REPLACE",
        "REPLACE_BZ",
        "REPLACE_XZ",
        "REPLACE_ZSTD",
        "ZERO",
        "DISCARD",
    ] {
        assert_eq!(sys.get(t), Some(&1), "{t}: {sys:?}");
    }
}

#[test]
fn a_signed_incremental_payload_applies_every_source_operation() {
    let k = key("k");
    let dir = tempfile::tempdir().unwrap();
    let sign = |h: &[u8; 32]| fuzzing::openssl_sign(&k.private, h);
    let (bytes, old, new) = fuzzing::sample_incremental(dir.path(), Some(&sign));
    let p = open_bytes(&bytes).unwrap();
    assert!(p.is_incremental());
    payload::verify::verify_metadata(&p, &keys(&k)).unwrap();
    payload::verify::verify_payload(&p, &keys(&k), &|_| {}).unwrap();
    let got = apply_all(&p, &[("system", &old)], Trust::Verified).unwrap();
    assert!(got[0].1 == new, "the new image differs");
    // Without the old image, nothing is applied.
    let e = apply_all(&p, &[], Trust::Verified).unwrap_err().to_string();
    assert!(e.contains("old partition is needed"), "{e}");
}

#[test]
fn compressed_and_executable_files_apply_through_puffdiff_lz4diff_and_zucchini() {
    let dir = tempfile::tempdir().unwrap();
    let (bytes, old, new) = fuzzing::sample_incremental_compressed(dir.path());
    let p = open_bytes(&bytes).unwrap();
    let got = apply_all(&p, &[("vendor", &old)], Trust::Unverified).unwrap();
    assert!(got[0].1 == new, "the new image differs");
    // Another old image: the source hash names the operation before its patch runs.
    let mut other = old.clone();
    other[5000] ^= 1;
    let e = apply_all(&p, &[("vendor", &other)], Trust::Unverified)
        .unwrap_err()
        .to_string();
    assert!(e.contains("operation 0 (PUFFDIFF)"), "{e}");
}

#[test]
fn a_wrong_old_image_is_named_by_the_operation_that_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let (bytes, mut old, _) = fuzzing::sample_incremental(dir.path(), None);
    old[24 * 4096 + 5] ^= 1;
    let p = open_bytes(&bytes).unwrap();
    let e = apply_all(&p, &[("system", &old)], Trust::Unverified)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("partition system, operation 0 (SOURCE_COPY)")
            && e.contains("not the one the payload was made against"),
        "{e}"
    );
}

#[test]
fn any_changed_byte_or_another_key_is_refused() {
    let k = key("k");
    let other = key("other");
    let sign = |h: &[u8; 32]| fuzzing::openssl_sign(&k.private, h);
    let (bytes, _) = fuzzing::sample_full(Some(&sign));
    let p = open_bytes(&bytes).unwrap();
    assert!(payload::verify::verify_metadata(&p, &keys(&other)).is_err());
    let data_at = p.header.data_offset() as usize;
    let (sig_at, _) = p.payload_signature_range().unwrap();
    // A byte of the manifest, of the metadata signature, of the data, of the payload
    // signature: each is refused by one of the checks, and every extraction that
    // trusts the key refuses all but the last before writing.
    for (what, at) in [
        ("manifest", 60usize),
        ("metadata signature", data_at - 100),
        ("data", data_at + 5000),
        ("payload signature", sig_at as usize + 40),
    ] {
        let mut b = bytes.clone();
        b[at] ^= 0x20;
        let meta_ok =
            open_bytes(&b).is_ok_and(|p| payload::verify::verify_metadata(&p, &keys(&k)).is_ok());
        let whole_ok = open_bytes(&b)
            .is_ok_and(|p| payload::verify::verify_payload(&p, &keys(&k), &|_| {}).is_ok());
        match what {
            // The payload signature leaves the metadata signature out, as update_engine's
            // does; the metadata signature's own check refuses it.
            "metadata signature" => assert!(!meta_ok && whole_ok, "{what}"),
            _ => assert!(!whole_ok, "{what}: the payload signature still verifies"),
        }
        match what {
            "data" => {
                assert!(meta_ok, "{what}");
                let p = open_bytes(&b).unwrap();
                let e = apply_all(&p, &[], Trust::Verified).unwrap_err().to_string();
                assert!(
                    e.contains("partition system, operation") && e.contains("SHA-256"),
                    "{e}"
                );
            }
            "payload signature" => assert!(meta_ok, "{what}"),
            _ => assert!(!meta_ok, "{what}: the metadata signature still verifies"),
        }
    }
}

#[test]
fn an_ota_zip_is_read_in_place_and_a_url_by_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let (bytes, images) = fuzzing::sample_full(None);
    let bin = dir.path().join("payload.bin");
    std::fs::write(&bin, &bytes).unwrap();
    let zip = dir.path().join("ota.zip");
    // Python's zipfile as the reference writer, payload.bin stored as Android stores
    // it, after other entries.
    fuzzing::ota_zip(&bin, &zip);
    let z = Payload::open(Source::open(zip.to_str().unwrap()).unwrap()).unwrap();
    assert!(z.source().name().ends_with("ota.zip!payload.bin"));
    assert_eq!(z.source().len(), bytes.len() as u64);
    assert_eq!(apply_all(&z, &[], Trust::Unverified).unwrap(), images);

    let zip_bytes = std::fs::read(&zip).unwrap();
    let (url, sent) = fuzzing::range_server(zip_bytes.clone(), "ota.zip");
    let u = Payload::open(Source::open(&url).unwrap()).unwrap();
    // Only vendor: system's data is never fetched.
    let vendor = u.partition("vendor").unwrap();
    let f = tempfile::tempfile().unwrap();
    apply_partition(
        &u,
        vendor,
        None,
        &f,
        Path::new("out"),
        Trust::Unverified,
        &|_| {},
    )
    .unwrap();
    let mut v = Vec::new();
    std::io::Read::read_to_end(&mut &f, &mut v).unwrap();
    assert_eq!(v, images[1].1);
    // System's data was not fetched: at most the 4 KiB read of the zip's local header
    // reaches into it.
    let payload_at = zip_bytes.windows(4).position(|w| w == b"CrAU").unwrap() as u64;
    let base = payload_at + u.header.data_offset();
    let sent = sent.lock().unwrap().clone();
    let mut overlap = 0;
    for op in &u.partition("system").unwrap().operations {
        let (Some(off), Some(len)) = (op.data_offset, op.data_length) else {
            continue;
        };
        let (a, b) = (base + off, base + off + len - 1);
        for &(x, y) in &sent {
            overlap += (y.min(b) + 1).saturating_sub(x.max(a));
        }
    }
    let system: u64 = u
        .partition("system")
        .unwrap()
        .operations
        .iter()
        .filter_map(|o| o.data_length)
        .sum();
    assert!(
        overlap <= 4096,
        "{overlap} of system's {system} data bytes fetched: {sent:?}"
    );
}

#[test]
fn operations_we_do_not_apply_and_bad_extents_fail_before_any_write() {
    let img = fuzzing::image(5, 8);
    fn e(start: u64, n: u64) -> Extent {
        Extent::new(start, n)
    }
    type Case = (&'static str, Box<dyn Fn(&mut Builder, usize)>);
    let cases: Vec<Case> = vec![
        (
            "BSDIFF is not supported",
            Box::new(|b: &mut Builder, p| {
                b.op(p, OpType::Bsdiff, &[e(0, 1)], &[e(0, 1)], Some(b"x"))
            }),
        ),
        (
            "written by operation 1 too",
            Box::new(|b: &mut Builder, p| {
                b.op(p, OpType::Zero, &[], &[e(0, 2)], None);
                b.op(p, OpType::Zero, &[], &[e(1, 1)], None)
            }),
        ),
        (
            "more than any encoding",
            Box::new(|b: &mut Builder, p| {
                b.op(
                    p,
                    OpType::ReplaceXz,
                    &[],
                    &[e(0, 1)],
                    Some(&vec![7u8; 2 << 20]),
                )
            }),
        ),
        (
            "outside the new partition",
            Box::new(|b: &mut Builder, p| b.op(p, OpType::Zero, &[], &[e(7, 2)], None)),
        ),
        (
            "outside the old partition",
            Box::new(|b: &mut Builder, p| {
                b.op(
                    p,
                    OpType::SourceCopy,
                    &[e(u64::MAX - 1, 2)],
                    &[e(0, 2)],
                    None,
                )
            }),
        ),
    ];
    for (want, add) in cases {
        let mut b = Builder::new(8);
        let p = b.partition("system", Some(img.clone()), &img);
        // A valid first operation: nothing of it may be written either.
        b.op(
            p,
            OpType::Replace,
            &[],
            &[e(3, 1)],
            Some(&img[3 * 4096..4 * 4096]),
        );
        add(&mut b, p);
        let bytes = b.finish(None);
        let pl = open_bytes(&bytes).unwrap();
        let f = tempfile::tempfile().unwrap();
        let old = Old {
            image: &img,
            size: img.len() as u64,
        };
        let err = apply_partition(
            &pl,
            &pl.manifest.partitions[0],
            Some(old),
            &f,
            Path::new("o"),
            Trust::Unverified,
            &|_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(want) && err.contains("partition system, operation"),
            "{want}: {err}"
        );
        assert_eq!(f.metadata().unwrap().len(), 0, "{want}: written");
    }
}

#[test]
fn a_cut_or_crafted_header_names_the_offset() {
    let (bytes, _) = fuzzing::sample_full(None);
    for (cut, want) in [
        (10, "too short for a payload header"),
        (100, "run past the end"),
        (bytes.len() - 3, ""),
    ] {
        let r = open_bytes(&bytes[..cut]);
        if want.is_empty() {
            // The manifest is whole: the cut shows when the last data is read.
            let p = r.unwrap();
            let e = apply_all(&p, &[], Trust::Unverified)
                .unwrap_err()
                .to_string();
            assert!(e.contains("past the end"), "{e}");
        } else {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("fuzz input"), "{cut}: {e}");
        }
    }
    let mut b = bytes.clone();
    b[4..12].copy_from_slice(&1u64.to_be_bytes());
    assert!(
        open_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("(at offset 4)")
    );
    let mut b = bytes.clone();
    b[12..20].copy_from_slice(&u64::MAX.to_be_bytes());
    assert!(
        open_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("(at offset 12)")
    );
    // A partition name that would leave the output folder.
    let mut bl = Builder::new(0);
    bl.partition("../etc", None, &[0u8; 4096]);
    let e = open_bytes(&bl.finish(None)).unwrap_err().to_string();
    assert!(e.contains("not a plain name"), "{e}");
}

/// The merge operations of the sample as the COW's plan, with `edit` applied to them
/// first.
fn cow_plan(
    edit: impl Fn(&mut Vec<payload::proto::CowMergeOperation>),
) -> payload::Result<delta::Plan> {
    let dir = tempfile::tempdir().unwrap();
    let (bytes, old, new) = fuzzing::sample_incremental(dir.path(), None);
    let mut p = open_bytes(&bytes).unwrap();
    edit(&mut p.manifest.partitions[0].merge_operations);
    let part = p.manifest.partitions[0].clone();
    payload::cow::plan(
        &p,
        &part,
        &delta::MemImage::new("old", old),
        &delta::MemImage::new("new", new),
    )
}

#[test]
fn merge_operations_become_copy_and_xor_ops_in_their_order() {
    let plan = cow_plan(|_| {}).unwrap();
    let c = plan.census;
    assert_eq!(
        (c.copy, c.xor, c.replace, c.zero, c.unchanged),
        (8, 20, 12, 0, 0)
    );
    // The self-overlapping XOR from its end, then the COPY, then the XOR at an offset.
    let want: Vec<u64> = (16..24)
        .rev()
        .chain((8..16).rev())
        .chain(0..8)
        .chain(24..28)
        .collect();
    assert_eq!(plan.sequence, want);
    assert!(cow::merge::verify_order(delta::write::merge_ops(&plan).iter()).is_ok());
    // In another order, the COPY overwrites what an XOR still reads: the writer's
    // check refuses it.
    let swapped = cow_plan(|m| m.swap(1, 2)).unwrap();
    assert!(cow::merge::verify_order(delta::write::merge_ops(&swapped).iter()).is_err());
}

#[test]
fn a_false_or_repeated_merge_operation_is_refused() {
    use payload::proto::{CowMergeOperation, CowMergeType};
    let op =
        |t: CowMergeType, src: (u64, u64), dst: (u64, u64), off: Option<u32>| CowMergeOperation {
            r#type: Some(t as i32),
            src_extent: Some(Extent::new(src.0, src.1)),
            dst_extent: Some(Extent::new(dst.0, dst.1)),
            src_offset: off,
        };
    for (want, extra) in [
        (
            "the new block differs",
            op(CowMergeType::CowCopy, (1, 1), (33, 1), None),
        ),
        (
            "in an earlier merge operation",
            op(CowMergeType::CowXor, (1, 1), (9, 1), None),
        ),
        (
            "outside the partitions",
            op(CowMergeType::CowXor, (39, 1), (36, 1), Some(7)),
        ),
        (
            "source offset",
            op(CowMergeType::CowCopy, (1, 1), (33, 1), Some(7)),
        ),
    ] {
        let e = cow_plan(|m| m.push(extra.clone())).unwrap_err().to_string();
        assert!(
            e.contains("partition system: merge operation 4") && e.contains(want),
            "{want}: {e}"
        );
    }
}

#[test]
fn update_engines_own_payloads_reproduce_their_target_images() {
    let dir = tempfile::tempdir().unwrap();
    fuzzing::update_engine_samples(dir.path());
    let img = |n: &str| std::fs::read(dir.path().join("images").join(n)).unwrap();
    let want = vec![
        ("kernel".to_string(), img("disk_ext2_4k.img")),
        ("root".to_string(), img("disk_sqfs_default.img")),
    ];
    let open = |n: &str| {
        Payload::open(Source::open(dir.path().join(n).to_str().unwrap()).unwrap()).unwrap()
    };
    let full = open("full_payload.bin");
    assert_eq!(apply_all(&full, &[], Trust::Unverified).unwrap(), want);
    let delta = open("delta_payload.bin");
    assert_eq!(delta.minor_version(), 6);
    let (k, r) = (img("disk_ext2_4k_empty.img"), img("disk_sqfs_empty.img"));
    let got = apply_all(&delta, &[("kernel", &k), ("root", &r)], Trust::Unverified).unwrap();
    assert_eq!(got, want);
    let ops = &payload::info::Info::of(&delta).partitions[0].operations_by_type;
    for t in ["BROTLI_BSDIFF", "SOURCE_COPY", "ZERO", "REPLACE_BZ"] {
        assert!(ops.contains_key(t), "{t}: {ops:?}");
    }
    // Its kernel as a COW: every block the payload writes is REPLACE or ZERO (this
    // payload has no merge operations), the unchanged blocks no op.
    let part = delta.partition("kernel").unwrap().clone();
    let plan = payload::cow::plan(
        &delta,
        &part,
        &delta::MemImage::new("old", k.clone()),
        &delta::MemImage::new("new", want[0].1.clone()),
    )
    .unwrap();
    let c = plan.census;
    assert_eq!(c.copy + c.xor, 0);
    assert_eq!(c.zero + c.replace + c.unchanged, 1024);
}

#[test]
fn update_engines_test_keys_sign_and_verify_rsa_and_ec() {
    let v = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/update_engine");
    let dir = tempfile::tempdir().unwrap();
    let ec_pub = dir.path().join("ec.pub.pem");
    let ec = v.join("unittest_key_EC.pem");
    fuzzing::run(
        "openssl",
        &[
            "pkey",
            "-in",
            ec.to_str().unwrap(),
            "-pubout",
            "-out",
            ec_pub.to_str().unwrap(),
        ],
        &[],
    );
    let rsa = v.join("payload-test-key.pem");
    for (private, public) in [(rsa, v.join("payload-test-key.pub")), (ec, ec_pub)] {
        let sign = |h: &[u8; 32]| fuzzing::openssl_sign(&private, h);
        let (bytes, _) = fuzzing::sample_full(Some(&sign));
        let p = open_bytes(&bytes).unwrap();
        let keys = Keys::from_pem_file(&public).unwrap();
        payload::verify::verify_metadata(&p, &keys).unwrap();
        payload::verify::verify_payload(&p, &keys, &|_| {}).unwrap();
        // A byte of the manifest changed: refused under either key type.
        let mut bad = bytes.clone();
        bad[40] ^= 1;
        if let Ok(p) = open_bytes(&bad) {
            assert!(
                payload::verify::verify_metadata(&p, &keys).is_err(),
                "{}",
                public.display()
            );
        }
    }
}

/// update_engine's `testdata/cycle_nodes_*.bin`: the merge operations of real
/// partitions, full of cycles.
fn cycle_node_sets() -> Vec<(String, payload::proto::PartitionUpdate)> {
    use prost::Message as _;
    let v = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/update_engine");
    let mut sets: Vec<_> = std::fs::read_dir(&v)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("cycle_nodes_")
        })
        .map(|p| {
            let part =
                payload::proto::PartitionUpdate::decode(&std::fs::read(&p).unwrap()[..]).unwrap();
            (p.file_stem().unwrap().to_string_lossy().into_owned(), part)
        })
        .collect();
    sets.sort_by(|a, b| a.0.cmp(&b.0));
    sets
}

#[test]
fn real_partitions_merge_operations_order_safely() {
    let sets = cycle_node_sets();
    assert_eq!(sets.len(), 7);
    for (name, part) in sets {
        let claimed = payload::cow::claimed_blocks(
            &name,
            &part.merge_operations,
            u64::MAX / 8192,
            u64::MAX / 8192,
        )
        .unwrap();
        let mut ops: Vec<delta::PlannedOp> = claimed
            .iter()
            .map(|&(_, dst, op)| delta::PlannedOp { dst, op })
            .collect();
        ops.sort_by_key(|o| o.dst);
        let order = delta::order::order_merge(&mut ops);
        let plan = delta::Plan {
            old_size: 0,
            new_size: 0,
            ops,
            sequence: order.sequence,
            census: delta::Census::default(),
            index_bytes: 0,
            hints: Vec::new(),
        };
        cow::merge::verify_order(delta::write::merge_ops(&plan).iter())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if name == "cycle_nodes_product" {
            let xor = claimed
                .iter()
                .filter(|c| matches!(c.2, delta::BlockOp::Xor { .. }))
                .count();
            assert_eq!((claimed.len() - xor, xor), (645_443, 80_827));
        }
    }
}

#[test]
fn a_crafted_partition_size_is_refused_without_allocating_for_it() {
    let mut b = Builder::new(0);
    let p = b.partition("system", None, &[1u8; 4096]);
    b.op(
        p,
        OpType::Replace,
        &[],
        &[Extent::new(0, 1)],
        Some(&[1u8; 4096]),
    );
    b.manifest.partitions[p]
        .new_partition_info
        .as_mut()
        .unwrap()
        .size = Some(1 << 62);
    let bytes = b.finish(None);
    let pl = open_bytes(&bytes).unwrap();
    let f = tempfile::tempfile().unwrap();
    let e = apply_partition(
        &pl,
        &pl.manifest.partitions[0],
        None,
        &f,
        Path::new("o"),
        Trust::Unverified,
        &|_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("cannot size o"), "{e}");
}

/// A source that answers the first read of the manifest with forged bytes and every
/// later one with the real ones: a server (or a file being changed) that gives the
/// reader one manifest and the signature check another.
struct TwoFaced {
    real: Vec<u8>,
    forged: Vec<u8>,
    reads: std::sync::atomic::AtomicU32,
}

impl vabc_io::ReadAt for TwoFaced {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let covers_manifest = offset <= 30 && offset + buf.len() as u64 > 30;
        let first =
            covers_manifest && self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        let src = if first { &self.forged } else { &self.real };
        let at = offset as usize;
        buf.copy_from_slice(&src[at..at + buf.len()]);
        Ok(())
    }
}

#[test]
fn the_manifest_checked_is_the_manifest_decoded() {
    let k = key("k");
    let sign = |h: &[u8; 32]| fuzzing::openssl_sign(&k.private, h);
    let (real, _) = fuzzing::sample_full(Some(&sign));
    let mut forged = real.clone();
    forged[30] ^= 1;
    let src = TwoFaced {
        real: real.clone(),
        forged,
        reads: Default::default(),
    };
    let len = real.len() as u64;
    let r = Payload::open_verified(
        Source::from_reader("two-faced", Box::new(src), len),
        &keys(&k),
    );
    let e = r.unwrap_err().to_string();
    assert!(e.contains("does not verify"), "{e}");
}

#[test]
fn a_manifest_that_would_decode_to_gigabytes_is_refused_first() {
    // Three million empty `partitions` entries: 2 bytes each on the wire, 6 MB.
    let entries = 3_000_000usize;
    let mut b = b"CrAU".to_vec();
    b.extend(2u64.to_be_bytes());
    b.extend(((entries * 2) as u64).to_be_bytes());
    b.extend(0u32.to_be_bytes());
    for _ in 0..entries {
        b.extend([0x6a, 0x00]);
    }
    let e = open_bytes(&b).unwrap_err().to_string();
    assert!(e.contains("bytes of memory decoded"), "{e}");
}

#[test]
fn a_certificate_gives_its_key() {
    // As an OTA package's otacert: the certificate of the signing key (RSA and EC).
    let v = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/update_engine");
    let dir = tempfile::tempdir().unwrap();
    for (i, private) in [
        v.join("payload-test-key.pem"),
        v.join("unittest_key_EC.pem"),
    ]
    .iter()
    .enumerate()
    {
        let cert = dir.path().join(format!("cert{i}.pem"));
        fuzzing::run(
            "openssl",
            &[
                "req",
                "-x509",
                "-new",
                "-key",
                private.to_str().unwrap(),
                "-subj",
                "/CN=vabc test",
                "-days",
                "1",
                "-out",
                cert.to_str().unwrap(),
            ],
            &[],
        );
        let sign = |h: &[u8; 32]| fuzzing::openssl_sign(private, h);
        let (bytes, _) = fuzzing::sample_full(Some(&sign));
        let p = open_bytes(&bytes).unwrap();
        let keys = Keys::from_pem_file(&cert).unwrap();
        payload::verify::verify_payload(&p, &keys, &|_| {}).unwrap();
        payload::verify::verify_metadata(&p, &keys).unwrap();
    }
    // Another key's certificate does not verify.
    let other = key("other");
    let cert = dir.path().join("other.pem");
    fuzzing::run(
        "openssl",
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            other.private.to_str().unwrap(),
            "-subj",
            "/CN=other",
            "-days",
            "1",
            "-out",
            cert.to_str().unwrap(),
        ],
        &[],
    );
    let sign = |h: &[u8; 32]| fuzzing::openssl_sign(&v.join("payload-test-key.pem"), h);
    let (bytes, _) = fuzzing::sample_full(Some(&sign));
    let p = open_bytes(&bytes).unwrap();
    assert!(payload::verify::verify_metadata(&p, &Keys::from_pem_file(&cert).unwrap()).is_err());
}
