//! The session driver: one connection's task, the same for every protocol.
//!
//! A protocol session is an [`Adapter`] (the sans-IO protocol connection,
//! the engine client and the protocol's own state); [`run`] is the socket
//! loop around it. Each turn:
//!
//! 1. **read** is what the last wait brought in; the alarms are looked at
//!    (one atomic load) and the adapter sends what became durable
//!    ([`Adapter::begin_turn`]);
//! 2. **handle**: every complete event in the input is interpreted, one
//!    cooperative budget unit each (one read can hold tens of thousands of
//!    frames: the runtime gets to serve other connections in between);
//!    nothing while the flow is blocked (what was read waits in the buffer
//!    with the unread socket);
//! 3. **commit**: the batch is closed ([`Adapter::end_batch`]: one engine
//!    commit, one store barrier for every answer that waits for the store,
//!    see [`durable`]), and the flow's end of batch (rates, store share);
//! 4. **deliver**: deliveries and notices from the engine are encoded
//!    straight into the output, up to [`DELIVERY_HIGH_WATER`];
//! 5. **write**: one clock read serves every timer of the turn, then what
//!    the socket takes now is written, without waiting, and the turn's
//!    counters are flushed;
//! 6. **wait** for whichever comes first: input, room to write, the
//!    adapter's wake-ups (the engine's outbox, which also carries durable
//!    answers; alarms; its own), the timer, shutdown.
//!
//! Invariants, for every adapter:
//! * Nothing in a turn waits but the socket wait of step 6 and an event the
//!   adapter hands back as [`Adapter::Await`] (a login): replies that must
//!   wait for the store are queued with a [`durable::Ticket`] and sent by a
//!   later turn; deliveries, heartbeats and shutdown go on meanwhile.
//! * Reads stop while the output holds [`OUT_HIGH_WATER`] bytes, while the
//!   flow is blocked or paused, and while the adapter refuses input; a
//!   client that does not read is never read from without bound.
//! * Deliveries stop at [`DELIVERY_HIGH_WATER`]. Deliveries the adapter
//!   took from the engine and left for lack of room have no wake-up of their
//!   own (they hold their consumer's credit; a no-ack consumer sends
//!   nothing): when [`Adapter::deliver`] says so, the loop comes back by
//!   itself once a write took the buffer below the mark.
//! * One timer serves every deadline; it is re-armed only for an earlier
//!   one (deadlines move later with every read and write; firing early is
//!   harmless, as each check looks at the time again), so a busy loop does
//!   not touch the timer wheel per batch.
//! * Per turn the driver itself allocates nothing, takes no lock and
//!   makes one clock read; per batch of events the adapter asks for at
//!   most one store barrier.
//!
//! * [`io`]: the byte streams (TCP, or the halves of a TLS stream or a
//!   WebSocket's pipe).
//! * [`flow`]: alarms, the tenant's gate, blocking.
//! * [`durable`]: answers that wait for the store.

pub mod durable;
pub mod flow;
pub mod io;

use self::io::{Buffers, ReadSide, WriteSide};
use bytes::BytesMut;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio::sync::watch;

pub use self::flow::Flow;

/// Stop reading from a client while this much output is unwritten.
pub const OUT_HIGH_WATER: usize = 4 << 20;
/// Stop encoding deliveries while this much output is unwritten.
pub const DELIVERY_HIGH_WATER: usize = 1 << 20;
/// How long a finished connection may take to flush what a TLS stream
/// still buffers.
const FINAL_FLUSH: Duration = Duration::from_secs(1);
/// How long a connection whose close handshake is done keeps reading (and
/// dropping) what the client still sends, waiting for it to close the
/// socket (see [`Adapter::lingers`]).
const CLOSE_LINGER: Duration = Duration::from_secs(2);
/// Bytes read at a time from a connection that is being taken over.
const LAST_READ: usize = 512;

/// What an adapter's wake-up asks of the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Woken {
    /// A turn as usual.
    Turn,
    /// Read what the socket holds now (without waiting), hand it to
    /// [`Adapter::last_input`], then a turn: the connection is being taken
    /// over, and what its client sent before it went still counts.
    LastInput,
}

/// A protocol session as the driver runs it. Everything here is called
/// from the connection's task; nothing may wait but [`Adapter::complete`]
/// and [`Adapter::wait`].
pub trait Adapter: Send {
    /// One decoded input event.
    type Event: Send;
    /// An event whose handling must wait (a login: the password check runs
    /// off the runtime's workers).
    type Await: Send;
    /// What woke the adapter.
    type Wake: Send;
    /// How its read buffer is sized.
    const BUFFERS: Buffers;

