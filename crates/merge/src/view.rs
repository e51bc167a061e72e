//! The new image read through base + COW while a merge may be running:
//! every block is right before, during and after its op is merged.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cow::format::{BLOCK_SIZE, BLOCK_SIZE_U64};
use cow::view::xor_into;
use cow::{CowReader, OpKind};

use crate::error::{MergeError, Result};
use crate::status::{MergeStatus, Source};

pub struct MergingView<'a> {
    cow: &'a CowReader,
    base: &'a File,
    base_path: PathBuf,
    /// Merge-order position of each ordered op, by its new block.
    positions: HashMap<u64, usize>,
    status: Arc<MergeStatus>,
}

impl<'a> MergingView<'a> {
    /// `status` must already reflect the device (see `Merge::load_status`).
    pub fn new(
        cow: &'a CowReader,
        base: &'a File,
        base_path: &Path,
        status: Arc<MergeStatus>,
    ) -> Result<Self> {
        let order = cow.merge_order()?;
        let mut positions = HashMap::new();
        for (pos, i) in order.into_iter().enumerate() {
            let op = &cow.ops()[i];
            if op.kind.is_ordered() {
                positions.entry(op.new_block).or_insert(pos);
            }
        }
        Ok(MergingView {
            cow,
            base,
            base_path: base_path.to_path_buf(),
            positions,
            status,
        })
    }

    fn pread(&self, buf: &mut [u8], off: u64) -> Result<()> {
        self.base
            .read_exact_at(buf, off)
            .map_err(|e| MergeError::Io(vabc_io::Error::new("read", &self.base_path, e).at(off)))
    }

    /// Read new block `block` into `buf` (4096 bytes).
    pub fn read_block(&self, block: u64, buf: &mut [u8]) -> Result<()> {
        let Some((op, k)) = self.cow.find_block(block) else {
            return self.pread(buf, block * BLOCK_SIZE_U64);
        };
        match op.kind {
            OpKind::Zero => buf.fill(0),
            OpKind::Replace => {
                let mut unit = vec![0u8; op.unit_size()];
                self.cow.read_payload(op, &mut unit)?;
                let s = k as usize * BLOCK_SIZE;
                buf.copy_from_slice(&unit[s..s + BLOCK_SIZE]);
            }
            OpKind::Copy | OpKind::Xor => {
                let pos = self
                    .positions
                    .get(&op.new_block)
                    .copied()
                    .unwrap_or(usize::MAX);
                // Held for the whole read: the merge cannot overwrite this
                // op's source until we are done.
                let view = self.status.view();
                match view.source(pos, block) {
                    Source::Merged => self.pread(buf, block * BLOCK_SIZE_U64)?,
                    Source::Scratch(d) => buf.copy_from_slice(d),
                    Source::Pending => {
                        if op.kind == OpKind::Copy {
                            self.pread(buf, op.source * BLOCK_SIZE_U64)?;
                        } else {
                            self.pread(buf, op.source)?;
                            let mut p = [0u8; BLOCK_SIZE];
                            self.cow.read_payload(op, &mut p)?;
                            xor_into(buf, &p);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
