//! The file system itself: a root directory holding one read-only regular file, with
//! attributes that never change (1 h TTLs), `FOPEN_DIRECT_IO`, and EROFS for anything
//! that would write. The one implementation behind both transports: the /dev/fuse
//! threads and the io_uring queues.

use std::sync::Arc;

use engine::BlockDevice;

use super::proto::{self, InHeader};

pub(crate) const FILE_ID: u64 = 2;
/// Attributes never change while mounted.
const TTL_SECS: u64 = 3600;

/// How a request is answered.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Success with this many bytes of reply arguments in the output buffer.
    Reply(usize),
    /// Failure with this errno.
    Error(i32),
    /// FORGET, BATCH_FORGET, INTERRUPT: the kernel expects no answer.
    NoReply,
}

pub(crate) struct DiskFs {
    pub(crate) dev: Arc<dyn BlockDevice>,
    pub(crate) size: u64,
    pub(crate) name: Vec<u8>,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

impl DiskFs {
    fn attr(&self, ino: u64) -> Option<proto::Attr> {
        let (mode, size, nlink) = match ino {
            proto::ROOT_ID => (proto::S_IFDIR | 0o555, 0, 2),
            FILE_ID => (proto::S_IFREG | 0o444, self.size, 1),
            _ => return None,
        };
        Some(proto::Attr {
            ino,
            size,
            blocks: size.div_ceil(512),
            mode,
            nlink,
            uid: self.uid,
            gid: self.gid,
            blksize: self.dev.block_size(),
            ..Default::default()
        })
    }

    /// Answers one request. `arg` is the request's fixed argument
    /// ([`proto::fixed_arg_size`]), `rest` what follows it (a name); the reply arguments
    /// go to `out`, which is large enough for the biggest READ (the negotiated
    /// `max_pages`). READ data is written by the engine straight into `out`.
    pub(crate) fn handle(&self, h: &InHeader, arg: &[u8], rest: &[u8], out: &mut [u8]) -> Outcome {
        use Outcome::*;
        let ok = reply;
        match h.opcode {
            proto::LOOKUP => self.lookup(h, rest, out),
            proto::GETATTR => match self.attr(h.nodeid) {
                Some(attr) => ok(proto::put(
                    out,
                    &proto::AttrOut {
                        attr_valid: TTL_SECS,
                        attr_valid_nsec: 0,
                        dummy: 0,
                        attr,
                    },
                )),
                None => Error(libc::ENOENT),
            },
            proto::OPEN => self.open(h, arg, out),
            proto::OPENDIR => match h.nodeid {
                proto::ROOT_ID => ok(proto::put(out, &proto::OpenOut::default())),
                _ => Error(libc::ENOTDIR),
            },
            proto::READ => self.read(h, arg, out),
            proto::READDIR => self.readdir(h, arg, out),
            proto::STATFS => ok(proto::put(
                out,
                &proto::StatfsOut {
                    bsize: 512,
                    namelen: 255,
                    ..Default::default()
                },
            )),
            proto::ACCESS => match proto::read::<proto::AccessIn>(arg) {
                Some(a) if a.mask & libc::W_OK as u32 != 0 => Error(libc::EROFS),
                Some(_) => Reply(0),
                None => Error(libc::EINVAL),
            },
            proto::FSYNC => match self.dev.flush() {
                Ok(()) => Reply(0),
                Err(e) => Error(e.errno()),
            },
            proto::LSEEK => match proto::read::<proto::LseekIn>(arg) {
                Some(l) if h.nodeid == FILE_ID => {
                    match seek_whence(&*self.dev, l.offset, l.whence as i32) {
                        Ok(offset) => ok(proto::put(out, &proto::LseekOut { offset })),
                        Err(e) => Error(e),
                    }
                }
                _ => Error(libc::EINVAL),
            },
            proto::RELEASE
            | proto::RELEASEDIR
            | proto::FLUSH
            | proto::FSYNCDIR
            | proto::DESTROY => Reply(0),
            proto::FORGET | proto::BATCH_FORGET | proto::INTERRUPT => NoReply,
            // No extended attributes: ENOSYS makes the kernel stop asking.
            proto::GETXATTR | proto::LISTXATTR => Error(libc::ENOSYS),
            proto::SETATTR
            | proto::WRITE
            | proto::CREATE
            | proto::MKNOD
            | proto::MKDIR
            | proto::SYMLINK
            | proto::LINK
            | proto::UNLINK
            | proto::RMDIR
            | proto::RENAME
            | proto::RENAME2
            | proto::SETXATTR
            | proto::REMOVEXATTR
            | proto::FALLOCATE
            | proto::COPY_FILE_RANGE => Error(libc::EROFS),
            _ => Error(libc::ENOSYS),
        }
    }

