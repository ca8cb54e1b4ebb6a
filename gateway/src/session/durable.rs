//! Answers that wait for durability: one mechanism for every door.
//!
//! A publisher confirm, a declare-ok, a PUBACK/PUBREC/PUBCOMP, a SUBACK of
//! a persistent session, a tx.commit-ok, a CONNACK that must follow its
//! session queue's record, and an HTTP answer all say "what you asked for
//! is on disk". Each is given a [`Ticket`] by the [`Durability`] of its
//! session (or request) when the change is made, and goes out once
//! [`Durability::status`] says the ticket is [`Status::Durable`].
//!
//! How tickets complete is this module's business alone: a ticket is the
//! number of the client's durability barrier (the engine waits for the
//! store's tickets of the client's appends, and of the metadata and state
//! changes made so far) that the session asks for when it closes the batch
//! that handed the ticket out.
//! Every answer of a batch shares that one barrier, whatever the number of
//! channels, confirms and declares in it; the barrier's waiter moves two
//! counters and wakes the session through its engine handle (which the
//! session waits on anyway), so there is no channel, no oneshot and no
//! allocation per answer. An engine change that hands back its own
//! [`DurableWait`] (declares, binds, deletes) is covered by the same
//! barrier, which covers the engine's metadata and state changes made
//! before it.
//!
//! Invariants: tickets of one [`Durability`] are handed out in increasing
//! order; a ticket is durable once a barrier at or after it completed
//! (a barrier covers every earlier append); it has failed once a barrier at
//! or after it failed and none at or after it completed (the store could
//! not make that prefix durable: the answer says so, or the connection
//! closes). Every ticket handed out must be followed by
//! [`Durability::end_batch`] before the session waits.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::{StoreError, Waiter};
use weir_engine::{Client, DurableWait, Engine};

/// What one answer waits for. [`Ticket::NONE`] waits for nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(u64);

impl Ticket {
    /// Nothing to wait for: always durable.
    pub const NONE: Ticket = Ticket(0);

    /// Whether it waits for nothing.
    pub fn is_none(self) -> bool {
        self.0 == 0
    }
}

/// Where a ticket stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Not yet known.
    Pending,
    /// What it covers is durable.
    Durable,
    /// The store could not make it durable.
    Failed,
}

/// The store could not make a change durable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the store could not make the change durable")]
pub struct NotDurable;

/// Completed and failed barriers, moved by the store's waiters.
#[derive(Default)]
struct Progress {
    /// The highest barrier that completed.
    done: AtomicU64,
    /// The highest barrier that failed.
    failed: AtomicU64,
}

/// The answers of one session (or one request) that wait for the store:
/// hands out tickets and learns when they complete.
#[derive(Default)]
pub struct Durability {
    /// Allocated with the first barrier: a session that never waits for
    /// the store (an idle device, a transient consumer) carries none.
    progress: Option<Arc<Progress>>,
    /// Barriers asked for (the last one's number).
    requested: u64,
    /// A ticket of the next barrier was handed out: the batch's end asks
    /// for it.
    open: bool,
}

impl Durability {
    /// A ticket for what this batch appended (publishes, session state, a
    /// retained message): durable once the barrier asked for at the end of
    /// the batch completes.
    pub fn ticket(&mut self) -> Ticket {
        self.open = true;
        Ticket(self.requested + 1)
    }

    /// A ticket for an engine change that reported its wait (a declare, a
    /// bind, a delete): [`Ticket::NONE`] when it had nothing to make
    /// durable. The engine's own wait is not needed: the batch's barrier,
    /// appended after the change, covers it.
    pub fn after(&mut self, wait: Option<DurableWait>) -> Ticket {
        match wait {
            Some(_) => self.ticket(),
            None => Ticket::NONE,
        }
    }

    /// The last ticket handed out (or [`Ticket::NONE`]): an answer that
    /// must not overtake earlier ones waits for it.
    pub fn latest(&self) -> Ticket {
        Ticket(self.requested + u64::from(self.open))
    }

    /// Closes the batch: one store barrier for every ticket handed out
    /// since the last, whose completion wakes `client`'s task. A barrier
    /// the store refuses fails its tickets (seen through
    /// [`Self::status`]); the error is returned for the log.
    pub fn end_batch(&mut self, client: Option<&mut Client>) -> Result<(), StoreError> {
        if !self.open {
            return Ok(());
        }
        let Some(client) = client else {
            return self.request(|_| Err(StoreError::Closed), || {});
        };
        let handle = client.handle().clone();
        self.request(|w| client.durability_barrier(w), move || handle.wake())
    }

    /// Asks `barrier` for the store barrier of the open tickets; its
    /// waiter records the outcome and calls `wake`.
    fn request(
        &mut self,
        barrier: impl FnOnce(Waiter) -> Result<(), StoreError>,
        wake: impl FnOnce() + Send + 'static,
    ) -> Result<(), StoreError> {
        self.open = false;
        self.requested += 1;
        let n = self.requested;
        let progress = self.progress.get_or_insert_with(Default::default).clone();
        let waiter: Waiter = {
            let progress = progress.clone();
            Box::new(move |r| {
                let counter = if r.is_ok() {
                    &progress.done
                } else {
                    &progress.failed
                };
                counter.fetch_max(n, Ordering::AcqRel);
                wake();
            })
        };
        let r = barrier(waiter);
        if r.is_err() {
            progress.failed.fetch_max(n, Ordering::AcqRel);
        }
        r
    }

