//! Android's OTA payload (`payload.bin`), the file every Android device since 2016
//! updates from: read from a file, from an OTA zip in place, or from a URL by ranges;
//! its signatures verified as update_engine verifies them; its partitions extracted
//! (full payloads) or made from the old ones (incremental payloads).
//!
//! ```no_run
//! # fn main() -> Result<(), payload::Error> {
//! let p = payload::Payload::open(payload::Source::open("ota.zip")?)?;
//! let keys = payload::Keys::from_pem_file("update-payload-key.pub.pem".as_ref())?;
//! payload::verify::verify_metadata(&p, &keys)?;
//! for part in &p.manifest.partitions {
//!     println!("{}: {} operations", part.partition_name, part.operations.len());
//! }
//! # Ok(()) }
//! ```
//!
//! * [`source`]: a file, an OTA zip's entry, a URL;
//! * [`format`](mod@format): the header and manifest ([`proto`] has its messages);
//! * [`verify`]: the metadata and payload signatures;
//! * [`apply`]: a partition's operations applied, every hash checked;
//! * [`bspatch`]: the BSDIFF40 and BSDF2 patches of SOURCE_BSDIFF and BROTLI_BSDIFF;
//! * [`puffin`]: puffin's patches (PUFFDIFF), bsdiff between deflate streams puffed;
//! * [`lz4diff`](mod@lz4diff): LZ4DIFF_BSDIFF and LZ4DIFF_PUFFDIFF, a patch between
//!   LZ4-compressed files' contents and their recompression;
//! * [`zucchini`]: Zucchini's ensemble patches (ZUCCHINI), their raw elements; an
//!   executable element (ELF, DEX) is refused, naming its type;
//! * [`info`]: what a payload holds, as a report;
//! * [`cow`](mod@cow): an incremental payload as the COW a Virtual A/B Compression
//!   device writes for it (its merge operations as COPY and XOR ops, in their order).

pub mod apply;
pub mod bspatch;
pub mod cow;
pub mod error;
pub mod format;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod info;
pub mod lz4diff;
pub mod proto;
pub mod puffin;
pub mod source;
pub mod verify;
pub mod zucchini;

pub use error::{Error, Result};
pub use format::Payload;
pub use source::Source;
pub use verify::Keys;
