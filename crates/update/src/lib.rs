//! The device side of an update: what state it is in, kept where a power cut cannot
//! make it lie.
//!
//! A **store** is a folder on a data partition holding the update's COWs, their
//! manifests and dm-verity trees, and one small file, `state`, which says what the
//! device is doing:
//!
//! ```text
//!             install                 boot (attempts <= max)       mark-good
//!   none ───────────────▶ installing ─────▶ installed ◀────┐ ───────────────▶ merging
//!    ▲  ◀─── rollback ────┘   (done)          │   │ boot: attempts+1         │ merge done
//!    │  ◀─── rollback ────────────────────────┘   │                          ▼
//!    │  ◀─── boot: attempts > max (rolled back) ──┘                        merged
//!    └──────────────────────────── boot: COWs removed ◀──────────────────────┘
//! ```
//!
//! Each arrow is one durable step ([`Store::save`]: a temporary file written and
//! fsynced, renamed over `state.copy`, then the same over `state`, the folder fsynced),
//! so after a power cut the file holds either the state before a step or the one after
//! it, and every state has exactly one thing to do at the next boot
//! ([`State::on_boot`]). The file carries a check (its SHA-256), and a state file
//! damaged or gone is read from its copy ([`Store::load`] says why that is safe):
//!
//! | state | the device boots | and then |
//! |---|---|---|
//! | none | the base | nothing |
//! | installing | the base (the old system) | `install` again resumes it; `rollback` drops it |
//! | installed | base + COW, after counting the attempt | `mark-good` starts the merge; `max_boot_attempts` failed boots roll back |
//! | merging | base + COW, the merge resuming at once | the merge's own progress (in the COW) is crash-safe |
//! | merged | the base (now the new image) | the COWs are removed, state none |
//!
//! Rolling back is allowed until the merge starts: before it the base is untouched.
//!
//! The store is used through an open descriptor of its folder (`openat`,
//! `renameat`): a daemon started in an initramfs keeps reaching its store after the
//! switch to the real root has moved or hidden the mount it was opened through.
//! `rustix` gives those calls without unsafe code; `std` has no `*at` calls.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};
use serde::{Deserialize, Serialize};

/// Version of the state file's layout; a newer one is refused, not guessed at.
pub const STATE_SCHEMA: u32 = 1;

/// Name of the state file in a store.
pub const STATE_FILE: &str = "state";

/// Name of the state file's second copy, written before it at each step: what a boot
/// reads when the state file itself is damaged or gone (a flash error, a file system
/// repaired after a crash), so that such damage does not leave a device that cannot
/// boot ([`Store::load`]).
pub const STATE_COPY: &str = "state.copy";

/// Largest state file read (a state of a few partitions is a few KiB).
const MAX_STATE: u64 = 1 << 20;

/// The bundle's signed head (header, manifest, signature) as installed: what every
/// later step verifies again and takes its identities from.
pub const HEAD_FILE: &str = "update.head";

/// The version of the last update merged on this device (decimal), a floor for the
/// next install's version. It lives on the data partition, so whoever can write that
/// partition can lower it: a device that needs a floor no such writer can move keeps
/// one in its verified root image as well (docs/09-trust.md).
pub const VERSION_FILE: &str = "version";

/// Errors of the update state, each naming the store and what was being done.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpdateError {
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    #[error(
        "{path}: no state file: not an update store (make one with `vabc update init`), or \
         its state was lost; nothing was changed"
    )]
    NoState { path: PathBuf },
    #[error("{path}: the state file is damaged: {msg}; nothing was changed")]
    Corrupt { path: PathBuf, msg: String },
    #[error(
        "{path}: the state file has layout version {version}, newer than this vabc's \
         ({STATE_SCHEMA}); use the vabc that wrote it; nothing was changed"
    )]
    Newer { path: PathBuf, version: u32 },
    #[error("{path}: {msg}")]
    Refused { path: PathBuf, msg: String },
}

pub type Result<T> = std::result::Result<T, UpdateError>;

/// One partition of an installed update.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PartitionState {
    /// Partition name (`system`, ...), as in the bundle.
    pub name: String,
    /// The base: the partition's block device (or image file) the COW applies to and
    /// the merge overwrites.
    pub base: PathBuf,
    /// The COW's file name in the store.
    pub cow: String,
    /// The dm-verity hash file's name in the store and its root hash, hex, when the
    /// update carries them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verity: Option<VerityRef>,
    /// Size and sha256 of the new image.
    pub new_size: u64,
    pub new_sha256: String,
}

