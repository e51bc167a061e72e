//! Where a payload's bytes come from: a `payload.bin` file, the `payload.bin` entry of
//! an OTA zip read in place (Android stores it uncompressed, so its bytes are a range
//! of the zip: no temporary copy), or an `http://` / `https://` URL of either, read
//! with range requests for exactly the bytes asked (the header, the manifest, then
//! only the data of the operations applied).
//!
//! The zip's directory is read by the `zip` crate; HTTP goes through `ureq`.

use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use vabc_io::ReadAt;

use crate::error::{Error, Result};

/// The name Android gives the payload inside an OTA zip.
pub const ZIP_ENTRY: &str = "payload.bin";

/// A payload's bytes: a byte range of a file or URL, read from any thread.
pub struct Source {
    name: String,
    reader: Box<dyn ReadAt + Send>,
    base: u64,
    len: u64,
    fetched: Option<std::sync::Arc<AtomicU64>>,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source")
            .field("name", &self.name)
            .field("base", &self.base)
            .field("len", &self.len)
            .finish()
    }
}

impl Source {
    /// Opens `spec`: a path or an `http(s)://` URL, of a payload or of an OTA zip
    /// holding one (told apart by their first bytes).
    pub fn open(spec: &str) -> Result<Source> {
        let whole = if spec.starts_with("http://") || spec.starts_with("https://") {
            let http = Http::open(spec)?;
            let len = http.len;
            let fetched = http.fetched.clone();
            let mut s = Source::from_reader(spec, Box::new(http), len);
            s.fetched = Some(fetched);
            s
        } else {
            let path = Path::new(spec);
            let file = std::fs::File::open(path).map_err(vabc_io::error::on("open", path))?;
            let len = vabc_io::size::size_of(&file).map_err(vabc_io::error::on("size", path))?;
            Source::from_reader(spec, Box::new(file), len)
        };
        let mut magic = [0u8; 4];
        if whole.len >= 4 {
            whole.read_at(&mut magic, 0)?;
        }
        if &magic == b"PK\x03\x04" {
            whole.zip_entry(ZIP_ENTRY)
        } else {
            Ok(whole)
        }
    }

    /// A source over `len` bytes of `reader`, called `name` in errors.
    pub fn from_reader(name: &str, reader: Box<dyn ReadAt + Send>, len: u64) -> Source {
        Source {
            name: name.to_string(),
            reader,
            base: 0,
            len,
            fetched: None,
        }
    }

    /// The name errors give it: the path or URL, with `!payload.bin` for a zip entry.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes fetched over HTTP so far (`None` for a local file).
    pub fn fetched(&self) -> Option<u64> {
        self.fetched.as_ref().map(|f| f.load(Ordering::Relaxed))
    }

    /// Fills `buf` from `offset`; reading past the end is a format error naming it.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(Error::format(
                &self.name,
                offset,
                format!(
                    "{} bytes asked, past the end ({} bytes): the payload is cut short",
                    buf.len(),
                    self.len
                ),
            ));
        }
        self.reader
            .read_exact_at(buf, self.base + offset)
            .map_err(|e| vabc_io::Error::new("read", &self.name, e).at(offset).into())
    }

    /// `len` bytes from `offset` in a new buffer.
    pub fn read_vec(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let n = usize::try_from(len)
            .map_err(|_| Error::format(&self.name, offset, format!("{len} bytes is too many")))?;
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(Error::format(
                &self.name,
                offset,
                format!(
                    "{len} bytes from here run past the end ({} bytes)",
                    self.len
                ),
            ));
        }
        let mut v = vec![0u8; n];
        self.read_at(&mut v, offset)?;
        Ok(v)
    }

    /// The stored (uncompressed) entry `entry` of this zip, as a source of its own.
    fn zip_entry(self, entry: &str) -> Result<Source> {
        let cursor = Cursor::new(&self);
        let mut zip = zip::ZipArchive::new(cursor)
            .map_err(|e| Error::format(&self.name, None, format!("not a readable zip: {e}")))?;
        let (start, size, method) = {
            let f = zip.by_name(entry).map_err(|e| {
                Error::format(&self.name, None, format!("no {entry} in this zip: {e}"))
            })?;
            (f.data_start(), f.size(), f.compression())
        };
        let Some(start) = start else {
            return Err(Error::format(
                &self.name,
                None,
                format!("the zip does not say where {entry}'s data starts"),
            ));
        };
        if method != zip::CompressionMethod::Stored {
            return Err(Error::format(
                &self.name,
                start,
                format!("{entry} is compressed ({method}); Android stores it uncompressed"),
            ));
        }
        if start.checked_add(size).is_none_or(|e| e > self.len) {
            return Err(Error::format(
                &self.name,
                start,
                format!("{entry} ({size} bytes) runs past the end of the zip"),
            ));
        }
        Ok(Source {
            name: format!("{}!{entry}", self.name),
            base: self.base + start,
            len: size,
            reader: self.reader,
            fetched: self.fetched,
        })
    }
}

