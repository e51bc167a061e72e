//! `vabc serve --verity-hash`: the served image is checked against a dm-verity tree
//! made by `vabc verity format`. Clean, it reads back as new.img through FUSE and NBD;
//! with single bits flipped in the base (blocks the COW does not override, and a COPY
//! source), in REPLACE payloads of the COW and in the hash tree, exactly the affected
//! blocks fail with EIO (never wrong bytes) through both frontends, the daemon logs
//! them, and every other block still reads correctly. A wrong root hash, a damaged top
//! level, a truncated hash file and an unknown algorithm stop it before it serves.

mod serve_common;

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;

use serve_common::{
    BS, Server, assert_nothing_left, os, run, set_fuse_uring_param, vabc, verity_format,
};

/// 4 MiB: 1024 data blocks, so the sha256 tree has 8 leaf blocks of 128 digests
/// under one top block.
const BLOCKS: u64 = 1024;
const PER_LEAF: u64 = 128;

struct Fixture {
    dir: tempfile::TempDir,
    old: PathBuf,
    cow: PathBuf,
    hash: PathBuf,
    root: String,
    tree_offset: u64,
    new_data: Vec<u8>,
    /// New blocks written by REPLACE ops.
    replaced: Vec<u64>,
    /// Base blocks served as they are (not overridden, not a COPY source).
    untouched: Vec<u64>,
    /// (COPY source in the base, COPY destination in the new image).
    copies: Vec<(u64, u64)>,
}

fn random_bytes(rng: &mut fastrand::Rng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill(&mut v);
    v
}

/// old.img (random), new.img = old with REPLACE, ZERO and COPY ranges, the COW
/// between them (uncompressed, so REPLACE payloads can be found and flipped) and
/// the verity tree of new.img.
fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path();
    let mut seed = fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15);
    let old_data = random_bytes(&mut seed, BLOCKS as usize * BS);
    let mut new_data = old_data.clone();
    let replace_ranges = [(100u64, 164u64), (500, 510), (900, 905)];
    let zero_range = (300u64, 310u64);
    let copy_src = 20u64;
    let copy_range = (700u64, 720u64);

    let opts = cow::WriterOptions {
        version: 3,
        compression: "none".parse().unwrap(),
        op_count_max: 256,
        ..Default::default()
    };
    let cow_path = t.join("update.cow");
    let mut w = cow::CowWriter::create(&cow_path, opts).unwrap();
    let mut replaced = Vec::new();
    for (a, b) in replace_ranges {
        let data = random_bytes(&mut seed, (b - a) as usize * BS);
        new_data[a as usize * BS..b as usize * BS].copy_from_slice(&data);
        w.add_raw_blocks(a, &data).unwrap();
        replaced.extend(a..b);
    }
    new_data[zero_range.0 as usize * BS..zero_range.1 as usize * BS].fill(0);
    w.add_zero_blocks(zero_range.0, zero_range.1 - zero_range.0)
        .unwrap();
    let n = copy_range.1 - copy_range.0;
    new_data.copy_within(
        copy_src as usize * BS..(copy_src + n) as usize * BS,
        copy_range.0 as usize * BS,
    );
    w.add_copy(copy_range.0, copy_src, n).unwrap();
    w.finalize().unwrap();
    let copies: Vec<(u64, u64)> = (0..n).map(|i| (copy_src + i, copy_range.0 + i)).collect();

    let overridden = |b: u64| {
        replaced.contains(&b)
            || (zero_range.0..zero_range.1).contains(&b)
            || (copy_range.0..copy_range.1).contains(&b)
            || (copy_src..copy_src + n).contains(&b)
    };
    let untouched: Vec<u64> = (0..BLOCKS).filter(|&b| !overridden(b)).collect();

    let old = t.join("old.img");
    let new = t.join("new.img");
    std::fs::write(&old, &old_data).unwrap();
    std::fs::write(&new, &new_data).unwrap();
    let hash = t.join("new.verity");
    let v = verity_format(&new, &hash);
    assert_eq!(v["data_blocks"], BLOCKS);
    assert_eq!(v["hash_blocks"], 9);
    Fixture {
        old,
        cow: cow_path,
        hash,
        root: v["root_hash"].as_str().unwrap().to_string(),
        tree_offset: v["tree_offset"].as_u64().unwrap(),
        new_data,
        replaced,
        untouched,
        copies,
        dir,
    }
}

