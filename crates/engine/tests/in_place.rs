//! Large requests into page-aligned memory read aligned base sources straight into the
//! destination (one vectored read per run, no bounce copy), and XOR blocks are written
//! as source XOR payload in one pass. Those paths must give the same bytes as the plain
//! ones: 4 KiB requests (inline path) and unaligned memory (bounce path), including
//! sources shared by several destinations and aligned and unaligned XOR sources.

use std::path::Path;
use std::sync::atomic::Ordering;

use cow::{CowWriter, WriterOptions};
use engine::{AlignedBuf, BlockDevice, CowEngine, CowEngineOptions};

const BS: usize = 4096;
const BLOCKS: usize = 1024;

fn fill(seed: u64, buf: &mut [u8]) {
    fastrand::Rng::with_seed(seed).fill(buf);
}

/// Writes base.img and update.cow into `dir`; returns the expected new image.
fn make_update(dir: &Path) -> Vec<u8> {
    let mut base = vec![0u8; BLOCKS * BS];
    fill(1, &mut base);
    std::fs::write(dir.join("base.img"), &base).unwrap();
    let mut new = base.clone();
    let mut w = CowWriter::create(
        dir.join("update.cow"),
        WriterOptions {
            max_blocks: Some(BLOCKS as u64),
            ..Default::default()
        },
    )
    .unwrap();
    let copy = |w: &mut CowWriter, new: &mut Vec<u8>, dst: usize, src: usize, n: usize| {
        new.copy_within(src * BS..(src + n) * BS, dst * BS);
        w.add_copy(dst as u64, src as u64, n as u64).unwrap();
    };
    let xor = |w: &mut CowWriter, new: &mut Vec<u8>, dst: usize, src: usize, off: usize| {
        let d = dst * BS..(dst + 1) * BS;
        fill(dst as u64 * 7 + 3, &mut new[d.clone()]);
        let s = src * BS + off;
        let x: Vec<u8> = new[d]
            .iter()
            .zip(&base[s..s + BS])
            .map(|(n, o)| n ^ o)
            .collect();
        w.add_xor_blocks(dst as u64, &x, src as u64, off as u16)
            .unwrap();
    };
    // 0..64: one 64-block COPY (one aligned source range).
    copy(&mut w, &mut new, 0, 512, 64);
    // 64..128: single-block COPYs, sources reversed; every 8th shares the previous source.
    for b in 64..128 {
        let src = if b % 8 == 0 {
            600 + (191 - b) + 1
        } else {
            600 + (191 - b)
        };
        copy(&mut w, &mut new, b, src, 1);
    }
    // 128..192: XORs at aligned sources (read in place, XORed in place).
    for b in 128..192 {
        xor(&mut w, &mut new, b, 700 + (b - 128), 0);
    }
    // 192..256: XORs at byte offsets (bounce, XOR in one pass).
    for b in 192..256 {
        xor(&mut w, &mut new, b, 800 + (b - 192), 100 + b);
    }
    // 256..320: aligned XORs and COPYs sharing sources (overlapping wants).
    for b in 256..320 {
        let src = 900 + (b - 256) / 2;
        if b % 2 == 0 {
            xor(&mut w, &mut new, b, src, 0);
        } else {
            copy(&mut w, &mut new, b, src, 1);
        }
    }
    // 320..: unchanged except a few REPLACE blocks between base runs.
    let r = 400 * BS..404 * BS;
    fill(99, &mut new[r.clone()]);
    w.add_raw_blocks(400, &new[r]).unwrap();
    w.finalize().unwrap();
    new
}

#[test]
fn in_place_reads_match_the_plain_paths() {
    let dir = tempfile::tempdir().unwrap();
    let want = make_update(dir.path());
    for direct in [true, false] {
        let e = CowEngine::open(
            &dir.path().join("base.img"),
            &dir.path().join("update.cow"),
            &CowEngineOptions {
                direct_io: direct,
                ..Default::default()
            },
        )
        .unwrap();
        // Plain: 4 KiB requests, each on the inline path.
        let mut plain = vec![0u8; want.len()];
        for (i, blk) in plain.chunks_mut(BS).enumerate() {
            e.read_at(blk, (i * BS) as u64).unwrap();
        }
        assert!(plain == want, "direct={direct}: 4 KiB reads");
        // Unaligned memory: nothing can be read in place.
        let before = e.stats().in_place_bytes.load(Ordering::Relaxed);
        let mut v = vec![0u8; (1 << 20) + 1];
        for off in (0..want.len()).step_by(1 << 20) {
            let out = &mut v[1..];
            e.read_at(out, off as u64).unwrap();
            assert!(out == &want[off..off + (1 << 20)], "direct={direct}: {off}");
        }
        assert_eq!(e.stats().in_place_bytes.load(Ordering::Relaxed), before);
        // Page-aligned memory, as the FUSE workers use: most sources go in place.
        let mut buf = AlignedBuf::new(1 << 20);
        for (off, len) in [(0, 1 << 20), (1 << 20, 1 << 20), (BS * 60, 300 * BS)] {
            let out = buf.slice_mut(len);
            e.read_at(out, off as u64).unwrap();
            let bad: Vec<usize> = (0..len / BS)
                .filter(|b| out[b * BS..(b + 1) * BS] != want[off + b * BS..off + (b + 1) * BS])
                .map(|b| off / BS + b)
                .collect();
            assert!(
                bad.is_empty(),
                "direct={direct}: {len} at {off}: blocks {bad:?}"
            );
        }
        let in_place = e.stats().in_place_bytes.load(Ordering::Relaxed) - before;
        // Blocks 0..64, the unshared COPYs of 64..128, the aligned XORs of 128..192 and
        // the identity range 320..400 of the first two requests at least.
        assert!(
            in_place >= (64 + 48 + 64 + 80) as u64 * BS as u64,
            "{in_place}"
        );
    }
}