    /// The one file, in the root.
    fn lookup(&self, h: &InHeader, rest: &[u8], out: &mut [u8]) -> Outcome {
        // The name is NUL-terminated.
        let name = rest.split(|&b| b == 0).next().unwrap_or_default();
        match self.attr(FILE_ID) {
            Some(attr) if h.nodeid == proto::ROOT_ID && name == self.name => reply(proto::put(
                out,
                &proto::EntryOut {
                    nodeid: FILE_ID,
                    generation: 0,
                    entry_valid: TTL_SECS,
                    attr_valid: TTL_SECS,
                    entry_valid_nsec: 0,
                    attr_valid_nsec: 0,
                    attr,
                },
            )),
            _ => Outcome::Error(libc::ENOENT),
        }
    }

    /// Read-only, and only the file.
    fn open(&self, h: &InHeader, arg: &[u8], out: &mut [u8]) -> Outcome {
        let Some(o) = proto::read::<proto::OpenIn>(arg) else {
            return Outcome::Error(libc::EINVAL);
        };
        if h.nodeid != FILE_ID {
            Outcome::Error(libc::EISDIR)
        } else if o.flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 {
            Outcome::Error(libc::EROFS)
        } else {
            reply(proto::put(
                out,
                &proto::OpenOut {
                    fh: 0,
                    open_flags: proto::FOPEN_DIRECT_IO,
                    backing_id: 0,
                },
            ))
        }
    }

    /// The engine reads straight into the reply; short at the end of the file.
    fn read(&self, h: &InHeader, arg: &[u8], out: &mut [u8]) -> Outcome {
        let Some(r) = proto::read::<proto::ReadIn>(arg) else {
            return Outcome::Error(libc::EINVAL);
        };
        if h.nodeid != FILE_ID {
            return Outcome::Error(libc::EISDIR);
        }
        if r.offset >= self.size {
            return Outcome::Reply(0);
        }
        let n = u64::from(r.size).min(self.size - r.offset) as usize;
        let Some(buf) = out.get_mut(..n) else {
            return Outcome::Error(libc::EINVAL);
        };
        let _span = trace::spans::span("fuse read", r.offset, n as u64);
        match self.dev.read_at(buf, r.offset) {
            Ok(()) => Outcome::Reply(n),
            Err(e) => {
                log::warn!(
                    "vabc serve: FUSE read of {n} bytes at offset {}: {e}",
                    r.offset
                );
                Outcome::Error(e.errno())
            }
        }
    }

