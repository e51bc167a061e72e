//! Progress of long work, reported to the caller's [`Observer`]: phases of known
//! size (planning, writing a COW, proving an image) and the milestones of an install,
//! so that an embedding program shows a bar, logs, or reports to its server.

use std::path::{Path, PathBuf};

use bundle::BundleManifest;

/// What the application reports as it works.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Event<'a> {
    /// A phase of work begins: `total` units (blocks) to do.
    Start {
        /// What the phase does ("planning", "writing COW", ...).
        phase: &'static str,
        /// Units of work in it.
        total: u64,
    },
    /// `n` more units of the current phase are done.
    Advance(u64),
    /// The current phase ended.
    Finish,
    /// An install checked the bundle's signature, every base and the free space;
    /// nothing is written before this.
    Checked(&'a BundleManifest),
    /// An install begins partition `index` (from 0) of `count`.
    Partition {
        /// The partition's name.
        name: &'a str,
        /// Its place in the bundle.
        index: usize,
        /// Partitions in the bundle.
        count: usize,
    },
    /// A partition's COW (and its manifest and tree) is in place.
    Installed(&'a Installed),
}

/// Receives [`Event`]s; called from worker threads too, so it is `Sync`. Any
/// `Fn(Event)` closure is one:
///
/// ```
/// let seen = std::sync::atomic::AtomicU64::new(0);
/// let observer = |e: ota::Event<'_>| {
///     if let ota::Event::Advance(n) = e {
///         seen.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
///     }
/// };
/// ota::Observer::event(&observer, ota::Event::Advance(3));
/// assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 3);
/// ```
pub trait Observer: Sync {
    /// One event.
    fn event(&self, event: Event<'_>);
}

impl<F: Fn(Event<'_>) + Sync> Observer for F {
    fn event(&self, event: Event<'_>) {
        self(event)
    }
}

/// An [`Observer`] that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct Silent;

impl Observer for Silent {
    fn event(&self, _: Event<'_>) {}
}

/// An observer as the planner and the COW writer (`delta`) see it; their temporary
/// files are registered for removal on a signal ([`crate::output`]).
pub struct Phases<'a>(pub &'a dyn Observer);

impl delta::Progress for Phases<'_> {
    fn start(&self, phase: &'static str, total: u64) {
        self.0.event(Event::Start { phase, total });
    }
    fn advance(&self, n: u64) {
        self.0.event(Event::Advance(n));
    }
    fn finish(&self) {
        self.0.event(Event::Finish);
    }
    fn make_temp(&self, dir: &Path, name: &str) -> std::io::Result<tempfile::NamedTempFile> {
        crate::output::temp_in(dir, name)
    }
}

/// What an install did with one partition.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct Installed {
    /// The partition.
    pub name: String,
    /// Its base.
    pub base: PathBuf,
    /// The COW written.
    pub cow: PathBuf,
    /// Its manifest sidecar.
    pub manifest: PathBuf,
    /// The COW's size in bytes.
    pub cow_size: u64,
    /// The dm-verity hash file of the new image (bundles made with verity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verity: Option<PathBuf>,
    /// Its root hash, hex (the signed manifest's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_hash: Option<String>,
    /// False when an earlier, interrupted install had already finished it.
    pub written: bool,
    /// Payload bytes an earlier, interrupted download had saved (not fetched again).
    pub resumed_bytes: u64,
}
