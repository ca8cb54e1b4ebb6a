//! Client operations the attacks are made of, over the bench's lean [`Conn`].

use std::time::{Duration, Instant};

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, connection, exchange, queue, AMQPClass};
use amq_protocol::types::FieldTable;

use crate::conn::{self, err, Conn, Context, Result, CHANNEL};

/// `queue.declare` (not passive); returns the message count.
pub async fn declare_queue(c: &mut Conn, name: &str, durable: bool) -> Result<u32> {
    declare(c, name, false, durable).await
}

/// Passive `queue.declare`: the queue's message count.
pub async fn count(c: &mut Conn, name: &str) -> Result<u32> {
    declare(c, name, true, false).await
}

async fn declare(c: &mut Conn, name: &str, passive: bool, durable: bool) -> Result<u32> {
    let reply = c
        .call(queue_declare(name, passive, durable))
        .await
        .ctx(format!("queue.declare {name}"))?;
    match reply {
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => Ok(ok.message_count),
        other => err(format!("expected queue.declare-ok, got {other:?}")),
    }
}

/// The `queue.declare` method (not exclusive, not auto-delete, no arguments).
fn queue_declare(name: &str, passive: bool, durable: bool) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: name.into(),
        passive,
        durable,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: FieldTable::default(),
    }))
}

/// `exchange.declare` of `kind` (topic, fanout, direct), not durable.
pub async fn declare_exchange(c: &mut Conn, name: &str, kind: &str) -> Result<()> {
    let reply = c
        .call(AMQPClass::Exchange(exchange::AMQPMethod::Declare(
            exchange::Declare {
                exchange: name.into(),
                kind: kind.into(),
                passive: false,
                durable: false,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )))
        .await
        .ctx(format!("exchange.declare {name}"))?;
    match reply {
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)) => Ok(()),
        other => err(format!("expected exchange.declare-ok, got {other:?}")),
    }
}

/// The `queue.bind` method (the caller pushes it, possibly thousands at once).
pub fn bind_method(queue_name: &str, exchange_name: &str, key: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
        queue: queue_name.into(),
        exchange: exchange_name.into(),
        routing_key: key.into(),
        nowait: false,
        arguments: FieldTable::default(),
    }))
}

/// `queue.declare` method, non-durable (for pipelined declares).
pub fn declare_method(name: &str) -> AMQPClass {
    queue_declare(name, false, false)
}

/// `queue.purge`: messages purged.
pub async fn purge(c: &mut Conn, name: &str) -> Result<u32> {
    match c
        .call(AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: name.into(),
            nowait: false,
        })))
        .await
        .ctx("queue.purge")?
    {
        AMQPClass::Queue(queue::AMQPMethod::PurgeOk(ok)) => Ok(ok.message_count),
        other => err(format!("expected purge-ok, got {other:?}")),
    }
}

/// `queue.delete`: messages deleted.
pub async fn delete(c: &mut Conn, name: &str) -> Result<u32> {
    match c
        .call(AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: name.into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        })))
        .await
        .ctx("queue.delete")?
    {
        AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok)) => Ok(ok.message_count),
        other => err(format!("expected delete-ok, got {other:?}")),
    }
}

/// `basic.qos` with `prefetch` (0 = unlimited).
pub async fn qos(c: &mut Conn, prefetch: u16) -> Result<()> {
    match c
        .call(AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: prefetch,
            global: false,
        })))
        .await
        .ctx("basic.qos")?
    {
        AMQPClass::Basic(basic::AMQPMethod::QosOk(_)) => Ok(()),
        other => err(format!("expected basic.qos-ok, got {other:?}")),
    }
}