/// A dm-verity tree in the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct VerityRef {
    pub file: String,
    pub root_hash: String,
}

/// What is being installed or has been.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Update {
    /// Tells updates apart: sha256 of the bundle's signed manifest, hex.
    pub id: String,
    /// Boots of the new system allowed without `mark-good` before it is rolled back.
    pub max_boot_attempts: u32,
    pub partitions: Vec<PartitionState>,
}

/// The device's update state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum State {
    /// No update: boot the base.
    None,
    /// COWs are being written while the old system runs.
    Installing { update: Update },
    /// Installed: the next boots run the new system from base + COW; `boot_attempts`
    /// of them have started without `mark-good`.
    Installed { update: Update, boot_attempts: u32 },
    /// Marked good: the COWs are being merged into the bases.
    Merging { update: Update },
    /// Merged: the bases are the new images; the COWs are garbage.
    Merged { update: Update },
}

/// What a boot does, from [`State::on_boot`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BootAction {
    /// Mount the bases.
    Base,
    /// Mount base + COW, served; `merge` when the merge must resume at once.
    Snapshot { merge: bool },
    /// Too many boots of the new system failed: drop the update and mount the bases.
    RollBack,
    /// The merge completed: remove the COWs and mount the bases.
    CleanUp,
}

impl State {
    /// The state's name, as the file and `status` spell it.
    pub fn name(&self) -> &'static str {
        match self {
            State::None => "none",
            State::Installing { .. } => "installing",
            State::Installed { .. } => "installed",
            State::Merging { .. } => "merging",
            State::Merged { .. } => "merged",
        }
    }

    /// The update the state is about (none in [`State::None`]).
    pub fn update(&self) -> Option<&Update> {
        match self {
            State::None => None,
            State::Installing { update }
            | State::Installed { update, .. }
            | State::Merging { update }
            | State::Merged { update } => Some(update),
        }
    }

    /// What a boot in this state does, and the state to make durable before it acts
    /// (the attempt counted; the update dropped; the store cleaned).
    pub fn on_boot(&self) -> (BootAction, State) {
        match self {
            State::None | State::Installing { .. } => (BootAction::Base, self.clone()),
            State::Installed {
                update,
                boot_attempts,
            } if *boot_attempts >= update.max_boot_attempts => (BootAction::RollBack, State::None),
            State::Installed {
                update,
                boot_attempts,
            } => (
                BootAction::Snapshot { merge: false },
                State::Installed {
                    update: update.clone(),
                    boot_attempts: boot_attempts + 1,
                },
            ),
            State::Merging { .. } => (BootAction::Snapshot { merge: true }, self.clone()),
            State::Merged { .. } => (BootAction::CleanUp, State::None),
        }
    }

    /// Whether an install may begin at all, before anything is read: not while a
    /// merge is under way or done (the bases are the new image or becoming it).
    pub fn may_install(&self) -> std::result::Result<(), String> {
        match self {
            State::Merging { .. } | State::Merged { .. } => Err(format!(
                "an update is {} already (its bases are being overwritten in place): wait for \
                 the merge and the boot after it, then install",
                self.name()
            )),
            _ => Ok(()),
        }
    }

    /// `install` of `update`: from none, or resuming the same update.
    pub fn begin_install(&self, update: &Update) -> std::result::Result<State, String> {
        match self {
            State::None => Ok(State::Installing {
                update: update.clone(),
            }),
            State::Installing { update: u } if u == update => Ok(self.clone()),
            State::Installing { update: u } if u.id == update.id => Err(format!(
                "this bundle's install was begun with other bases or options (bases {}, {} boot \
                 attempts): run it again as it was begun, or drop it with `vabc update \
                 rollback` first",
                u.partitions
                    .iter()
                    .map(|p| format!("{}={}", p.name, p.base.display()))
                    .collect::<Vec<_>>()
                    .join(" "),
                u.max_boot_attempts
            )),
            State::Installing { .. } => Err(
                "another update is being installed: `vabc update rollback` drops it first".into(),
            ),
            State::Installed { update: u, .. } if u.id == update.id => {
                Err("this update is installed already; boot it".into())
            }
            other => Err(format!(
                "an update is {} already: finish it (or roll it back while that is allowed) first",
                other.name()
            )),
        }
    }

    /// The install finished: the next boot runs the new system.
    pub fn finish_install(&self) -> std::result::Result<State, String> {
        match self {
            State::Installing { update } => Ok(State::Installed {
                update: update.clone(),
                boot_attempts: 0,
            }),
            other => Err(format!(
                "no install under way (the update is {})",
                other.name()
            )),
        }
    }

    /// `mark-good`: the new system works; merge.
    pub fn mark_good(&self) -> std::result::Result<State, String> {
        match self {
            State::Installed { update, .. } => Ok(State::Merging {
                update: update.clone(),
            }),
            State::Merging { .. } | State::Merged { .. } => Err(format!(
                "already marked good (the update is {})",
                self.name()
            )),
            other => Err(format!(
                "there is no installed update to mark good (the update is {})",
                other.name()
            )),
        }
    }

    /// `rollback`: allowed until the merge starts.
    pub fn roll_back(&self) -> std::result::Result<State, String> {
        match self {
            State::Installing { .. } | State::Installed { .. } => Ok(State::None),
            State::None => Err("there is no update to roll back".into()),
            State::Merging { .. } | State::Merged { .. } => Err(format!(
                "the update is {}: the merge has overwritten the old image in place, so there \
                 is nothing to roll back to",
                self.name()
            )),
        }
    }

    /// The merge completed.
    pub fn merged(&self) -> std::result::Result<State, String> {
        match self {
            State::Merging { update } => Ok(State::Merged {
                update: update.clone(),
            }),
            other => Err(format!(
                "no merge under way (the update is {})",
                other.name()
            )),
        }
    }
}