    /// Where `t` stands: two atomic loads at most.
    pub fn status(&self, t: Ticket) -> Status {
        if t.is_none() {
            return Status::Durable;
        }
        let Some(p) = self.progress.as_ref() else {
            return Status::Pending;
        };
        // `done` first: a failure the store reported before a later
        // success is then seen with it, and the success wins (the later
        // barrier covers the earlier appends).
        if p.done.load(Ordering::Acquire) >= t.0 {
            Status::Durable
        } else if p.failed.load(Ordering::Acquire) >= t.0 {
            Status::Failed
        } else {
            Status::Pending
        }
    }

    /// Whether `t` is durable.
    pub fn is_durable(&self, t: Ticket) -> bool {
        self.status(t) == Status::Durable
    }
}

/// Waits until an engine change is durable: the answer of a request (the
/// HTTP API, startup), which has no session loop. The change's own wait
/// resolves on the store's ticket of its append.
pub async fn settled(_engine: &Engine, wait: Option<DurableWait>) -> Result<(), NotDurable> {
    match wait {
        None => Ok(()),
        Some(w) => match w.await {
            Ok(Ok(())) => Ok(()),
            _ => Err(NotDurable),
        },
    }
}

/// The answer of a request that published through `client` (the HTTP
/// API's publish): resolves once everything `client` appended so far is
/// durable. The barrier is asked for now; the future holds no borrow.
pub fn appended(
    client: &mut Client,
) -> impl Future<Output = Result<(), NotDurable>> + Send + 'static {
    let mut d = Durability::default();
    let t = d.ticket();
    let woken = Arc::new(tokio::sync::Notify::new());
    let wake = woken.clone();
    // A refused barrier is a failed ticket.
    let _ = d.request(|w| client.durability_barrier(w), move || wake.notify_one());
    request_wait(d, t, woken)
}

/// Waits for `d`'s ticket `t`, whose barrier's waiter notifies `woken`.
async fn request_wait(
    d: Durability,
    t: Ticket,
    woken: Arc<tokio::sync::Notify>,
) -> Result<(), NotDurable> {
    loop {
        match d.status(t) {
            Status::Durable => return Ok(()),
            Status::Failed => return Err(NotDurable),
            // `notify_one` keeps a permit: a completion between the look
            // and the wait is not lost.
            Status::Pending => woken.notified().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Barriers asked for and not yet answered, and the wake-ups seen.
    #[derive(Default)]
    struct FakeStore {
        waiters: Mutex<Vec<Waiter>>,
        wakes: Arc<AtomicU64>,
    }

    impl FakeStore {
        fn request(&self, d: &mut Durability) {
            let wakes = self.wakes.clone();
            d.request(
                |w| {
                    self.waiters.lock().expect("lock").push(w);
                    Ok(())
                },
                move || {
                    wakes.fetch_add(1, Ordering::Relaxed);
                },
            )
            .expect("accepted");
        }

        /// Answers the oldest barrier still waiting.
        fn answer(&self, ok: bool) {
            let w = self.waiters.lock().expect("lock").remove(0);
            w(if ok { Ok(()) } else { Err(StoreError::Closed) });
        }
    }

    #[test]
    fn tickets_of_one_batch_share_one_barrier_and_complete_in_order() {
        let store = FakeStore::default();
        let mut d = Durability::default();
        let a = d.ticket();
        let b = d.ticket();
        assert_eq!(a, b, "one batch, one barrier");
        assert_eq!(d.latest(), a);
        store.request(&mut d);
        let c = d.ticket();
        assert!(c > a);
        store.request(&mut d);
        assert_eq!(store.waiters.lock().expect("lock").len(), 2);
        assert_eq!(d.status(a), Status::Pending);
        store.answer(true);
        assert_eq!(d.status(a), Status::Durable);
        assert_eq!(d.status(c), Status::Pending);
        store.answer(true);
        assert_eq!(d.status(c), Status::Durable);
        assert_eq!(
            store.wakes.load(Ordering::Relaxed),
            2,
            "each barrier wakes once"
        );
        assert_eq!(d.status(Ticket::NONE), Status::Durable);
    }

    #[test]
    fn a_failed_barrier_fails_its_tickets_and_a_later_success_covers_them() {
        let store = FakeStore::default();
        let mut d = Durability::default();
        let a = d.ticket();
        store.request(&mut d);
        let b = d.ticket();
        store.request(&mut d);
        store.answer(false);
        assert_eq!(d.status(a), Status::Failed);
        assert_eq!(d.status(b), Status::Pending, "its own barrier is still out");
        store.answer(true);
        // The later barrier covers every earlier append: what the failed
        // one did not make durable, it did.
        assert_eq!(d.status(a), Status::Durable);
        assert_eq!(d.status(b), Status::Durable);
    }

    #[test]
    fn a_refused_barrier_fails_its_tickets_at_once() {
        let mut d = Durability::default();
        let a = d.ticket();
        assert!(d.request(|_| Err(StoreError::Closed), || {}).is_err());
        assert_eq!(d.status(a), Status::Failed);
        // Without a client (the store is gone) the same.
        let b = d.ticket();
        assert!(d.end_batch(None).is_err());
        assert_eq!(d.status(b), Status::Failed);
    }

    #[test]
    fn a_batch_without_tickets_asks_for_no_barrier() {
        let mut d = Durability::default();
        assert!(d.end_batch(None).is_ok());
        assert_eq!(d.latest(), Ticket::NONE);
        assert!(d.progress.is_none(), "nothing allocated until a barrier");
        assert_eq!(d.after(None), Ticket::NONE);
    }
}