/// `basic.get` then `basic.ack` of what it got: true if a message was fetched and acked (the ack
/// is confirmed by a passive declare after it, since ack has no reply).
pub async fn get_and_ack(c: &mut Conn, name: &str) -> Result<bool> {
    c.push_method(
        CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: name.into(),
            no_ack: false,
        })),
    )?;
    c.flush().await?;
    let tag = loop {
        match c.recv_frame().await? {
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::GetOk(ok))) => {
                break Some(ok.delivery_tag)
            }
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_))) => break None,
            f => close_err(&f)?,
        }
    };
    let Some(tag) = tag else { return Ok(false) };
    c.push_method(
        CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple: false,
        })),
    )?;
    // A passive declare after the ack: its reply proves the ack was processed. The GetOk's content
    // frames arrive first; recv_method would reject them, so frames are read by hand.
    c.push_method(CHANNEL, queue_declare(name, true, false))?;
    c.flush().await?;
    loop {
        match c.recv_frame().await? {
            AMQPFrame::Header(..) | AMQPFrame::Body(..) => {}
            AMQPFrame::Method(_, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))) => {
                return Ok(true)
            }
            f => close_err(&f)?,
        }
    }
}

/// `Err` for a close from the server (connection or channel), with its reply code.
fn close_err(f: &AMQPFrame) -> Result<()> {
    match f {
        AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(cl))) => {
            err(format!("connection closed: {}", cl.reply_code))
        }
        AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(cl))) => {
            err(format!("channel closed: {}", cl.reply_code))
        }
        _ => Ok(()),
    }
}

/// The frames of one publish, encoded once and copied per message.
pub fn encode_publish(
    frame_max: u32,
    exchange_name: &str,
    routing_key: &str,
    size: usize,
    persistent: bool,
) -> Result<Vec<u8>> {
    Ok(conn::encode_publish(frame_max, exchange_name, routing_key, size, persistent)?.0)
}