/// The state file's layout.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
struct StateFile {
    schema_version: u32,
    #[serde(flatten)]
    state: State,
    /// SHA-256 (hex) of the file as it is without this field: damage that still
    /// parses (a flipped digit in the boot attempts, a letter of a base path) is
    /// found, not acted on. Absent in files vabc wrote before it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    check: Option<String>,
}

/// The bytes of a state file without its check (what the check covers).
fn unchecked_bytes(schema_version: u32, state: &State) -> Vec<u8> {
    let f = StateFile {
        schema_version,
        state: state.clone(),
        check: None,
    };
    let mut v = serde_json::to_vec_pretty(&f).unwrap_or_default();
    v.push(b'\n');
    v
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Parses a state file's bytes (`path` names it in errors).
pub fn parse_state(bytes: &[u8], path: &Path) -> Result<State> {
    let corrupt = |msg: String| UpdateError::Corrupt {
        path: path.to_path_buf(),
        msg,
    };
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| corrupt(format!("not JSON: {e}")))?;
    let version = v
        .get("schema_version")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| corrupt("no schema_version".into()))?;
    if version > u64::from(STATE_SCHEMA) {
        return Err(UpdateError::Newer {
            path: path.to_path_buf(),
            version: u32::try_from(version).unwrap_or(u32::MAX),
        });
    }
    let f: StateFile = serde_json::from_value(v).map_err(|e| corrupt(e.to_string()))?;
    if let Some(check) = &f.check
        && *check != sha256_hex(&unchecked_bytes(f.schema_version, &f.state))
    {
        return Err(corrupt(
            "its check does not match what it says (a damaged byte)".into(),
        ));
    }
    if let Some(u) = f.state.update() {
        u.validate().map_err(corrupt)?;
    }
    Ok(f.state)
}

