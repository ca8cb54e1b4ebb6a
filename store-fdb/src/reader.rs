//! Asynchronous reads without a runtime: a few reader threads run the
//! seam's blocking reads and complete a future the caller awaits on its own
//! runtime, so the cold path of a deep queue never blocks a runtime worker.

use parking_lot::Mutex;
use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed pool of reader threads.
pub struct Reader {
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
}

impl Reader {
    /// Starts `threads` readers.
    pub fn new(threads: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("weir-fdb-read-{i}"))
                .spawn(move || loop {
                    let job = rx.lock().recv();
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "starting a FoundationDB reader thread");
            }
        }
        Reader {
            jobs: Mutex::new(Some(tx)),
        }
    }

    /// Runs `f` on a reader thread; the future completes with its result.
    /// After [`Reader::stop`] (or if no thread runs) `f` runs on the
    /// caller's thread.
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Pin<Box<dyn Future<Output = T> + Send + 'static>> {
        let slot = Arc::new(Mutex::new(Slot::<T> {
            value: None,
            waker: None,
        }));
        let fill = slot.clone();
        let job: Job = Box::new(move || {
            let v = f();
            let waker = {
                let mut s = fill.lock();
                s.value = Some(v);
                s.waker.take()
            };
            if let Some(w) = waker {
                w.wake();
            }
        });
        let unsent = match &*self.jobs.lock() {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            job();
        }
        Box::pin(Pending { slot })
    }

    /// Lets the threads end once the queued reads are done.
    pub fn stop(&self) {
        self.jobs.lock().take();
    }
}

struct Slot<T> {
    value: Option<T>,
    waker: Option<Waker>,
}

struct Pending<T> {
    slot: Arc<Mutex<Slot<T>>>,
}

impl<T> Future for Pending<T> {
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut s = self.slot.lock();
        match s.value.take() {
            Some(v) => Poll::Ready(v),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}
