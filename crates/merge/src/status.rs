//! Merge progress shared with readers, so the image can be served while it
//! is being merged (spec §4.5). A COPY/XOR block is read
//! - from its source (base + XOR) while its window is pending,
//! - from the in-memory scratch copy while its window is being written,
//! - from its own place in the base once its window is committed.
//!
//! Readers of pending blocks hold the read lock while they read the source;
//! `begin_window` takes the write lock, so it waits for those reads to drain
//! before any destination of the window is overwritten.

use std::collections::HashMap;
use std::sync::{RwLock, RwLockReadGuard};

use cow::BLOCK_SIZE;

/// The window being written.
struct Window {
    start: usize,
    end: usize,
    /// New block → slot in `data`.
    slots: HashMap<u64, usize>,
    data: Vec<u8>,
}

#[derive(Default)]
struct Inner {
    /// Ops of the merge order that are durably merged.
    merged: usize,
    window: Option<Window>,
}

#[derive(Default)]
pub struct MergeStatus {
    inner: RwLock<Inner>,
}

/// Where a reader must take a COPY/XOR block from.
pub enum Source<'a> {
    /// The op is merged: read the block at its own place in the base.
    Merged,
    /// Not merged yet: read the op's source (and apply the XOR payload).
    Pending,
    /// Being merged: this is the new content.
    Scratch(&'a [u8]),
}

/// A consistent view held while one block is read.
pub struct View<'a> {
    guard: RwLockReadGuard<'a, Inner>,
}

impl View<'_> {
    /// `position`: the op's index in the merge order.
    pub fn source(&self, position: usize, new_block: u64) -> Source<'_> {
        if position < self.guard.merged {
            return Source::Merged;
        }
        if let Some(w) = &self.guard.window
            && (w.start..w.end).contains(&position)
            && let Some(&slot) = w.slots.get(&new_block)
        {
            return Source::Scratch(&w.data[slot * BLOCK_SIZE..(slot + 1) * BLOCK_SIZE]);
        }
        Source::Pending
    }
}

impl MergeStatus {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hold this while reading a block whose op may be merged concurrently.
    pub fn view(&self) -> View<'_> {
        View {
            guard: self.inner.read().unwrap_or_else(|p| p.into_inner()),
        }
    }

    pub fn merged(&self) -> usize {
        self.view().guard.merged
    }

    pub fn begin_window(&self, start: usize, blocks: impl Iterator<Item = u64>, data: &[u8]) {
        let slots: HashMap<u64, usize> = blocks.enumerate().map(|(i, b)| (b, i)).collect();
        let end = start + slots.len().max(data.len() / BLOCK_SIZE);
        let mut g = self.inner.write().unwrap_or_else(|p| p.into_inner());
        g.window = Some(Window {
            start,
            end,
            slots,
            data: data.to_vec(),
        });
    }

    pub fn set_merged(&self, merged: usize) {
        let mut g = self.inner.write().unwrap_or_else(|p| p.into_inner());
        g.merged = merged;
        if g.window.as_ref().is_some_and(|w| w.end <= merged) {
            g.window = None;
        }
    }
}