impl Update {
    /// Checks what the state file could use to steer file operations or devices: the
    /// names it holds must be the plain ones vabc generates (`NAME.cow`,
    /// `NAME.verity`, partition names of letters, digits, `_` and `-`, each once), the
    /// bases absolute paths without `..`, the id and hashes hex. A state that breaks
    /// any of these was not written by vabc and is refused, naming the field.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let hex = |s: &str, what: &str| -> std::result::Result<(), String> {
            if s.len() < 64 || s.len() > 128 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!("{what} {s:?} is not a hex digest"));
            }
            Ok(())
        };
        hex(&self.id, "update.id")?;
        if self.partitions.is_empty() {
            return Err("update.partitions is empty".into());
        }
        for (i, p) in self.partitions.iter().enumerate() {
            let field = |f: &str| format!("update.partitions[{i}].{f}");
            if !manifest::is_partition_name(&p.name) {
                return Err(format!(
                    "{} {:?} is not a partition name (1 to 64 letters, digits, '_' or '-')",
                    field("name"),
                    p.name
                ));
            }
            if self.partitions[..i].iter().any(|q| q.name == p.name) {
                return Err(format!("{} {:?} is named twice", field("name"), p.name));
            }
            if p.cow != cow_name(&p.name) {
                return Err(format!(
                    "{} {:?} is not {:?}, the name vabc gives it",
                    field("cow"),
                    p.cow,
                    cow_name(&p.name)
                ));
            }
            if let Some(v) = &p.verity {
                if v.file != verity_name(&p.name) {
                    return Err(format!(
                        "{} {:?} is not {:?}, the name vabc gives it",
                        field("verity.file"),
                        v.file,
                        verity_name(&p.name)
                    ));
                }
                hex(&v.root_hash, &field("verity.root_hash"))?;
            }
            hex(&p.new_sha256, &field("new_sha256"))?;
            let plain = p.base.is_absolute()
                && p.base.components().all(|c| {
                    matches!(
                        c,
                        std::path::Component::RootDir | std::path::Component::Normal(_)
                    )
                });
            if !plain {
                return Err(format!(
                    "{} {:?} is not an absolute path without '.' or '..'",
                    field("base"),
                    p.base
                ));
            }
        }
        Ok(())
    }
}

/// The COW file of partition `name` in a store.
pub fn cow_name(name: &str) -> String {
    format!("{name}.cow")
}

/// The dm-verity hash file of partition `name` in a store.
pub fn verity_name(name: &str) -> String {
    format!("{name}.verity")
}

/// The state file's bytes for `state`.
pub fn encode_state(state: &State) -> Vec<u8> {
    let f = StateFile {
        schema_version: STATE_SCHEMA,
        state: state.clone(),
        check: Some(sha256_hex(&unchecked_bytes(STATE_SCHEMA, state))),
    };
    let mut v = serde_json::to_vec_pretty(&f).unwrap_or_default();
    v.push(b'\n');
    v
}

/// An update store: a folder, held open.
#[derive(Debug)]
pub struct Store {
    dir: OwnedFd,
    path: PathBuf,
}