    /// The root holds `.`, `..` and the file.
    fn readdir(&self, h: &InHeader, arg: &[u8], out: &mut [u8]) -> Outcome {
        let Some(r) = proto::read::<proto::ReadIn>(arg) else {
            return Outcome::Error(libc::EINVAL);
        };
        if h.nodeid != proto::ROOT_ID {
            return Outcome::Error(libc::ENOTDIR);
        }
        let entries: [(u64, u32, &[u8]); 3] = [
            (proto::ROOT_ID, proto::DT_DIR, b"."),
            (proto::ROOT_ID, proto::DT_DIR, b".."),
            (FILE_ID, proto::DT_REG, &self.name),
        ];
        let limit = (r.size as usize).min(out.len());
        let mut used = 0;
        for (i, (ino, typ, name)) in entries.iter().enumerate().skip(r.offset as usize) {
            if !proto::put_dirent(&mut out[..limit], &mut used, *ino, i as u64 + 1, *typ, name) {
                break;
            }
        }
        Outcome::Reply(used)
    }
}

/// A reply of the size `put` wrote, EIO when it did not fit.
fn reply(n: Option<usize>) -> Outcome {
    n.map_or(Outcome::Error(libc::EIO), Outcome::Reply)
}

/// The kernel asks the server only for SEEK_DATA and SEEK_HOLE.
pub(crate) fn seek_whence(
    dev: &dyn engine::BlockDevice,
    offset: u64,
    whence: i32,
) -> Result<u64, i32> {
    match whence {
        libc::SEEK_DATA => crate::seek_data_hole(dev, offset, false),
        libc::SEEK_HOLE => crate::seek_data_hole(dev, offset, true),
        _ => Err(libc::EINVAL),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pattern::Pattern;

    fn fs() -> DiskFs {
        DiskFs {
            dev: Arc::new(Pattern(10_000)),
            size: 10_000,
            name: b"disk.img".to_vec(),
            uid: 0,
            gid: 0,
        }
    }

    fn hdr(opcode: u32, nodeid: u64) -> InHeader {
        InHeader {
            opcode,
            nodeid,
            unique: 2,
            ..Default::default()
        }
    }

    #[test]
    fn lookup_finds_only_the_file() {
        let mut out = vec![0u8; 4096];
        let r = fs().handle(&hdr(proto::LOOKUP, 1), &[], b"disk.img\0", &mut out);
        assert_eq!(r, Outcome::Reply(128));
        let e: proto::EntryOut = proto::read(&out).unwrap();
        assert_eq!(e.nodeid, FILE_ID);
        assert_eq!(e.attr.size, 10_000);
        assert_eq!(e.attr.mode, proto::S_IFREG | 0o444);
        let r = fs().handle(&hdr(proto::LOOKUP, 1), &[], b"other\0", &mut out);
        assert_eq!(r, Outcome::Error(libc::ENOENT));
    }

    #[test]
    fn read_is_clipped_at_the_end() {
        let mut out = vec![0u8; 1 << 16];
        let arg = proto::ReadIn {
            offset: 9_000,
            size: 4096,
            ..Default::default()
        };
        let r = fs().handle(
            &hdr(proto::READ, FILE_ID),
            proto::bytes(&arg),
            &[],
            &mut out,
        );
        assert_eq!(r, Outcome::Reply(1000));
        assert_eq!(out[0], (9_000 % 251) as u8);
        let past = proto::ReadIn {
            offset: 10_000,
            size: 4096,
            ..Default::default()
        };
        let r = fs().handle(
            &hdr(proto::READ, FILE_ID),
            proto::bytes(&past),
            &[],
            &mut out,
        );
        assert_eq!(r, Outcome::Reply(0));
    }

    #[test]
    fn writes_and_write_opens_are_refused() {
        let mut out = vec![0u8; 4096];
        let open_rw = proto::OpenIn {
            flags: libc::O_RDWR as u32,
            open_flags: 0,
        };
        let r = fs().handle(
            &hdr(proto::OPEN, FILE_ID),
            proto::bytes(&open_rw),
            &[],
            &mut out,
        );
        assert_eq!(r, Outcome::Error(libc::EROFS));
        let r = fs().handle(&hdr(proto::WRITE, FILE_ID), &[0; 40], &[], &mut out);
        assert_eq!(r, Outcome::Error(libc::EROFS));
        let r = fs().handle(&hdr(999, FILE_ID), &[], &[], &mut out);
        assert_eq!(r, Outcome::Error(libc::ENOSYS));
    }

    #[test]
    fn readdir_resumes_at_offset() {
        let mut out = vec![0u8; 4096];
        let arg = proto::ReadIn {
            offset: 2,
            size: 4096,
            ..Default::default()
        };
        let r = fs().handle(&hdr(proto::READDIR, 1), proto::bytes(&arg), &[], &mut out);
        assert_eq!(r, Outcome::Reply(32));
        let d: proto::Dirent = proto::read(&out).unwrap();
        assert_eq!((d.ino, d.off), (FILE_ID, 3));
    }
}