/// `Read + Seek` over a [`Source`] for the zip reader, in 4 KiB reads: the zip's
/// directory is read in small pieces, and over HTTP each read is a request, so a
/// read must not fetch much past what the reader needs (an OTA zip's directory is a
/// few KiB).
struct Cursor<'a> {
    src: &'a Source,
    pos: u64,
    buf: Vec<u8>,
    buf_at: u64,
}

impl<'a> Cursor<'a> {
    fn new(src: &'a Source) -> Self {
        Cursor {
            src,
            pos: 0,
            buf: Vec::new(),
            buf_at: 0,
        }
    }
}

impl Read for Cursor<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos >= self.src.len || out.is_empty() {
            return Ok(0);
        }
        let in_buf = self.pos >= self.buf_at && self.pos < self.buf_at + self.buf.len() as u64;
        if !in_buf {
            let n = (self.src.len - self.pos).min(4 << 10);
            self.buf = self
                .src
                .read_vec(self.pos, n)
                .map_err(|e| io::Error::other(e.to_string()))?;
            self.buf_at = self.pos;
        }
        let from = (self.pos - self.buf_at) as usize;
        let n = out.len().min(self.buf.len() - from);
        out[..n].copy_from_slice(&self.buf[from..from + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for Cursor<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let pos = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.src.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = pos.ok_or_else(|| io::Error::other("seek before the start"))?;
        Ok(self.pos)
    }
}

/// Reconnections a read tries before it fails.
const HTTP_TRIES: u32 = 5;

/// A URL read with `Range: bytes=A-B` requests, one per read.
struct Http {
    agent: ureq::Agent,
    url: String,
    len: u64,
    fetched: std::sync::Arc<AtomicU64>,
}

impl Http {
    /// Asks for the first byte, which tells the size and that ranges are served.
    fn open(url: &str) -> Result<Http> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            // A server that trickles a byte a minute still ends each request (a
            // read is at most an operation's data).
            .timeout_global(Some(Duration::from_secs(600)))
            .http_status_as_error(false)
            .build()
            .into();
        let mut http = Http {
            agent,
            url: url.to_string(),
            len: 0,
            fetched: Default::default(),
        };
        let (total, _) = http.get(0, 0, &mut [0u8; 1])?;
        http.len = total;
        Ok(http)
    }

    /// Fetches bytes `first..=last` into `out`; returns the resource's total size.
    fn get(&self, first: u64, last: u64, out: &mut [u8]) -> Result<(u64, ())> {
        let fail = |what: String| Error::format(&self.url, first, what);
        let mut last_error = String::new();
        for attempt in 0..HTTP_TRIES {
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis(200 << attempt));
            }
            let resp = match self
                .agent
                .get(&self.url)
                .header("Range", format!("bytes={first}-{last}"))
                .call()
            {
                Ok(r) => r,
                Err(e) => {
                    last_error = format!("GET: {e}");
                    continue;
                }
            };
            let status = resp.status().as_u16();
            if status != 206 {
                // A whole-file answer (200) would be a download of everything: the
                // payload is read by ranges or not at all.
                return Err(fail(match status {
                    200 => "the server does not answer range requests; download the file \
                            and give its path"
                        .to_string(),
                    s => format!("HTTP status {s}"),
                }));
            }
            let range = resp
                .headers()
                .get("content-range")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            // "bytes FIRST-LAST/TOTAL"
            let parsed = range.strip_prefix("bytes ").and_then(|r| {
                let (span, total) = r.split_once('/')?;
                let (a, b) = span.split_once('-')?;
                Some((
                    a.parse::<u64>().ok()?,
                    b.parse::<u64>().ok()?,
                    total.parse().ok()?,
                ))
            });
            let Some((a, b, total)) = parsed else {
                return Err(fail(format!(
                    "a range answer without a usable Content-Range ({range:?})"
                )));
            };
            if a != first || b != last {
                return Err(fail(format!("asked for bytes {first}-{last}, got {a}-{b}")));
            }
            let mut body = resp.into_body().into_reader();
            match body.read_exact(out) {
                Ok(()) => {
                    self.fetched.fetch_add(out.len() as u64, Ordering::Relaxed);
                    return Ok((total, ()));
                }
                Err(e) => last_error = format!("reading the answer: {e}"),
            }
        }
        Err(fail(format!("{last_error} ({HTTP_TRIES} tries)")))
    }
}

impl ReadAt for Http {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let last = offset + buf.len() as u64 - 1;
        self.get(offset, last, buf)
            .map(|_| ())
            .map_err(|e| io::Error::other(e.to_string()))
    }
}