impl Store {
    /// Opens the store at `path` (which must exist). Refuses a folder that another
    /// user owns or that its group or others may write: whoever can add or replace
    /// its files could steer what the device boots.
    pub fn open(path: &Path) -> Result<Store> {
        let dir = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            UpdateError::Io(vabc_io::Error::new("open the store folder", path, e.into()))
        })?;
        let st = rustix::fs::fstat(&dir).map_err(|e| {
            UpdateError::Io(vabc_io::Error::new("stat the store folder", path, e.into()))
        })?;
        let me = rustix::process::geteuid().as_raw();
        if st.st_uid != me {
            return Err(UpdateError::Refused {
                path: path.to_path_buf(),
                msg: format!(
                    "the store folder is owned by user {}, not by this user ({me}): another \
                     user could replace its files; `chown {me} {}` if it is yours; nothing was \
                     changed",
                    st.st_uid,
                    path.display()
                ),
            });
        }
        let mode = st.st_mode & 0o7777;
        if mode & 0o022 != 0 {
            return Err(UpdateError::Refused {
                path: path.to_path_buf(),
                msg: format!(
                    "the store folder has mode {mode:04o}: its group or others may add or \
                     replace its files; `chmod go-w {}`; nothing was changed",
                    path.display()
                ),
            });
        }
        Ok(Store {
            dir,
            path: path.to_path_buf(),
        })
    }

    /// Makes `path` a store in state none (the folder is created if missing); refuses
    /// a folder that is one already.
    pub fn init(path: &Path) -> Result<Store> {
        if !path.exists() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)
                .map_err(|e| {
                    UpdateError::Io(vabc_io::Error::new("create the store folder", path, e))
                })?;
        }
        let store = Store::open(path)?;
        if store.exists(STATE_FILE)? || store.exists(STATE_COPY)? {
            return Err(UpdateError::Refused {
                path: path.to_path_buf(),
                msg: "is an update store already (it has a state file)".into(),
            });
        }
        store.save(&State::None)?;
        Ok(store)
    }

    /// The store's path, as it was opened (it may not reach the folder any more after
    /// a switch of root; the descriptor does).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The descriptor of the store's folder.
    pub fn dir(&self) -> &OwnedFd {
        &self.dir
    }

    fn io(&self, op: &'static str) -> impl FnOnce(rustix::io::Errno) -> UpdateError + '_ {
        move |e| UpdateError::Io(vabc_io::Error::new(op, &self.path, e.into()))
    }

    /// Whether the store holds a file `name`.
    pub fn exists(&self, name: &str) -> Result<bool> {
        match rustix::fs::statat(&self.dir, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
            Ok(_) => Ok(true),
            Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(e) => Err(self.io("stat a file of the store")(e)),
        }
    }

    /// Opens the store's file `name` for reading: not through a symbolic link, and
    /// only a regular file.
    pub fn open_file(&self, name: &str) -> Result<std::fs::File> {
        let path = self.path.join(name);
        let fd = rustix::fs::openat(
            &self.dir,
            name,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK,
            Mode::empty(),
        )
        .map_err(|e| {
            UpdateError::Io(vabc_io::Error::new(
                if e == rustix::io::Errno::LOOP {
                    "open (it is a symbolic link, which a store never holds)"
                } else {
                    "open"
                },
                &path,
                e.into(),
            ))
        })?;
        let st = rustix::fs::fstat(&fd)
            .map_err(|e| UpdateError::Io(vabc_io::Error::new("stat", &path, e.into())))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(UpdateError::Refused {
                path,
                msg: "is not a regular file, which every file of a store is".into(),
            });
        }
        // Blocking reads again (O_NONBLOCK only kept a planted FIFO from hanging open).
        rustix::fs::fcntl_setfl(&fd, OFlags::empty())
            .map_err(|e| UpdateError::Io(vabc_io::Error::new("set flags", &path, e.into())))?;
        Ok(std::fs::File::from(fd))
    }

    /// Reads the store's file `name` whole; larger than `max` bytes is refused.
    pub fn read_file(&self, name: &str, max: u64) -> Result<Vec<u8>> {
        let file = self.open_file(name)?;
        let mut bytes = Vec::new();
        file.take(max + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| UpdateError::Io(vabc_io::Error::new("read", self.path.join(name), e)))?;
        if bytes.len() as u64 > max {
            return Err(UpdateError::Refused {
                path: self.path.join(name),
                msg: format!("is larger than {max} bytes, more than vabc ever writes there"),
            });
        }
        Ok(bytes)
    }

    /// Makes `bytes` the store's file `name`, durably and whole: a temporary file
    /// created anew (`O_EXCL`, so a planted link or file is never written through),
    /// fsynced, renamed over `name`, the folder fsynced.
    pub fn write_file(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let tmp = format!(".{name}.tmp");
        self.remove(&tmp)?;
        let fd = rustix::fs::openat(
            &self.dir,
            &tmp,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| {
            UpdateError::Io(vabc_io::Error::new(
                "create",
                self.path.join(&tmp),
                e.into(),
            ))
        })?;
        let mut f = std::fs::File::from(fd);
        // A write that fails (a full partition) leaves no temporary file behind.
        let written = f
            .write_all(bytes)
            .and_then(|()| f.sync_all())
            .map_err(|e| UpdateError::Io(vabc_io::Error::new("write", self.path.join(&tmp), e)))
            .and_then(|()| {
                rustix::fs::renameat(&self.dir, &tmp, &self.dir, name).map_err(|e| {
                    UpdateError::Io(vabc_io::Error::new(
                        "rename into place",
                        self.path.join(name),
                        e.into(),
                    ))
                })
            });
        drop(f);
        if let Err(e) = written {
            let _ = self.remove(&tmp);
            return Err(e);
        }
        rustix::fs::fsync(&self.dir).map_err(self.io("fsync the store folder"))
    }

    /// The current state: the state file's, or, when that file is damaged or gone,
    /// its copy's (said on the log). The copy is written first at each step, so it
    /// holds the same state or, after a power cut between the two writes, the next
    /// one: a step that was already decided (an install whose files are complete, a
    /// merge asked for, an attempt counted), never one that goes back over a write
    /// to a base. A state file from a newer vabc is refused, never passed over for
    /// the copy; both damaged is [`UpdateError::Corrupt`] (the state file's error).
    pub fn load(&self) -> Result<State> {
        self.load_either().map(|(state, _)| state)
    }

    /// [`Store::load`], and a state file read from its copy is written again from it
    /// (what the boot step does, so that the damage is repaired at the first boot
    /// after it). A repair that fails is said on the log: the state read stands.
    pub fn load_and_repair(&self) -> Result<State> {
        let (state, from_copy) = self.load_either()?;
        if from_copy && let Err(e) = self.write_file(STATE_FILE, &encode_state(&state)) {
            log::warn!("vabc update: the state file could not be repaired from its copy: {e}");
        }
        Ok(state)
    }

    /// The state, and whether it was read from the copy.
    fn load_either(&self) -> Result<(State, bool)> {
        let error = match self.load_file(STATE_FILE) {
            Ok(state) => return Ok((state, false)),
            Err(e @ (UpdateError::Corrupt { .. } | UpdateError::NoState { .. })) => e,
            Err(e) => return Err(e),
        };
        match self.load_file(STATE_COPY) {
            Ok(state) => {
                log::warn!(
                    "vabc update: {error}; the state is read from its copy {} ({})",
                    self.path.join(STATE_COPY).display(),
                    state.name()
                );
                Ok((state, true))
            }
            Err(_) => Err(error),
        }
    }

    /// The state in the store's file `name`.
    fn load_file(&self, name: &str) -> Result<State> {
        let path = self.path.join(name);
        if !self.exists(name)? {
            return Err(UpdateError::NoState {
                path: self.path.clone(),
            });
        }
        let bytes = match self.read_file(name, MAX_STATE) {
            Err(UpdateError::Refused { msg, .. }) => {
                return Err(UpdateError::Corrupt { path, msg });
            }
            r => r?,
        };
        parse_state(&bytes, &path)
    }

    /// Makes `state` the store's state, durably ([`Store::write_file`]): a power cut
    /// leaves the old state or the new one. The copy is written first ([`Store::load`]
    /// says why that order).
    pub fn save(&self, state: &State) -> Result<()> {
        let bytes = encode_state(state);
        self.write_file(STATE_COPY, &bytes)?;
        self.write_file(STATE_FILE, &bytes)
    }

    /// Removes the store's file `name` if it is there (the folder is fsynced by the
    /// next [`Store::save`] or [`Store::sync`]).
    pub fn remove(&self, name: &str) -> Result<()> {
        match rustix::fs::unlinkat(&self.dir, name, rustix::fs::AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
            Err(e) => Err(UpdateError::Io(vabc_io::Error::new(
                "remove",
                self.path.join(name),
                e.into(),
            ))),
        }
    }

    /// Makes the folder's entries durable.
    pub fn sync(&self) -> Result<()> {
        rustix::fs::fsync(&self.dir).map_err(self.io("fsync the store folder"))
    }

    /// Removes every file of `update` from the store (its signed head, COWs, their
    /// manifests and trees), then syncs the folder.
    pub fn remove_update_files(&self, update: &Update) -> Result<()> {
        self.remove(HEAD_FILE)?;
        for p in &update.partitions {
            self.remove(&p.cow)?;
            self.remove(&format!("{}.manifest", p.cow))?;
            if let Some(v) = &p.verity {
                self.remove(&v.file)?;
            }
        }
        self.sync()
    }

    /// A refusal naming the store.
    pub fn refused(&self, msg: String) -> UpdateError {
        UpdateError::Refused {
            path: self.path.clone(),
            msg,
        }
    }
}

