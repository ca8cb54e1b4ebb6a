//! Consumer role: one connection, prefetch P, acks with `multiple=true` every K deliveries or when idle.

use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::types::FieldTable;
use hdrhistogram::Histogram;

use crate::conn::{err, Conn, Context, Result, CHANNEL};
use crate::stats::{self, new_histogram, now_ns, record_ns};
use crate::Plan;

/// What one consumer measured.
pub struct ConsStats {
    /// Deliveries completed inside the measurement window.
    pub consumed: u64,
    /// Deliveries flagged `redelivered` (should stay 0 in a clean run).
    pub redelivered: u64,
    /// Publish → delivery latency, from the timestamp in the body's first 8 bytes.
    pub e2e: Histogram<u64>,
}

/// Set the prefetch and start consuming `queue` with manual acks.
pub async fn setup(conn: &mut Conn, queue: &str, prefetch: u16, tag: &str) -> Result<()> {
    let reply = conn
        .call(AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: prefetch,
            global: false,
        })))
        .await
        .ctx("basic.qos")?;
    if !matches!(reply, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))) {
        return err(format!("expected basic.qos-ok, got {reply:?}"));
    }
    let reply = conn
        .call(AMQPClass::Basic(basic::AMQPMethod::Consume(
            basic::Consume {
                queue: queue.into(),
                consumer_tag: tag.into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )))
        .await
        .ctx("basic.consume")?;
    match reply {
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)) => Ok(()),
        other => err(format!("expected basic.consume-ok, got {other:?}")),
    }
}

/// Where the consumer is inside a delivery (method, header, body frames).
enum Expect {
    Deliver,
    Header {
        tag: u64,
    },
    Body {
        tag: u64,
        remaining: u64,
        first: bool,
    },
}

/// Run one consumer until `plan.end_ns`.
pub async fn run(mut conn: Conn, ack_every: u32, idle: Duration, plan: Plan) -> Result<ConsStats> {
    let mut st = ConsStats {
        consumed: 0,
        redelivered: 0,
        e2e: new_histogram(),
    };
    let end = stats::deadline(plan.end_ns);
    let mut expect = Expect::Deliver;
    // Highest delivered tag not yet acknowledged, and how many deliveries it covers.
    let mut ack_tag = 0u64;
    let mut unacked = 0u32;

    loop {
        // With acks owed, wake after `idle` so a trickle of messages is still acknowledged promptly.
        let wake = if unacked > 0 {
            end.min(tokio::time::Instant::now() + idle)
        } else {
            end
        };
        let got_data = tokio::select! {
            r = conn.fill() => { r?; true }
            _ = tokio::time::sleep_until(wake) => false,
        };
        let now = now_ns();
        if now >= plan.end_ns {
            break;
        }
        if !got_data {
            if unacked > 0 {
                push_ack(&mut conn, ack_tag)?;
                unacked = 0;
            }
            conn.flush().await?;
            continue;
        }

        // One clock reading per read batch: every frame in it arrived at the same time.
        while let Some(frame) = conn.next_frame()? {
            expect = match (expect, frame) {
                (
                    Expect::Deliver,
                    AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))),
                ) => {
                    if d.redelivered {
                        st.redelivered += 1;
                    }
                    Expect::Header {
                        tag: d.delivery_tag,
                    }
                }
                (Expect::Header { tag }, AMQPFrame::Header(_, h)) => {
                    if h.body_size < 8 {
                        return err(format!(
                            "delivery of {} bytes has no timestamp (not from weir-bench?)",
                            h.body_size
                        ));
                    }
                    Expect::Body {
                        tag,
                        remaining: h.body_size,
                        first: true,
                    }
                }
                (
                    Expect::Body {
                        tag,
                        remaining,
                        first,
                    },
                    AMQPFrame::Body(_, body),
                ) => {
                    if first {
                        let ts = body
                            .get(..8)
                            .and_then(|b| <[u8; 8]>::try_from(b).ok())
                            .map(u64::from_be_bytes)
                            .ok_or_else(|| {
                                crate::conn::BenchError("first body frame under 8 bytes".into())
                            })?;
                        if ts >= plan.warmup_end_ns {
                            record_ns(&mut st.e2e, now.saturating_sub(ts));
                        }
                    }
                    let remaining = remaining.saturating_sub(body.len() as u64);
                    if remaining > 0 {
                        Expect::Body {
                            tag,
                            remaining,
                            first: false,
                        }
                    } else {
                        if now >= plan.warmup_end_ns {
                            st.consumed += 1;
                        }
                        ack_tag = tag;
                        unacked += 1;
                        if unacked >= ack_every {
                            push_ack(&mut conn, ack_tag)?;
                            unacked = 0;
                        }
                        Expect::Deliver
                    }
                }
                (_, AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Cancel(_)))) => {
                    return err("server cancelled the consumer (queue deleted?)")
                }
                (
                    _,
                    AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(c))),
                ) => {
                    return err(format!(
                        "server closed the connection: {} {}",
                        c.reply_code,
                        c.reply_text.as_str()
                    ))
                }
                (_, AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(c)))) => {
                    return err(format!(
                        "server closed the channel: {} {}",
                        c.reply_code,
                        c.reply_text.as_str()
                    ))
                }
                (e, AMQPFrame::Heartbeat) => e,
                (_, other) => return err(format!("consumer got out-of-sequence frame {other}")),
            };
        }
        conn.flush().await?;
    }
    conn.close().await;
    Ok(st)
}

/// Queue a `basic.ack` covering every delivery up to `tag`.
fn push_ack(conn: &mut Conn, tag: u64) -> Result<()> {
    conn.push_method(
        CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple: true,
        })),
    )
}