fn flip(path: &Path, offset: u64, bit: u32) {
    let f = File::options().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 1 << bit;
    f.write_all_at(&b, offset).unwrap();
    f.sync_all().unwrap();
}

/// Offset of `block` (4 KiB of random data, so unique) inside `file`.
fn find_block(file: &[u8], block: &[u8]) -> u64 {
    let key = &block[..32];
    let mut at = None;
    for (i, w) in file.windows(32).enumerate() {
        if w == key && file.get(i..i + BS) == Some(block) {
            assert!(at.is_none(), "payload found twice in the COW");
            at = Some(i as u64);
        }
    }
    at.expect("REPLACE payload stored raw in the COW")
}

// --- a minimal NBD client (fixed newstyle, OPT_GO on the default export) ---

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

fn nbd_connect(sock: &Path) -> (UnixStream, u64) {
    let mut s = UnixStream::connect(sock).unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..16], b"NBDMAGICIHAVEOPT");
    s.write_all(&3u32.to_be_bytes()).unwrap();
    let mut opt = b"IHAVEOPT".to_vec();
    opt.extend_from_slice(&7u32.to_be_bytes());
    opt.extend_from_slice(&6u32.to_be_bytes());
    opt.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // empty name, no info requests
    s.write_all(&opt).unwrap();
    let mut size = 0;
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        let (kind, len) = (be32(&h[12..]), be32(&h[16..]) as usize);
        let mut d = vec![0u8; len];
        s.read_exact(&mut d).unwrap();
        match kind {
            1 => break,
            3 if d[..2] == [0, 0] => size = be64(&d[2..]),
            3 => {}
            k => panic!("unexpected NBD option reply {k:#x}"),
        }
    }
    (s, size)
}

/// One NBD read: Ok(data) or Err(errno from the reply).
fn nbd_read(s: &mut UnixStream, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
    let mut r = Vec::with_capacity(28);
    r.extend_from_slice(&0x25609513u32.to_be_bytes());
    r.extend_from_slice(&[0, 0, 0, 0]); // flags, READ
    r.extend_from_slice(&offset.to_be_bytes()); // cookie
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&len.to_be_bytes());
    s.write_all(&r).unwrap();
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    assert_eq!(be32(&h), 0x67446698);
    assert_eq!(be64(&h[8..]), offset, "cookie");
    match be32(&h[4..]) {
        0 => {
            let mut d = vec![0u8; len as usize];
            s.read_exact(&mut d).unwrap();
            Ok(d)
        }
        e => Err(e),
    }
}

fn serve_args<'a>(
    f: &'a Fixture,
    old: &'a Path,
    cow: &'a Path,
    hash: &'a Path,
    root: &'a str,
) -> Vec<&'a std::ffi::OsStr> {
    vec![
        os("--base"),
        old.as_os_str(),
        os("--cow"),
        cow.as_os_str(),
        os("--verity-hash"),
        hash.as_os_str(),
        os("--root-hash"),
        os(root),
        os("--size"),
        os(size_arg(f)),
    ]
}

fn size_arg(f: &Fixture) -> &'static str {
    assert_eq!(f.new_data.len() as u64, BLOCKS * BS as u64);
    "4M"
}

/// Serves (`old`, `cow`, `hash`) through FUSE and NBD at once and checks every block
/// through both: blocks in `bad` fail with EIO (and are logged), all others equal
/// new.img. Once with FUSE answered through /dev/fuse, once over io_uring.
fn check_served(f: &Fixture, old: &Path, cow: &Path, hash: &Path, bad: &BTreeSet<u64>) {
    for transport in ["classic", "uring"] {
        check_served_via(f, old, cow, hash, bad, transport);
    }
}

