//! A bundle read from an `http://` or `https://` URL as one stream that survives cut
//! connections: when a response ends early or fails, the next read asks again from the
//! first byte not yet received (`Range: bytes=N-`), so an interrupted download goes on
//! where it stopped instead of starting over. Through `ureq`.

use std::io::{self, Read};
use std::time::Duration;

/// Reconnections without progress before a read fails.
const RETRIES: u32 = 5;

/// The bytes of a URL, fetched with range requests as they are read.
pub struct RangeReader {
    agent: ureq::Agent,
    url: String,
    /// Bytes handed out so far.
    pos: u64,
    /// Size of the resource, once a response said.
    total: Option<u64>,
    body: Option<Box<dyn Read + Send>>,
    /// Reconnections since the last byte received.
    failures: u32,
    /// Whether the log said the server ignores ranges.
    warned_no_ranges: bool,
}

impl std::fmt::Debug for RangeReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangeReader")
            .field("url", &self.url)
            .field("pos", &self.pos)
            .field("total", &self.total)
            .finish()
    }
}

impl RangeReader {
    /// A reader of `url`, which is fetched on the first read.
    pub fn new(url: &str) -> RangeReader {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_connect(Some(Duration::from_secs(30)))
            // A stall, not a slow download: ureq's body timeout would cut every
            // response a minute after its headers.
            .timeout_per_read(Some(Duration::from_secs(60)))
            .build()
            .into();
        RangeReader {
            agent,
            url: url.to_string(),
            pos: 0,
            total: None,
            body: None,
            failures: 0,
            warned_no_ranges: false,
        }
    }

    /// Moves `n` bytes forward: the open response is dropped and the next read asks
    /// for the range from there.
    pub(crate) fn jump(&mut self, n: u64) -> io::Result<()> {
        let to = self
            .pos
            .checked_add(n)
            .ok_or_else(|| io::Error::other("offset overflow"))?;
        if self.total.is_some_and(|t| to > t) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("GET {}: {to} is past the end", self.url),
            ));
        }
        if n > 0 {
            self.pos = to;
            self.body = None;
        }
        Ok(())
    }

    fn connect(&mut self) -> io::Result<()> {
        let mut req = self.agent.get(&self.url);
        if self.pos > 0 {
            req = req.header("Range", format!("bytes={}-", self.pos));
        }
        let resp = req
            .call()
            .map_err(|e| io::Error::other(format!("GET {}: {e}", self.url)))?;
        let status = resp.status().as_u16();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let len: Option<u64> = header("content-length").and_then(|v| v.parse().ok());
        match status {
            200 if self.pos == 0 => self.total = len,
            200 => {
                // A server that ignores ranges (`python3 -m http.server`) sends the
                // whole file again: the bytes before ours are read and dropped, which
                // costs the download but works.
                if !self.warned_no_ranges {
                    log::warn!(
                        "{}: the server ignores range requests; downloading from the start \
                         and dropping the first {} bytes",
                        self.url,
                        self.pos
                    );
                    self.warned_no_ranges = true;
                }
                if let Some(l) = len {
                    if l <= self.pos {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("GET {}: {l} bytes, asked for byte {}", self.url, self.pos),
                        ));
                    }
                    self.total = Some(l);
                }
                let mut body = resp.into_body().into_reader();
                let dropped =
                    io::copy(&mut (&mut body).take(self.pos), &mut io::sink()).map_err(|e| {
                        io::Error::new(
                            e.kind(),
                            format!(
                                "GET {}: pass over the first {} bytes: {e}",
                                self.url, self.pos
                            ),
                        )
                    })?;
                if dropped != self.pos {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "GET {}: the response ended at byte {dropped}, before byte {}",
                            self.url, self.pos
                        ),
                    ));
                }
                self.body = Some(Box::new(body));
                return Ok(());
            }
            206 => {
                // "bytes START-END/TOTAL": the range must start where we are.
                let range = header("content-range").unwrap_or_default();
                let start = range
                    .strip_prefix("bytes ")
                    .and_then(|r| r.split('-').next())
                    .and_then(|s| s.parse::<u64>().ok());
                if start != Some(self.pos) {
                    return Err(io::Error::other(format!(
                        "GET {}: asked for bytes from {}, got range {range:?}",
                        self.url, self.pos
                    )));
                }
                if let Some(t) = range.rsplit('/').next().and_then(|t| t.parse().ok()) {
                    self.total = Some(t);
                }
            }
            s => {
                return Err(io::Error::other(format!(
                    "GET {} from byte {}: HTTP status {s}",
                    self.url, self.pos
                )));
            }
        }
        self.body = Some(Box::new(resp.into_body().into_reader()));
        Ok(())
    }
}

impl Read for RangeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() || self.total.is_some_and(|t| self.pos >= t) {
            return Ok(0);
        }
        loop {
            if self.body.is_none()
                && let Err(e) = self.connect()
            {
                self.failures += 1;
                if self.failures > RETRIES {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(200 << self.failures.min(4)));
                continue;
            }
            let Some(body) = self.body.as_mut() else {
                continue;
            };
            match body.read(buf) {
                Ok(0) if self.total.is_none_or(|t| self.pos >= t) => return Ok(0),
                Ok(n) if n > 0 => {
                    self.pos += n as u64;
                    self.failures = 0;
                    return Ok(n);
                }
                // Ended early, or failed: ask again from here.
                Ok(_) | Err(_) => {
                    self.body = None;
                    self.failures += 1;
                    if self.failures > RETRIES {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!(
                                "GET {}: the connection ended at byte {} {RETRIES} times",
                                self.url, self.pos
                            ),
                        ));
                    }
                }
            }
        }
    }
}
