//! Issue 20, item 1: a no-ack consumer on a deep durable queue. `count` persistent messages are
//! published (confirmed), then one consumer with `no_ack` reads them for at most `secs`, at most
//! `read_mbps` MB/s of bodies (a client slower than the broker, as pika is: its socket fills, the broker's
//! write buffer reaches its high-water mark with deliveries left over, and then the client drains
//! the socket in one go). Figures: received, how long it took, the longest pause between two
//! deliveries (and the delivery it came before), and what is left ready in the queue.

use std::time::{Duration, Instant};

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, AMQPClass};
use amq_protocol::types::FieldTable;

use crate::attacks::{fill, short_err, PublishOpts, Target};
use crate::conn::{Result, CHANNEL};
use crate::ops;

/// Fills `abuse.noack` and drains it with one no-ack consumer (see the module).
pub async fn noack_drain(
    t: &Target,
    count: u64,
    size: usize,
    secs: u64,
    read_mbps: u64,
) -> Result<String> {
    let q = "abuse.noack";
    let mut c = t.conn().await?;
    ops::declare_queue(&mut c, q, true).await?;
    ops::purge(&mut c, q).await?;
    let o = PublishOpts {
        queue: q.into(),
        durable: true,
        persistent: true,
        count,
        size,
        window: 2000,
        limit: Duration::from_secs(300),
        stall: Duration::from_secs(10),
    };
    let out = fill(&mut c, &o).await?;
    c.close().await;
    let mut consumer = t.conn().await?;
    consumer.push_method(
        CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: q.into(),
            consumer_tag: "abuse-noack".into(),
            no_local: false,
            no_ack: true,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )?;
    consumer.flush().await?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    let confirmed = out.acked;
    let (mut got, mut read, mut last, mut longest) = (0u64, 0u64, start, Duration::ZERO);
    // The delivery the longest pause came before.
    let mut longest_at = 0u64;
    while got < confirmed {
        while let Some(f) = consumer.next_frame()? {
            match f {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(_))) => {
                    got += 1;
                    let now = Instant::now();
                    if now - last > longest {
                        (longest, longest_at) = (now - last, got);
                    }
                    last = now;
                }
                AMQPFrame::Body(_, b) => read += b.len() as u64,
                _ => {}
            }
        }
        if got >= confirmed {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, consumer.fill()).await {
            Ok(r) => r?,
            Err(_) => break,
        }
        if read_mbps > 0 {
            // Paced: never ahead of `read_mbps` (bodies) since the start.
            let due = start + Duration::from_secs_f64(read as f64 / (read_mbps as f64 * 1e6));
            if due > Instant::now() {
                tokio::time::sleep_until(due.min(deadline).into()).await;
            }
        }
    }
    let drain = start.elapsed();
    if got < confirmed {
        // The pause still going on when the time ran out.
        if Instant::now() - last > longest {
            (longest, longest_at) = (Instant::now() - last, got + 1);
        }
    }
    drop(consumer);
    let ready = match t.conn().await {
        Ok(mut c) => match ops::count(&mut c, q).await {
            Ok(n) => n.to_string(),
            Err(e) => short_err(&e.0),
        },
        Err(e) => short_err(&e.0),
    };
    Ok(format!(
        "{} publish_ms={} received={got}/{confirmed} drain_ms={} longest_gap_ms={} longest_gap_at={longest_at} ready_left={ready}",
        out.tokens(),
        out.elapsed.as_millis(),
        drain.as_millis(),
        longest.as_millis(),
    ))
}