/// Bodies of the fuzz targets (fuzz/), for them and for the test that replays their
/// corpus.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    use super::*;

    /// `update_state`: any bytes parse to a state or to an error, and a state parsed
    /// re-encodes to itself.
    pub fn exercise_parse(data: &[u8]) {
        if let Ok(s) = parse_state(data, Path::new("fuzz")) {
            let again = parse_state(&encode_state(&s), Path::new("fuzz"));
            assert_eq!(again.ok(), Some(s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(id: &str) -> Update {
        Update {
            id: format!("{id:0>64}"),
            max_boot_attempts: 2,
            partitions: vec![PartitionState {
                name: "system".into(),
                base: "/dev/vda".into(),
                cow: "system.cow".into(),
                verity: Some(VerityRef {
                    file: "system.verity".into(),
                    root_hash: "ab".repeat(32),
                }),
                new_size: 1 << 20,
                new_sha256: "cd".repeat(32),
            }],
        }
    }

    #[test]
    fn every_state_round_trips_through_its_file() {
        let u = update("a1");
        for s in [
            State::None,
            State::Installing { update: u.clone() },
            State::Installed {
                update: u.clone(),
                boot_attempts: 1,
            },
            State::Merging { update: u.clone() },
            State::Merged { update: u },
        ] {
            let bytes = encode_state(&s);
            assert_eq!(parse_state(&bytes, Path::new("s")).unwrap(), s);
        }
    }

    #[test]
    fn the_lifecycle_and_its_refusals() {
        let u = update("a1");
        let s = State::None.begin_install(&u).unwrap();
        assert_eq!(s.begin_install(&u).unwrap(), s, "resuming the same update");
        assert!(s.begin_install(&update("a2")).is_err());
        assert!(s.mark_good().is_err());
        assert_eq!(s.on_boot().0, BootAction::Base);
        let s = s.finish_install().unwrap();
        // Two boots allowed, the third rolls back.
        let (a, s1) = s.on_boot();
        assert_eq!(a, BootAction::Snapshot { merge: false });
        let (a, s2) = s1.on_boot();
        assert_eq!(a, BootAction::Snapshot { merge: false });
        assert_eq!(s2.on_boot(), (BootAction::RollBack, State::None));
        assert_eq!(s1.roll_back().unwrap(), State::None);
        let m = s1.mark_good().unwrap();
        assert_eq!(
            m.on_boot(),
            (BootAction::Snapshot { merge: true }, m.clone())
        );
        assert!(m.roll_back().unwrap_err().contains("overwritten"));
        assert!(m.mark_good().is_err());
        let d = m.merged().unwrap();
        assert!(d.roll_back().is_err());
        assert_eq!(d.on_boot(), (BootAction::CleanUp, State::None));
        assert!(State::None.roll_back().is_err());
    }

    #[test]
    fn a_store_keeps_its_state_and_refuses_bad_files() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("store");
        let st = Store::init(&path).unwrap();
        assert_eq!(st.load().unwrap(), State::None);
        assert!(matches!(
            Store::init(&path).unwrap_err(),
            UpdateError::Refused { .. }
        ));
        let s = State::Installing {
            update: update("a1"),
        };
        st.save(&s).unwrap();
        assert_eq!(Store::open(&path).unwrap().load().unwrap(), s);
        assert!(!st.exists(".state.tmp").unwrap());

        // The descriptor keeps reaching the folder after it moved.
        let moved = d.path().join("moved");
        std::fs::rename(&path, &moved).unwrap();
        st.save(&State::None).unwrap();
        assert_eq!(Store::open(&moved).unwrap().load().unwrap(), State::None);

        // A newer layout is refused, never passed over for the copy.
        let state = moved.join(STATE_FILE);
        let copy = moved.join(STATE_COPY);
        std::fs::write(&state, br#"{"schema_version": 2, "state": "none"}"#).unwrap();
        let e = st.load().unwrap_err();
        assert!(matches!(e, UpdateError::Newer { version: 2, .. }), "{e}");
        // Damaged or gone, with a good copy: the copy's state.
        for damaged in [
            &b"{\"schema_version\": 1, \"state\": \"sideways\"}"[..],
            b"{\"schema_ver",
        ] {
            std::fs::write(&state, damaged).unwrap();
            assert_eq!(st.load().unwrap(), State::None);
        }
        std::fs::remove_file(&state).unwrap();
        assert_eq!(st.load().unwrap(), State::None);
        // Both damaged: the state file's error; both gone: no store.
        std::fs::write(&state, b"{\"schema_version\": 1, \"state\": \"sideways\"}").unwrap();
        std::fs::write(&copy, b"{\"schema_ver").unwrap();
        let e = st.load().unwrap_err();
        assert!(matches!(e, UpdateError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("sideways"), "{e}");
        std::fs::remove_file(&state).unwrap();
        std::fs::remove_file(&copy).unwrap();
        let e = st.load().unwrap_err();
        assert!(matches!(e, UpdateError::NoState { .. }), "{e}");
        assert!(e.to_string().contains("nothing was changed"));
    }

    /// Any one byte of the state file flipped, and the file cut anywhere: the state
    /// read is the one saved (from the copy where the file is damaged), never a
    /// state the damage made up (the check finds a change that still parses).
    #[test]
    fn any_damage_to_the_state_file_reads_the_state_saved() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("store");
        let st = Store::init(&path).unwrap();
        let saved = State::Installed {
            update: update("b2"),
            boot_attempts: 1,
        };
        st.save(&saved).unwrap();
        let good = std::fs::read(path.join(STATE_FILE)).unwrap();
        assert_eq!(std::fs::read(path.join(STATE_COPY)).unwrap(), good);
        let damaged = |bytes: &[u8], what: String| {
            std::fs::write(path.join(STATE_FILE), bytes).unwrap();
            assert_eq!(st.load().unwrap(), saved, "{what}");
            // Without the copy the damage is refused, never read as another state.
            let copy = std::fs::read(path.join(STATE_COPY)).unwrap();
            std::fs::remove_file(path.join(STATE_COPY)).unwrap();
            match st.load() {
                Ok(s) => assert_eq!(s, saved, "{what}: read without the copy"),
                Err(e) => assert!(matches!(e, UpdateError::Corrupt { .. }), "{what}: {e}"),
            }
            std::fs::write(path.join(STATE_COPY), copy).unwrap();
        };
        for at in 0..good.len() {
            for bit in [0x01u8, 0x20] {
                let mut b = good.clone();
                b[at] ^= bit;
                damaged(&b, format!("byte {at} ^ {bit:#x}"));
            }
        }
        for len in 0..good.len() - 1 {
            damaged(&good[..len], format!("cut at {len}"));
        }
    }

    #[test]
    fn a_state_that_names_other_files_or_paths_is_refused_naming_the_field() {
        let good = update("a1");
        type Mutation = Box<dyn Fn(&mut Update)>;
        let cases: Vec<(&str, Mutation)> = vec![
            (
                "cow",
                Box::new(|u| u.partitions[0].cow = "../victim".into()),
            ),
            (
                "cow",
                Box::new(|u| u.partitions[0].cow = "/etc/passwd".into()),
            ),
            ("cow", Box::new(|u| u.partitions[0].cow = "state".into())),
            ("name", Box::new(|u| u.partitions[0].name = "../x".into())),
            (
                "verity.file",
                Box::new(|u| u.partitions[0].verity.as_mut().unwrap().file = "../t".into()),
            ),
            (
                "verity.root_hash",
                Box::new(|u| u.partitions[0].verity.as_mut().unwrap().root_hash = "zz".into()),
            ),
            (
                "base",
                Box::new(|u| u.partitions[0].base = "rel/base.img".into()),
            ),
            (
                "base",
                Box::new(|u| u.partitions[0].base = "/dev/../etc/x".into()),
            ),
            ("update.id", Box::new(|u| u.id = "x".into())),
            (
                "named twice",
                Box::new(|u| {
                    let p = u.partitions[0].clone();
                    u.partitions.push(p)
                }),
            ),
            ("empty", Box::new(|u| u.partitions.clear())),
        ];
        for (field, mutate) in cases {
            let mut u = good.clone();
            mutate(&mut u);
            let bytes = encode_state(&State::Installed {
                update: u,
                boot_attempts: 0,
            });
            let e = parse_state(&bytes, Path::new("st")).unwrap_err();
            assert!(matches!(e, UpdateError::Corrupt { .. }), "{e}");
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
    }

    #[test]
    fn the_store_is_never_written_or_read_through_a_planted_link() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("store");
        let st = Store::init(&path).unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, path.join(".state.tmp")).unwrap();
        st.save(&State::None).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        std::os::unix::fs::symlink(&victim, path.join("system.cow")).unwrap();
        let e = st.open_file("system.cow").unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        std::fs::remove_file(path.join(STATE_FILE)).unwrap();
        std::os::unix::fs::symlink(&victim, path.join(STATE_FILE)).unwrap();
        assert!(st.load().is_err());
        // A folder others may write is refused; so is one of another owner.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = Store::open(&path).unwrap_err();
        assert!(e.to_string().contains("mode 0777"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(&path, Some(4242), None).unwrap();
            let e = Store::open(&path).unwrap_err();
            assert!(e.to_string().contains("owned by user 4242"), "{e}");
        }
    }

    #[test]
    fn a_resumed_install_with_other_bases_or_options_is_refused() {
        let u = update("a1");
        let s = State::None.begin_install(&u).unwrap();
        let mut other = u.clone();
        other.partitions[0].base = "/dev/vdb".into();
        let e = s.begin_install(&other).unwrap_err();
        assert!(e.contains("system=/dev/vda"), "{e}");
        let mut other = u.clone();
        other.max_boot_attempts = 5;
        assert!(s.begin_install(&other).is_err());
    }
}