fn check_served_via(
    f: &Fixture,
    old: &Path,
    cow: &Path,
    hash: &Path,
    bad: &BTreeSet<u64>,
    transport: &str,
) {
    let t = f.dir.path();
    let fuse_dir = t.join("fuse");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let sock = t.join("nbd.sock");
    let _ = std::fs::remove_file(&sock);
    let addr = format!("unix:{}", sock.display());
    let mut args = serve_args(f, old, cow, hash, &f.root);
    args.extend([os("--fuse"), fuse_dir.as_os_str(), os("--nbd"), os(&addr)]);
    args.extend([os("--fuse-transport"), os(transport)]);
    if transport == "uring" {
        // This binary never switches it off, so no lock is needed.
        set_fuse_uring_param(true);
    }
    let daemon = Server::start_logged(&args, &t.join("serve.log"));
    let via = match transport {
        "uring" => "over FUSE io_uring",
        _ => "through /dev/fuse",
    };
    daemon.assert_said(via);
    let disk = File::open(fuse_dir.join("disk.img")).unwrap();
    let (mut conn, size) = nbd_connect(&sock);
    assert_eq!(size, BLOCKS * BS as u64);

    let mut buf = vec![0u8; BS];
    for b in 0..BLOCKS {
        let want = &f.new_data[b as usize * BS..][..BS];
        let off = b * BS as u64;
        let fuse = disk.read_exact_at(&mut buf, off);
        let nbd = nbd_read(&mut conn, off, BS as u32);
        if bad.contains(&b) {
            let e = fuse.expect_err(&format!("FUSE read of corrupted block {b} succeeded"));
            assert_eq!(e.raw_os_error(), Some(libc_eio()), "FUSE block {b}: {e}");
            assert_eq!(nbd.err(), Some(libc_eio() as u32), "NBD block {b}");
        } else {
            fuse.unwrap_or_else(|e| panic!("FUSE read of good block {b}: {e}"));
            assert!(buf == want, "FUSE block {b}: wrong bytes");
            let d = nbd.unwrap_or_else(|e| panic!("NBD read of good block {b}: errno {e}"));
            assert!(d == want, "NBD block {b}: wrong bytes");
        }
    }
    if bad.is_empty() {
        // Whole-device reads in large requests, through both frontends.
        let all = std::fs::read(fuse_dir.join("disk.img")).unwrap();
        assert!(all == f.new_data, "FUSE: served image differs from new.img");
        let mut all = Vec::new();
        for off in (0..size).step_by(256 << 10) {
            all.extend(nbd_read(&mut conn, off, 256 << 10).unwrap());
        }
        assert!(all == f.new_data, "NBD: served image differs from new.img");
        let copy = t.join("copy.img");
        let uri = format!("nbd+unix:///?socket={}", sock.display());
        let (ok, out) = run(Command::new("nbdcopy").arg(&uri).arg(&copy));
        assert!(ok, "nbdcopy: {out}");
        assert!(
            std::fs::read(&copy).unwrap() == f.new_data,
            "nbdcopy copy differs"
        );
    } else {
        // A sequential stream (read ahead and checked in chunks by both frontends):
        // the requests that cover a bad block fail, every other one is exact.
        let req = 256 << 10;
        let mut chunk = vec![0u8; req];
        for off in (0..size).step_by(req) {
            let n = (size - off).min(req as u64) as usize;
            let blocks = off / BS as u64..(off + n as u64).div_ceil(BS as u64);
            let covers_bad = bad.iter().any(|b| blocks.contains(b));
            let want = &f.new_data[off as usize..off as usize + n];
            let fuse = disk.read_exact_at(&mut chunk[..n], off);
            let nbd = nbd_read(&mut conn, off, n as u32);
            if covers_bad {
                let e = fuse.expect_err("FUSE stream read over a bad block succeeded");
                assert_eq!(e.raw_os_error(), Some(libc_eio()), "FUSE at {off}: {e}");
                assert_eq!(nbd.err(), Some(libc_eio() as u32), "NBD at {off}");
            } else {
                fuse.unwrap_or_else(|e| panic!("FUSE stream read at {off}: {e}"));
                assert!(chunk[..n] == *want, "FUSE stream at {off}: wrong bytes");
                let d = nbd.unwrap_or_else(|e| panic!("NBD stream read at {off}: errno {e}"));
                assert!(d == want, "NBD stream at {off}: wrong bytes");
            }
        }
        // A large read spanning a bad block fails as a whole.
        let b = *bad.iter().next().unwrap();
        let start = b.saturating_sub(3) * BS as u64;
        let mut big = vec![0u8; 16 * BS];
        let e = disk.read_exact_at(&mut big, start).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc_eio()));
        assert_eq!(
            nbd_read(&mut conn, start, 16 * BS as u32).err(),
            Some(libc_eio() as u32)
        );
    }
    drop(conn);
    drop(disk);
    let log = daemon.log();
    for b in bad {
        assert!(
            log.contains(&format!("block {b} failed verification")),
            "block {b} not logged:\n{log}"
        );
    }
    assert!(daemon.stop().success());
    assert_nothing_left(t);
}

fn libc_eio() -> i32 {
    5
}