/// How a run of confirmed publishes ended.
#[derive(Debug, Default)]
pub struct PubOutcome {
    /// Messages written (or queued for writing).
    pub sent: u64,
    /// Confirmed with basic.ack.
    pub acked: u64,
    /// Refused with basic.nack.
    pub nacked: u64,
    /// connection.blocked seen.
    pub blocked: bool,
    /// connection.unblocked seen.
    pub unblocked: bool,
    /// Reply code of a connection.close or channel.close from the server.
    pub closed: Option<u16>,
    /// Socket closed (or failed) without a close method.
    pub eof: bool,
    /// Stopped because nothing was confirmed for the stall limit.
    pub stalled: bool,
    /// Stopped by the deadline.
    pub timed_out: bool,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl PubOutcome {
    /// `sent=… confirmed=… nacked=… blocked=… [closed=…]` tokens.
    pub fn tokens(&self) -> String {
        let mut s = format!(
            "sent={} confirmed={} nacked={} blocked={}",
            self.sent,
            self.acked,
            self.nacked,
            if self.blocked { "seen" } else { "no" }
        );
        if self.unblocked {
            s.push_str(" unblocked=seen");
        }
        if let Some(code) = self.closed {
            s.push_str(&format!(" closed={code}"));
        }
        if self.eof {
            s.push_str(" eof=yes");
        }
        if self.stalled {
            s.push_str(" stalled=yes");
        }
        if self.timed_out {
            s.push_str(" timed_out=yes");
        }
        s
    }
}

/// Per-tag confirm state, so `multiple` acks and out-of-order single acks count exactly once.
struct Tags {
    /// 0 = pending, 1 = acked, 2 = nacked; index = delivery tag - 1.
    state: Vec<u8>,
    /// Every tag below this is settled.
    low: usize,
}

impl Tags {
    fn settle(&mut self, tag: u64, multiple: bool, value: u8, out: &mut PubOutcome) {
        // A tag beyond what was sent (a confused server, or tags of an earlier run on the channel)
        // settles nothing that was not sent.
        let tag = (tag as usize).min(out.sent as usize);
        let from = if multiple {
            self.low
        } else {
            tag.saturating_sub(1)
        };
        for t in from..tag.min(self.state.len()) {
            if self.state[t] == 0 {
                self.state[t] = value;
                if value == 1 {
                    out.acked += 1;
                } else {
                    out.nacked += 1;
                }
            }
        }
        while self.low < self.state.len() && self.state[self.low] != 0 {
            self.low += 1;
        }
    }
}

/// Publish `n` copies of `frames` (each copy holding `k` publishes) on a channel in confirm mode,
/// keeping about `window` publishes unconfirmed, until all are settled, the server closes,
/// `deadline` passes or nothing settles for `stall`. Never blocks on a server that stopped reading:
/// it keeps reading (to see connection.blocked) meanwhile. `sent` counts publishes.
pub async fn publish_confirmed(
    c: &mut Conn,
    frames: &[u8],
    k: u64,
    n: u64,
    window: u64,
    deadline: Instant,
    stall: Duration,
) -> PubOutcome {
    let n = n * k;
    let t0 = Instant::now();
    let mut out = PubOutcome::default();
    let mut tags = Tags {
        state: vec![0; n as usize],
        low: 0,
    };
    let mut last_progress = Instant::now();
    loop {
        // Keep the window full, but do not pile up unwritten bytes beyond a few MB.
        while out.sent < n && out.sent - out.acked - out.nacked < window && c.unwritten() < 4 << 20
        {
            c.wbuf.extend_from_slice(frames);
            out.sent += k;
        }
        if out.acked + out.nacked >= n {
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            out.timed_out = true;
            break;
        }
        if now - last_progress >= stall {
            out.stalled = true;
            break;
        }
        let wake = (last_progress + stall).min(deadline);
        let open = tokio::select! {
            // A failed read or write ends the run like an EOF.
            r = c.pump() => r.unwrap_or(false),
            _ = tokio::time::sleep_until(wake.into()) => true,
        };
        let before = out.acked + out.nacked;
        loop {
            match c.next_frame() {
                Ok(Some(f)) => handle_frame(f, &mut tags, &mut out),
                Ok(None) => break,
                Err(_) => {
                    out.eof = true;
                    break;
                }
            }
        }
        if out.acked + out.nacked > before {
            last_progress = Instant::now();
        }
        if out.closed.is_some() {
            break;
        }
        if !open {
            out.eof = true;
            break;
        }
    }
    out.elapsed = t0.elapsed();
    out
}

fn handle_frame(f: AMQPFrame, tags: &mut Tags, out: &mut PubOutcome) {
    match f {
        AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
            tags.settle(a.delivery_tag, a.multiple, 1, out)
        }
        AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(a))) => {
            tags.settle(a.delivery_tag, a.multiple, 2, out)
        }
        AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Blocked(_))) => {
            out.blocked = true
        }
        AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Unblocked(_))) => {
            out.unblocked = true
        }
        AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(cl))) => {
            out.closed = Some(cl.reply_code)
        }
        AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(cl))) => {
            out.closed = Some(cl.reply_code)
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multiple_and_single_acks_count_once() {
        let mut out = PubOutcome {
            sent: 10,
            ..Default::default()
        };
        let mut tags = Tags {
            state: vec![0; 10],
            low: 0,
        };
        tags.settle(3, false, 1, &mut out);
        tags.settle(4, true, 1, &mut out); // 1, 2, 4 (3 already)
        tags.settle(4, true, 1, &mut out); // duplicate
        tags.settle(6, false, 2, &mut out);
        tags.settle(10, true, 1, &mut out); // 5, 7..10
        assert_eq!((out.acked, out.nacked), (9, 1));
        assert_eq!(tags.low, 10);
    }

    #[test]
    fn publish_frames_split_at_frame_max() {
        let f = encode_publish(4096, "", "q", 10_000, true).unwrap();
        // method + header + 3 body frames (4088 + 4088 + 1824 payload bytes).
        let mut rest = &f[..];
        let mut bodies = 0;
        while !rest.is_empty() {
            let (r, frame) = amq_protocol::frame::parse_frame(rest).unwrap();
            if let AMQPFrame::Body(_, b) = frame {
                assert!(b.len() <= 4088);
                bodies += 1;
            }
            rest = r;
        }
        assert_eq!(bodies, 3);
    }
}
