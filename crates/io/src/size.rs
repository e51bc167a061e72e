//! A file's or a block device's size: a block device's metadata says zero bytes.

use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;

/// The size in bytes of a regular file or block device (anything else that can seek:
/// its end).
pub fn size_of(file: &File) -> io::Result<u64> {
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    if meta.file_type().is_block_device() {
        return block_device_size(file);
    }
    let mut f = file;
    f.seek(SeekFrom::End(0))
}

fn block_device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to a live,
    // properly aligned u64; the descriptor is valid for the duration of the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

// _IOR(0x12, 114, size_t)
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

#[cfg(test)]
mod tests {
    #[test]
    fn a_file_is_its_length() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(12_345).unwrap();
        assert_eq!(super::size_of(&f).unwrap(), 12_345);
    }
}