/// Copies of the fixture's base, COW and hash file to damage.
fn copies(f: &Fixture, tag: &str) -> (PathBuf, PathBuf, PathBuf) {
    let t = f.dir.path();
    let paths = (
        t.join(format!("{tag}.old.img")),
        t.join(format!("{tag}.cow")),
        t.join(format!("{tag}.verity")),
    );
    std::fs::copy(&f.old, &paths.0).unwrap();
    std::fs::copy(&f.cow, &paths.1).unwrap();
    std::fs::copy(&f.hash, &paths.2).unwrap();
    paths
}

#[test]
fn clean_image_reads_back_through_fuse_and_nbd() {
    let f = fixture();
    check_served(&f, &f.old, &f.cow, &f.hash, &BTreeSet::new());
}

#[test]
fn flipped_bits_in_base_and_cow_fail_only_their_blocks() {
    let f = fixture();
    let (old, cow, hash) = copies(&f, "data");
    let mut bad = BTreeSet::new();
    // Base blocks the COW leaves alone, spread over the device and over the bits
    // and bytes of each block.
    let step = f.untouched.len() / 16;
    for (k, &b) in f.untouched.iter().step_by(step).take(16).enumerate() {
        let byte = (k as u64 * 1021 + 7) % BS as u64;
        flip(&old, b * BS as u64 + byte, k as u32 % 8);
        bad.insert(b);
    }
    // A COPY source: both the unchanged base block and the copy of it fail.
    let (src, dst) = f.copies[5];
    flip(&old, src * BS as u64 + 4095, 7);
    bad.extend([src, dst]);
    // REPLACE payloads inside the COW, including first and last blocks of units.
    let cow_bytes = std::fs::read(&cow).unwrap();
    let picks = [0usize, 1, 15, 16, 31, 40, 63, 64, 70, 73, 74, 78];
    for (k, &i) in picks.iter().enumerate() {
        let b = f.replaced[i];
        let at = find_block(&cow_bytes, &f.new_data[b as usize * BS..][..BS]);
        let byte = (k as u64 * 331) % BS as u64;
        flip(&cow, at + byte, (k as u32 + 3) % 8);
        bad.insert(b);
    }
    check_served(&f, &old, &cow, &hash, &bad);
}

#[test]
fn flipped_bits_in_the_hash_tree_fail_the_blocks_below() {
    let f = fixture();
    let (old, cow, hash) = copies(&f, "tree");
    // Layout: top block at tree_offset, then the 8 leaf blocks.
    let leaf = |i: u64| f.tree_offset + (1 + i) * BS as u64;
    let mut bad = BTreeSet::new();
    // A digest byte in leaf 1, and the last digest of leaf 6.
    flip(&hash, leaf(1) + 32 * 77 + 5, 2);
    flip(&hash, leaf(6) + BS as u64 - 1, 0);
    for i in [1, 6] {
        bad.extend(i * PER_LEAF..(i + 1) * PER_LEAF);
    }
    check_served(&f, &old, &cow, &hash, &bad);
}

/// `vabc serve` with `extra` arguments must exit non-zero before serving, with a
/// message containing `want`.
fn refuses(f: &Fixture, hash: &Path, root: &str, extra: &[&str], want: &str) {
    let fuse_dir = f.dir.path().join("fuse-refused");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let mut args = serve_args(f, &f.old, &f.cow, hash, root);
    args.extend(extra.iter().map(os));
    args.extend([os("--fuse"), fuse_dir.as_os_str()]);
    let out = Command::new(vabc())
        .arg("serve")
        .args(&args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "serve started with {extra:?}");
    assert!(text.contains(want), "{extra:?}: {text}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("ready"),
        "{extra:?}"
    );
    assert_nothing_left(f.dir.path());
}

