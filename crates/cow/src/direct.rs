//! Reading a block device around the page cache.
//!
//! A mounted file system may keep its own view of its blocks in the device's page
//! cache: a mounted ext4 fills its lazily initialised block bitmaps there, in memory
//! only. Read through that cache, a base partition that is mounted (the running old
//! system, while an update installs) is not the base on the disk, and a check or a
//! delta computed from it is wrong. `O_DIRECT` reads the disk. Its transfers must be
//! aligned, so reads of any offset and length go through an aligned bounce buffer.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Alignment of `O_DIRECT` transfers: a page, which covers every logical block size.
const ALIGN: usize = 4096;

/// `path` opened read-only with `O_DIRECT` when it is a block device; `None` for
/// anything else (files are read through the page cache as usual), or when the
/// device refuses `O_DIRECT`.
pub fn open_if_block_device(path: &Path) -> io::Result<Option<File>> {
    if !std::fs::metadata(path)?.file_type().is_block_device() {
        return Ok(None);
    }
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Fills `buf` from `offset` of `file`, opened with `O_DIRECT`: the aligned range
/// covering it is read into an aligned buffer and the bytes asked for copied out.
/// Fails with `UnexpectedEof` past the end of the device.
pub fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let a = ALIGN as u64;
    let start = offset / a * a;
    let end = (offset + buf.len() as u64).div_ceil(a) * a;
    let len = (end - start) as usize;
    let mut raw = vec![0u8; len + ALIGN];
    let pad = raw.as_ptr().align_offset(ALIGN);
    let aligned = &mut raw[pad..pad + len];
    let mut got = 0;
    // The covering range may run past a device whose size is not a multiple of the
    // alignment: a short read there is fine as long as the bytes asked for came.
    let want = (offset - start) as usize + buf.len();
    while got < want {
        match file.read_at(&mut aligned[got..], start + got as u64) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the device ends before byte {}", offset + buf.len() as u64),
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let skip = (offset - start) as usize;
    buf.copy_from_slice(&aligned[skip..skip + buf.len()]);
    Ok(())
}

/// A file or block device read as its storage holds it: a block device through its
/// `O_DIRECT` twin ([`open_if_block_device`]), anything else through the page cache.
#[derive(Debug)]
pub struct Disk {
    file: File,
    direct: Option<File>,
}

impl Disk {
    /// Opens `path` read-only (and its `O_DIRECT` twin when it is a block device).
    pub fn open(path: &Path) -> io::Result<Disk> {
        let file = File::open(path)?;
        // A folder opens for reading too, and then reads as a size no image has.
        if file.metadata()?.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::EISDIR));
        }
        Ok(Disk {
            file,
            direct: open_if_block_device(path)?,
        })
    }

    /// The descriptor opened through the page cache (for its size, say).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Fills `buf` from `offset`.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match &self.direct {
            Some(d) => read_exact_at(d, buf, offset),
            None => self.file.read_exact_at(buf, offset),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_not_opened_direct_and_odd_ranges_read_right() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..40_000u32).map(|i| (i * 13 % 251) as u8).collect();
        std::io::Write::write_all(&mut f, &data).unwrap();
        assert!(open_if_block_device(f.path()).unwrap().is_none());
        // The bounce path works on any descriptor; O_DIRECT only adds the alignment
        // rule, which it keeps.
        let file = f.reopen().unwrap();
        for (off, len) in [(0, 1), (4095, 2), (100, 9000), (36_000, 4000), (8192, 4096)] {
            let mut b = vec![0u8; len];
            read_exact_at(&file, &mut b, off as u64).unwrap();
            assert_eq!(b, data[off..off + len], "{off}+{len}");
        }
        let mut b = vec![0u8; 10];
        let e = read_exact_at(&file, &mut b, 39_995).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
