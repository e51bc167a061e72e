//! The body of the image fuzz target, shared with the test that replays the
//! fuzz corpus in the normal test run. Not part of the stable API.

use std::path::Path;

use crate::avb::{self, Descriptor};
use crate::build::Input;
use crate::params::SUPERBLOCK_SIZE;
use crate::superblock::Superblock;
use crate::verify::verify_tree;

/// Parse `data` as an image with an AVB footer (or a bare vbmeta blob) and as
/// a hash device with a veritysetup superblock, then do what `vabc avb info`
/// and a verifying reader do with what they find. Must never panic nor run
/// away, whatever the input; errors are fine.
pub fn exercise_image(data: &[u8]) {
    let path = Path::new("fuzz.img");
    let input = Input {
        reader: &data,
        name: path,
        len: data.len() as u64,
    };
    if let Ok(info) = avb::read_image_info_at(data, data.len() as u64, path) {
        let _ = avb::format_image_info(&info);
        for d in &info.descriptors {
            let Descriptor::Hashtree(h) = d else { continue };
            let Ok(params) = h.verity_params() else {
                continue;
            };
            // Blocks past the input read as zeros, so a descriptor claiming
            // terabytes would be hashed in full: verify only what is there.
            if params.data_size() <= data.len() as u64 && params.layout().is_ok() {
                let _ = verify_tree(input, &params, input, h.tree_offset, &h.root_digest, None);
            }
        }
    }
    if let Some(b) = data.get(..SUPERBLOCK_SIZE as usize)
        && let Ok(sb) = Superblock::decode(b, path, 0)
    {
        // What decodes must encode back to the same parameters.
        let again = Superblock::decode(&sb.encode(), path, 0).map(|s| s.params);
        assert_eq!(again.ok().as_ref(), Some(&sb.params));
        let _ = sb.params.layout();
    }
}