#[test]
fn bad_trees_and_parameters_are_refused_at_start() {
    let f = fixture();
    // Wrong root hash (one bit).
    let mut wrong = hex::decode(&f.root).unwrap();
    wrong[0] ^= 0x80;
    refuses(&f, &f.hash, &hex::encode(&wrong), &[], "root hash mismatch");
    refuses(&f, &f.hash, &f.root[..10], &[], "root hash is 5 bytes");
    refuses(&f, &f.hash, "xyz", &[], "not hex");
    // A bit flipped in the top level: no block could be served.
    let (_, _, top) = copies(&f, "top");
    flip(&top, f.tree_offset + 3, 4);
    refuses(&f, &top, &f.root, &[], "root hash mismatch");
    // Truncated hash file: last leaf block cut short.
    let (_, _, short) = copies(&f, "short");
    let len = std::fs::metadata(&short).unwrap().len();
    File::options()
        .write(true)
        .open(&short)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    refuses(&f, &short, &f.root, &[], "truncated");
    // Unknown algorithm (parameters from the command line, no superblock).
    refuses(
        &f,
        &f.hash,
        &f.root,
        &[
            "--no-superblock",
            "--hash-offset",
            "4096",
            "--salt",
            "-",
            "--hash",
            "md5",
        ],
        "unknown hash algorithm",
    );
    // Options that disagree with the superblock.
    refuses(
        &f,
        &f.hash,
        &f.root,
        &["--hash", "sha1"],
        "differs from the superblock",
    );
    // Tree options without a tree.
    let out = Command::new(vabc())
        .args(["serve", "--base"])
        .arg(&f.old)
        .arg("--cow")
        .arg(&f.cow)
        .args(["--hash", "sha256", "--fuse"])
        .arg(f.dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("need --verity-hash"),
        "{out:?}"
    );
}

#[test]
fn tree_without_superblock_serves_with_parameters_on_the_command_line() {
    let f = fixture();
    let t = f.dir.path();
    let new = t.join("new.img");
    let hash = t.join("nosb.verity");
    let salt = "00112233445566778899";
    let out = Command::new(vabc())
        .args([
            "verity",
            "format",
            "--json",
            "--no-superblock",
            "--salt",
            salt,
        ])
        .args(["--hash", "sha512", "--data-block-size", "1024"])
        .arg(&new)
        .arg(&hash)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let root = v["root_hash"].as_str().unwrap();
    let tree_opts = [
        "--no-superblock",
        "--salt",
        salt,
        "--hash",
        "sha512",
        "--data-block-size",
        "1024",
    ];
    let fuse_dir = t.join("fuse");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let mut args = serve_args(&f, &f.old, &f.cow, &hash, root);
    args.extend(tree_opts.iter().map(os));
    args.extend([os("--fuse"), fuse_dir.as_os_str()]);
    let d = Server::start_logged(&args, &t.join("nosb.log"));
    let all = std::fs::read(fuse_dir.join("disk.img")).unwrap();
    assert!(all == f.new_data, "served image differs from new.img");
    assert!(d.stop().success());
    // Flip a bit in the base: the 1 KiB verity block inside the 4 KiB block fails.
    let (old, _, _) = copies(&f, "flipped");
    let b = f.untouched[10];
    flip(&old, b * BS as u64 + 2500, 1);
    let mut args = serve_args(&f, &old, &f.cow, &hash, root);
    args.extend(tree_opts.iter().map(os));
    args.extend([os("--fuse"), fuse_dir.as_os_str()]);
    let d = Server::start_logged(&args, &t.join("nosb2.log"));
    let disk = File::open(fuse_dir.join("disk.img")).unwrap();
    let mut buf = vec![0u8; BS];
    let e = disk.read_exact_at(&mut buf, b * BS as u64).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc_eio()));
    disk.read_exact_at(&mut buf, (b + 1) * BS as u64).unwrap();
    assert!(buf == f.new_data[(b + 1) as usize * BS..][..BS]);
    drop(disk);
    assert!(
        d.log().contains(&format!("data block {}", b * 4 + 2)),
        "{}",
        d.log()
    );
    assert!(d.stop().success());
    assert_nothing_left(t);
}

