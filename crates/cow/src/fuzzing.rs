//! The body of the reader fuzz target, shared with the test that replays
//! the fuzz corpus in the normal test run. Not part of the stable API.

use std::fs::File;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::path::Path;

use crate::format::BLOCK_SIZE;
use crate::reader::{CowReader, OpenOptions};
use crate::view::SnapshotView;

/// An anonymous in-memory file (no disk I/O per fuzz iteration).
pub fn memfile(name: &str, data: &[u8]) -> Option<File> {
    let cname = std::ffi::CString::new(name).ok()?;
    // SAFETY: `cname` is a valid NUL-terminated string; memfd_create has no
    // other preconditions and returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody
    // else, so File may take ownership and close it.
    let mut f = unsafe { File::from_raw_fd(fd) };
    f.write_all(data).ok()?;
    Some(f)
}

/// Parse `data` as a COW and exercise everything a consumer would do with
/// it. Must never panic, whatever the input; errors are fine.
pub fn exercise_reader(data: &[u8]) {
    let Some(file) = memfile("fuzz.cow", data) else {
        return;
    };
    let path = Path::new("fuzz.cow");
    let Ok(dup) = file.try_clone() else { return };
    if let Ok(r) = CowReader::from_file(dup, path, OpenOptions::default()) {
        exercise(&r);
        for l in r.labels().to_vec() {
            if let Ok(dup) = file.try_clone()
                && let Ok(r2) = CowReader::from_file(
                    dup,
                    path,
                    OpenOptions {
                        label: Some(l.label),
                    },
                )
            {
                exercise(&r2);
            }
        }
    }
    // A resume parse of a stream without footer takes another path.
    if let Ok(dup) = file.try_clone() {
        let _ =
            CowReader::from_file(dup, path, OpenOptions { label: Some(0) }).map(|r| exercise(&r));
    }
}

fn exercise(r: &CowReader) {
    let _ = r.verify_merge();
    let mut buf = Vec::new();
    // Bound the work per input: payloads are at most 256 KiB each.
    for op in r.ops().iter().take(64) {
        if op.data_length > 0 {
            buf.resize(op.unit_size(), 0);
            let _ = r.read_payload(op, &mut buf);
        }
        let _ = r.find_block(op.new_block);
    }
    let Some(base) = memfile("base.img", &[0x5a; 64 * BLOCK_SIZE]) else {
        return;
    };
    let base_path = Path::new("base.img");
    if let Ok(view) = SnapshotView::new(r, &base, base_path, Some(64 * BLOCK_SIZE as u64)) {
        let mut img = vec![0u8; 64 * BLOCK_SIZE];
        let _ = view.read_blocks(0, &mut img);
    }
}