    /// The output buffer (the protocol connection's).
    fn out(&mut self) -> &mut BytesMut;
    /// Its alarms and gate.
    fn flow(&mut self) -> &mut Flow;
    /// The protocol connection is done: once its output is written, the
    /// task ends.
    fn is_finished(&self) -> bool;

    /// Start of a turn: answers that became durable go out, a close asked
    /// for by an administrator takes effect.
    fn begin_turn(&mut self);
    /// The next complete event in `input` (None when there is none, or
    /// while the adapter interprets nothing: a refused login's delay).
    fn poll_event(&mut self, input: &mut BytesMut) -> Option<Self::Event>;
    /// Acts on an event without waiting; an event that must wait is handed
    /// back, and the driver awaits [`Self::complete`] (boxed: the task's
    /// future does not carry its state).
    fn handle_event(&mut self, ev: Self::Event) -> Option<Self::Await>;
    /// Handles an event [`Self::handle_event`] handed back.
    fn complete(&mut self, w: Self::Await) -> impl Future<Output = ()> + Send;
    /// Closes the batch of events: engine commit, the store barrier its
    /// answers wait for, the answers that can go now, the flow's end of
    /// batch.
    fn end_batch(&mut self);
    /// Encodes deliveries (and notices) into the output until
    /// [`DELIVERY_HIGH_WATER`]; true when it stopped there with deliveries
    /// in hand that nothing else will wake it for.
    fn deliver(&mut self) -> bool;
    /// Once per turn, with the turn's clock: bytes were read since the
    /// last (`read`), the timer fired (`fired`).
    fn on_clock(&mut self, now: Instant, read: bool, fired: bool);
    /// Output must not leave yet (it waits for a durable record).
    fn output_held(&self) -> bool {
        false
    }
    /// `n` bytes were read.
    fn on_read(&mut self, n: usize);
    /// Once per turn, after its write: `n` bytes of output were written
    /// since the last call (0 if none). Where the turn's counters are
    /// flushed.
    fn wrote(&mut self, n: usize, now: Instant);
    /// The client closed the socket.
    fn on_eof(&mut self);
    /// Before the wait: whether the adapter takes more input now (it may
    /// block the flow here: AMQP's partly received message during an
    /// alarm).
    fn wants_input(&mut self) -> bool;
    /// Before the wait: its earliest deadline, told whether the socket is
    /// read in this wait and how many bytes wait in the input.
    fn deadline(&mut self, now: Instant, reading: bool, buffered: usize) -> Option<Instant>;
    /// The largest packet the adapter takes now (an elastic read buffer
    /// grows no larger before login).
    fn input_limit(&self) -> usize {
        usize::MAX
    }
    /// The output buffer, and a future resolving when something other than
    /// the socket needs a turn: the engine's outbox (which also wakes for
    /// durable answers), the flow ([`Flow::changed`]), the adapter's own
    /// wake-ups. The future must be cancel safe.
    fn wait(&mut self) -> (&mut BytesMut, impl Future<Output = Self::Wake> + Send + '_);
    /// Acts on a wake-up.
    fn woken(&mut self, w: Self::Wake) -> Woken;
    /// What the socket held when [`Woken::LastInput`] was asked for.
    fn last_input(&mut self, _input: &mut BytesMut) {}
    /// The broker shuts down.
    fn on_shutdown(&mut self);
    /// Once finished: read and drop what the client still sends until it
    /// closes the socket, for a bounded time (AMQP after connection.close:
    /// closing a socket that holds unread input makes the kernel reset the
    /// connection, and the reset can overtake the close-ok).
    fn lingers(&self) -> bool {
        false
    }
}

/// Runs `a` over `rd` and `wr` until its connection finishes, the client
/// goes, or an I/O error ends it.
pub async fn run<A: Adapter, R: ReadSide, W: WriteSide>(
    a: &mut A,
    mut rd: R,
    mut wr: W,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut input = match A::BUFFERS {
        Buffers::Fixed(size) => BytesMut::with_capacity(size),
        Buffers::Elastic { .. } => BytesMut::new(),
    };
    // Bytes of the last read (an elastic buffer shrinks after a burst).
    let mut last_read = 0;
    let timer = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(timer);
    let mut armed: Option<Instant> = None;
    // The timer fired: its checks run at the next clock read.
    let mut fired = false;
    // Bytes were read: reported to the adapter at the next clock read.
    let mut got_input = false;
    let mut eof = false;
    // The last `deliver` stopped at the high-water mark with deliveries in
    // hand (see the invariants above).
    let mut wait_room = false;
    // Written by the wait: reported with the next turn's clock.
    let mut written = 0;
    loop {
        // 1. What changed while we waited.
        a.flow().refresh_if_changed();
        a.begin_turn();
        // 2. Every complete event we have.
        while !a.flow().blocked {
            let Some(ev) = a.poll_event(&mut input) else {
                break;
            };
            if let Some(w) = a.handle_event(ev) {
                Box::pin(a.complete(w)).await;
            }
            tokio::task::consume_budget().await;
        }
        // 3. Commit.
        a.end_batch();
        // 4. Deliveries.
        if a.out().len() < DELIVERY_HIGH_WATER {
            wait_room = a.deliver();
        }
        // 5. Timers, then write what we can without waiting.
        let now = Instant::now();
        if fired {
            a.flow().on_timer(now);
        }
        a.on_clock(
            now,
            std::mem::take(&mut got_input),
            std::mem::take(&mut fired),
        );
        if !a.output_held() && !a.out().is_empty() {
            written += wr.write_some(a.out())?;
        }
        a.wrote(std::mem::take(&mut written), now);
        if (a.is_finished() && a.out().is_empty()) || eof {
            if wr.has_unflushed() {
                // A TLS record (a close-ok) still buffered: one bounded
                // last flush.
                let _ = tokio::time::timeout(FINAL_FLUSH, wr.write(None)).await;
            }
            if !eof && a.lingers() {
                linger(&mut rd, &mut input).await;
            }
            return Ok(());
        }
        // 6. Wait.
        let want_read = a.wants_input()
            && a.out().len() < OUT_HIGH_WATER
            && !a.is_finished()
            && a.flow().may_read();
        let deadline = a.deadline(now, want_read, input.len());
        if let Some(at) = deadline.into_iter().chain(a.flow().deadline()).min() {
            if armed.is_none_or(|t| at < t) {
                timer.as_mut().reset(tokio::time::Instant::from_std(at));
                armed = Some(at);
            }
        }
        let held = a.output_held();
        let want_write = (!held && !a.out().is_empty()) || wr.has_unflushed();
        // Deliveries left behind by the high-water mark, and the write
        // above took the buffer below it (a fast reader can take all of
        // it at once): come back for them, nothing else would wake us.
        let room_for_deliveries = wait_room && a.out().len() < DELIVERY_HIGH_WATER;
        let limit = a.input_limit();
        io::prepare(A::BUFFERS, &mut input, a.out(), last_read, limit);
        let (out, wake) = a.wait();
        // Held output is not written: a flush only.
        let out = (!held).then_some(out);
        tokio::select! {
            r = io::read_some(&mut rd, &mut input, A::BUFFERS), if want_read => match r {
                Ok(0) => {
                    eof = true;
                    a.on_eof();
                }
                Ok(n) => {
                    got_input = true;
                    last_read = n;
                    a.on_read(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            },
            r = wr.write(out), if want_write => written += r?,
            w = wake => {
                if a.woken(w) == Woken::LastInput {
                    take_last_input(a, &mut rd, &mut input);
                }
            }
            // Ready at once while the task's cooperative budget lasts
            // (then it yields, as a ready socket would make it): a reader
            // that takes everything cannot keep this worker. Among ready
            // branches `select!` picks at random, so reads still get
            // their turn.
            () = tokio::task::consume_budget(), if room_for_deliveries => {}
            () = &mut timer, if armed.is_some() => {
                armed = None;
                fired = true;
            }
            r = shutdown.changed() => {
                if r.is_err() || *shutdown.borrow() {
                    a.on_shutdown();
                }
            }
        }
    }
}

/// Reads what the socket holds now, without waiting, and hands it to the
/// adapter ([`Woken::LastInput`]).
fn take_last_input<A: Adapter, R: ReadSide>(a: &mut A, rd: &mut R, input: &mut BytesMut) {
    let mut read = false;
    loop {
        input.reserve(LAST_READ);
        match rd.read_now(input) {
            Ok(n) if n > 0 => {
                read = true;
                a.on_read(n);
            }
            _ => break,
        }
    }
    if read {
        a.on_clock(Instant::now(), true, false);
    }
    a.last_input(input);
}

/// Reads and drops what the client still sends until it closes the
/// socket, for at most [`CLOSE_LINGER`] (see [`Adapter::lingers`]).
/// RabbitMQ likewise reads until the client closes.
async fn linger<R: ReadSide>(rd: &mut R, input: &mut BytesMut) {
    let drain = async {
        loop {
            input.clear();
            input.reserve(LAST_READ);
            let r = match rd.ready().await {
                Ok(()) => rd.read(input).await,
                Err(e) => Err(e),
            };
            match r {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
    };
    let _ = tokio::time::timeout(CLOSE_LINGER, drain).await;
}
