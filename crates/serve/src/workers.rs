//! A pool of request threads fed from one bounded channel.
//!
//! Transport threads only parse a request and hand it over, then go back to the kernel
//! or socket for the next one, so many requests are in flight at once (docs/05-serving.md:
//! the synchronous one-pread-per-reader design plateaued at 5–10 k IOPS). Work here is
//! mostly blocking I/O of uneven duration, so a shared queue (any idle thread takes the
//! next request) beats per-thread queues; CPU-bound decompression has its own per-CPU
//! pool inside the engine. The bounded channel preallocates its slots, so submitting
//! does not allocate, and it applies back-pressure when the workers fall behind.
//! Each thread owns a reusable page-aligned buffer.

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Sender, bounded};
use engine::AlignedBuf;

/// Request threads running `handler(buffer, job)` for each submitted job.
pub struct Workers<J: Send + 'static> {
    tx: Option<Sender<J>>,
    handles: Vec<JoinHandle<()>>,
}

impl<J: Send + 'static> Workers<J> {
    pub fn spawn<F>(
        name: &str,
        threads: usize,
        buf_size: usize,
        handler: F,
    ) -> io::Result<Workers<J>>
    where
        F: Fn(&mut AlignedBuf, J) + Send + Sync + 'static,
    {
        let threads = threads.max(1);
        let (tx, rx) = bounded::<J>(threads * 4);
        let handler = Arc::new(handler);
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let rx = rx.clone();
            let handler = handler.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || {
                        let mut buf = AlignedBuf::new(buf_size);
                        while let Ok(job) = rx.recv() {
                            handler(&mut buf, job);
                        }
                    })?,
            );
        }
        Ok(Workers {
            tx: Some(tx),
            handles,
        })
    }

    /// Queues a job; blocks while the queue is full. Gives the job back if the pool is
    /// shutting down.
    pub fn submit(&self, job: J) -> std::result::Result<(), J> {
        match &self.tx {
            Some(tx) => tx.send(job).map_err(|e| e.into_inner()),
            None => Err(job),
        }
    }
}

impl<J: Send + 'static> Drop for Workers<J> {
    fn drop(&mut self) {
        self.tx = None;
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