#[test]
fn diff_verity_tree_checks_out_and_serves_the_update() {
    let f = fixture();
    let t = f.dir.path();
    let new = t.join("new.img");
    let cow = t.join("diff.cow");
    let salt = "a1b2c3";
    let out = Command::new(vabc())
        .arg("diff")
        .arg(&f.old)
        .arg(&new)
        .arg("-o")
        .arg(&cow)
        .args(["--json", "--verity", "--verity-salt", salt])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let vt = &v["verity"];
    let hash = PathBuf::from(vt["hashfile"].as_str().unwrap());
    assert_eq!(hash, t.join("diff.cow.verity"));
    assert_eq!(vt["salt"], salt);
    assert_eq!(vt["hash_algorithm"], "sha256");
    assert_eq!(vt["data_blocks"], BLOCKS);
    let root = vt["root_hash"].as_str().unwrap();
    // The tree and root are what `vabc verity format` makes with that salt...
    let out = Command::new(vabc())
        .args(["verity", "format", "--json", "--salt", salt])
        .arg(&new)
        .arg(t.join("ref.verity"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["root_hash"].as_str().unwrap(), root);
    // ... and veritysetup accepts them.
    let (ok, text) = run(Command::new("veritysetup")
        .arg("verify")
        .arg(&new)
        .arg(&hash)
        .arg(root));
    assert!(ok, "veritysetup verify: {text}");
    // Serving the update with that tree gives new.img.
    let fuse_dir = t.join("fuse");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let mut args = serve_args(&f, &f.old, &cow, &hash, root);
    args.extend([os("--fuse"), fuse_dir.as_os_str()]);
    let d = Server::start_logged(&args, &t.join("diff.log"));
    let all = std::fs::read(fuse_dir.join("disk.img")).unwrap();
    assert!(all == f.new_data, "served image differs from new.img");
    assert!(d.stop().success());
    assert_nothing_left(t);
}

/// `--stats` and SIGUSR1: the latency of each layer's reads, counted exactly.
#[test]
fn stats_count_each_layer_s_reads() {
    let f = fixture();
    let t = f.dir.path();
    let fuse_dir = t.join("fuse-stats");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let sock = t.join("stats.sock");
    let addr = format!("unix:{}", sock.display());
    let mut args = serve_args(&f, &f.old, &f.cow, &f.hash, &f.root);
    args.extend([os("--fuse"), fuse_dir.as_os_str(), os("--nbd"), os(&addr)]);
    args.push(os("--stats"));
    let log = t.join("stats.log");
    let daemon = Server::start_logged(&args, &log);
    let disk = File::open(fuse_dir.join("disk.img")).unwrap();
    let (mut conn, _) = nbd_connect(&sock);
    let mut buf = vec![0u8; BS];
    for b in 0..10u64 {
        disk.read_exact_at(&mut buf, b * 7 * BS as u64).unwrap();
    }
    for b in 0..7u64 {
        nbd_read(&mut conn, b * 5 * BS as u64, BS as u32).unwrap();
    }
    drop(conn);
    // SIGUSR1 prints the stats so far, and serving goes on.
    let (ok, out) = run(Command::new("kill")
        .arg("-USR1")
        .arg(daemon.pid().to_string()));
    assert!(ok, "kill -USR1: {out}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !daemon.log().contains("stats: engine:") {
        assert!(std::time::Instant::now() < deadline, "{}", daemon.log());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let first = daemon.log();
    assert!(
        first.contains("stats: FUSE READs (arrival to reply): 10 timed, mean "),
        "{first}"
    );
    assert!(
        first.contains("stats: NBD READs (arrival to reply): 7 timed, mean "),
        "{first}"
    );
    // Every read reached the engine and had its block checked.
    assert!(
        first.contains("stats: engine reads (read_at, planned reads not included): 17 timed"),
        "{first}"
    );
    assert!(
        first.contains("stats: dm-verity checks: 17 timed"),
        "{first}"
    );
    assert!(!first.contains("read-ahead"), "no stream yet: {first}");
    // The whole device as a stream of 256 KiB reads, which the read-ahead follows
    // (from the first 2 MiB chunk boundary after the stream is seen).
    let mut big = vec![0u8; 256 << 10];
    for i in 0..16u64 {
        let off = i * big.len() as u64;
        disk.read_exact_at(&mut big, off).unwrap();
        assert!(big[..] == f.new_data[off as usize..][..big.len()]);
    }
    drop(disk);
    assert!(daemon.stop().success());
    // On exit (--stats), the same lines with the stream counted.
    let last = std::fs::read_to_string(&log).unwrap();
    let last = &last[first.len()..];
    assert!(
        last.contains("stats: FUSE READs (arrival to reply): 26 timed"),
        "{last}"
    );
    assert!(last.contains("p50 ≤ ") && last.contains("p99 ≤ "), "{last}");
    let ra = last
        .lines()
        .find(|l| l.contains("stats: read-ahead: "))
        .unwrap_or_else(|| panic!("no read-ahead line: {last}"));
    // "... N stream requests answered from them (W waited for one), M read directly"
    let number_before = |what: &str| -> u64 {
        let head = &ra[..ra.find(what).unwrap_or_else(|| panic!("{what} in {ra}"))];
        let word = head.split_whitespace().last().unwrap();
        word.trim_start_matches('(').parse().unwrap()
    };
    let (hits, misses) = (number_before(" stream"), number_before(" read directly"));
    assert_eq!(hits + misses, 16, "{ra}");
    assert!(hits >= 4, "{ra}");
}
