//! vabc compresses LZ4DIFF targets with the liblz4 `lz4-sys` builds (1.10.0);
//! update_engine's generator and devices use liblz4 1.9.4. This runs update_engine's
//! recompression step (fill a block of N bytes from all the data left, with
//! `LZ4_compress_HC_destSize` at each level, or `LZ4_compress_destSize`) through the
//! system's liblz4 1.9.4 (erofs-utils' dependency, installed by
//! scripts/install-deps.sh) and through vabc, and compares the bytes.

use payload::fuzzing::lz4_text as text;
use payload::lz4diff::{CompressionAlgorithm, dest_size};
use std::path::Path;
use std::process::Command;

const PROGRAM: &str = r#"
#include <stdio.h>
#include <stdlib.h>
int LZ4_compress_HC_destSize(void*, const char*, char*, int*, int, int);
int LZ4_compress_destSize(const char*, char*, int*, int);
int LZ4_sizeofStateHC(void);
int LZ4_versionNumber(void);
/* argv: input file, block size, level (0: LZ4_compress_destSize). Writes, per block,
   the bytes consumed and made (u32 little-endian each) and the block. */
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 2;
    static char in[1 << 22];
    int len = (int)fread(in, 1, sizeof in, f);
    int clen = atoi(argv[2]), level = atoi(argv[3]);
    void *state = aligned_alloc(64, ((size_t)LZ4_sizeofStateHC() + 63) / 64 * 64);
    char *buf = malloc(clen);
    fprintf(stderr, "%d\n", LZ4_versionNumber());
    for (int at = 0; at < len;) {
        int src = len - at;
        int n = level ? LZ4_compress_HC_destSize(state, in + at, buf, &src, clen, level)
                      : LZ4_compress_destSize(in + at, buf, &src, clen);
        if (n <= 0 || src <= 0) return 3;
        unsigned hdr[2] = {(unsigned)src, (unsigned)n};
        fwrite(hdr, 4, 2, stdout);
        fwrite(buf, 1, n, stdout);
        at += src;
    }
    return 0;
}
"#;

/// The system's liblz4 1.9.4, as update_engine links it.
fn reference(dir: &Path) -> std::path::PathBuf {
    let lib = ["/usr/lib/x86_64-linux-gnu/liblz4.so.1", "/usr/lib/aarch64-linux-gnu/liblz4.so.1", "/usr/lib64/liblz4.so.1"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("liblz4.so.1 (Debian's liblz4-1, which erofs-utils depends on) is not installed: run scripts/install-deps.sh");
    let src = dir.join("ref.c");
    std::fs::write(&src, PROGRAM).unwrap();
    let exe = dir.join("ref");
    let st = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg(lib)
        .status()
        .expect("cc is needed to build the liblz4 reference program");
    assert!(st.success(), "the reference program does not build");
    exe
}

#[test]
fn recompression_matches_liblz4_1_9_4() {
    let dir = tempfile::tempdir().unwrap();
    let exe = reference(dir.path());
    let mut inputs = vec![text(1, 300_000), text(2, 70_000)];
    let mut rng = fastrand::Rng::with_seed(3);
    let mut mixed: Vec<u8> = (0..30_000).map(|_| rng.u8(..)).collect();
    mixed.extend(text(4, 100_000));
    inputs.push(mixed);
    let mut differs = Vec::new();
    for (i, data) in inputs.iter().enumerate() {
        let file = dir.path().join(format!("in{i}"));
        std::fs::write(&file, data).unwrap();
        for clen in [4096usize, 16384] {
            for level in 0..=12 {
                let out = Command::new(&exe)
                    .arg(&file)
                    .arg(clen.to_string())
                    .arg(level.to_string())
                    .output()
                    .unwrap();
                assert!(out.status.success(), "reference failed: {out:?}");
                let version = String::from_utf8_lossy(&out.stderr);
                assert_eq!(version.trim(), "10904", "the system liblz4 is not 1.9.4");
                let algo = CompressionAlgorithm {
                    r#type: if level == 0 { 1 } else { 2 },
                    level,
                };
                let (mut at, mut r, mut same) = (0usize, &out.stdout[..], true);
                while at < data.len() {
                    let (src, n) = (
                        u32::from_le_bytes(r[..4].try_into().unwrap()) as usize,
                        u32::from_le_bytes(r[4..8].try_into().unwrap()) as usize,
                    );
                    let (ours, used) = dest_size(&algo, &data[at..], clen);
                    if ours != r[8..8 + n] || used != src {
                        same = false;
                        break;
                    }
                    r = &r[8 + n..];
                    at += src;
                }
                if !same {
                    differs.push((i, clen, level));
                }
            }
        }
    }
    // lz4 1.10 gave HC levels 1 and 2 a new matcher; every other level must be 1.9.4's
    // byte for byte.
    let unexpected: Vec<_> = differs.iter().filter(|d| d.2 > 2 || d.2 == 0).collect();
    assert!(
        unexpected.is_empty(),
        "vabc's lz4 differs from 1.9.4 at (input, block, level) {unexpected:?}"
    );
}
