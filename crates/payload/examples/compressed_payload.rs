//! Writes an incremental payload whose partition holds compressed and executable
//! files, changed by a PUFFDIFF operation (puffin's own patch of a zip's blocks), an
//! LZ4DIFF_BSDIFF one (an EROFS-like LZ4HC file, patched as update_engine's generator
//! makes it) and a ZUCCHINI one (a raw ensemble patch): the payload, its old image and
//! its new image. For the incremental case of `bench/payload.sh`; unsigned.
//!
//! ```text
//! cargo run --release -p vabc-payload --features fuzzing --example compressed_payload -- DIR
//! ```
//!
//! writes `DIR/compressed.bin`, `DIR/old/vendor.img` and `DIR/new/vendor.img`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: compressed_payload DIR")?,
    );
    let tools = tempfile::tempdir()?;
    let (payload, old, new) = payload::fuzzing::sample_incremental_compressed(tools.path());
    for sub in ["old", "new"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    std::fs::write(dir.join("compressed.bin"), payload)?;
    std::fs::write(dir.join("old/vendor.img"), old)?;
    std::fs::write(dir.join("new/vendor.img"), new)?;
    Ok(())
}
