//! Publisher role: a window of unconfirmed persistent publishes on one connection, saturated or paced.

use std::collections::VecDeque;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, AMQPClass};
use hdrhistogram::Histogram;
use tokio::sync::watch;

use amq_protocol::protocol::BasicProperties;

use crate::conn::{encode_publish_with, err, Conn, Context, Result};
use crate::stats::{self, new_histogram, now_ns, record_ns};
use crate::Plan;

/// What one publisher measured.
pub struct PubStats {
    /// Messages written to the socket over the whole run (warm-up included).
    pub sent: u64,
    /// Confirms (acks) received inside the measurement window.
    pub confirmed: u64,
    /// basic.nack received inside the measurement window.
    pub nacked: u64,
    /// Confirm latency from the *intended* send time (equals the actual send time when saturated).
    pub confirm: Histogram<u64>,
    /// Confirm latency from the moment the frames were handed to the socket (service time only).
    pub confirm_service: Histogram<u64>,
}

/// Pre-encoded publishes (basic.publish + content header + body frames), one per variant, each with
/// the offset of the body's first byte, where each copy gets its 8-byte timestamp.
///
/// Encoding the frames once with `gen_frame` and copying the bytes per message keeps the per-message
/// cost to a ~300-byte memcpy: every publish of a run is identical except for that timestamp and,
/// with `--priorities N`, which of the N pre-encoded priority variants it is.
pub struct Template {
    variants: Vec<(Vec<u8>, usize)>,
}

impl Template {
    /// Encode the frames that publish `size` bytes to `queue` through the default exchange: one
    /// variant without a priority when `priorities` is 0, else one per priority `0..priorities`.
    pub fn new(
        frame_max: u32,
        queue: &str,
        size: usize,
        persistent: bool,
        priorities: u8,
    ) -> Result<Template> {
        let mode = if persistent { 2 } else { 1 };
        let props = BasicProperties::default().with_delivery_mode(mode);
        let all: Vec<BasicProperties> = if priorities == 0 {
            vec![props]
        } else {
            (0..priorities)
                .map(|p| props.clone().with_priority(p))
                .collect()
        };
        let variants = all
            .into_iter()
            .map(|props| encode_publish_with(frame_max, "", queue, size, props))
            .collect::<Result<Vec<_>>>()
            .ctx("encoding publish template")?;
        Ok(Template { variants })
    }

    /// Append one publish stamped with `ts_ns` to `out`; with several variants, a uniformly random
    /// one drawn from `rng`.
    #[inline]
    fn append(&self, out: &mut Vec<u8>, ts_ns: u64, rng: &mut u64) {
        let (bytes, ts_offset) = if self.variants.len() == 1 {
            &self.variants[0]
        } else {
            &self.variants[(xorshift(rng) % self.variants.len() as u64) as usize]
        };
        let at = out.len() + ts_offset;
        out.extend_from_slice(bytes);
        out[at..at + 8].copy_from_slice(&ts_ns.to_be_bytes());
    }
}

/// xorshift64: a few cycles per draw, plenty for spreading priorities (state must not be 0).
#[inline]
pub fn xorshift(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

/// Put the channel in confirm mode.
pub async fn setup(conn: &mut Conn) -> Result<()> {
    conn.confirm_select().await
}

/// Unconfirmed publishes, indexed by delivery tag (publish sequence number).
struct Pending {
    /// Delivery tag of `slots[0]`.
    first_tag: u64,
    /// (intended send ns, actual send ns) per tag; `None` once settled out of order.
    slots: VecDeque<Option<(u64, u64)>>,
    inflight: usize,
}

/// How a publisher paces itself.
pub enum Pace {
    /// Keep the window full.
    Saturated,
    /// Send message `j` of the global sequence at `start + j * interval`, for every `j` with
    /// `j % of == index`; the pacer thread wakes us through `ticks`.
    Rate {
        interval_ns: f64,
        index: u64,
        of: u64,
        ticks: watch::Receiver<u64>,
    },
}

/// Run one publisher until `plan.end_ns`.
pub async fn run(
    mut conn: Conn,
    template: &Template,
    window: usize,
    mut pace: Pace,
    plan: Plan,
) -> Result<PubStats> {
    let mut st = PubStats {
        sent: 0,
        confirmed: 0,
        nacked: 0,
        confirm: new_histogram(),
        confirm_service: new_histogram(),
    };
    let mut pending = Pending {
        first_tag: 1,
        slots: VecDeque::with_capacity(window),
        inflight: 0,
    };
    // Rate mode: the next message of the global sequence this publisher owns.
    let mut next_j = match &pace {
        Pace::Saturated => 0,
        Pace::Rate { index, .. } => *index,
    };
    let end = stats::deadline(plan.end_ns);
    // Priority draws: a seed that differs per publisher (the clock), never 0 (xorshift's fixed point).
    let mut rng = (now_ns() ^ 0x9E37_79B9_7F4A_7C15).wrapping_mul(0xBF58_476D_1CE4_E5B9) | 1;

    loop {
        let now = now_ns();
        if now >= plan.end_ns {
            break;
        }
        // Publish whatever the window and the schedule allow, all into one buffer.
        while pending.inflight < window {
            let intended = match &pace {
                Pace::Saturated => now,
                Pace::Rate {
                    interval_ns, of, ..
                } => {
                    let due = plan.start_ns + (next_j as f64 * interval_ns) as u64;
                    if due > now {
                        break;
                    }
                    next_j += of;
                    due
                }
            };
            template.append(&mut conn.wbuf, intended, &mut rng);
            pending.slots.push_back(Some((intended, now)));
            pending.inflight += 1;
            st.sent += 1;
        }
        conn.flush().await?;

        // Sleep until the server says something, the pacer ticks (if we may send), or the run ends.
        let may_send = pending.inflight < window;
        tokio::select! {
            r = conn.fill() => r?,
            _ = tokio::time::sleep_until(end) => {}
            r = next_tick(&mut pace), if may_send => r?,
        }

        let now = now_ns();
        while let Some(frame) = conn.next_frame()? {
            match frame {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => settle(
                    &mut pending,
                    &mut st,
                    &plan,
                    now,
                    a.delivery_tag,
                    a.multiple,
                    false,
                )?,
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(n))) => settle(
                    &mut pending,
                    &mut st,
                    &plan,
                    now,
                    n.delivery_tag,
                    n.multiple,
                    true,
                )?,
                AMQPFrame::Method(_, AMQPClass::Connection(m)) => {
                    use amq_protocol::protocol::connection::AMQPMethod as C;
                    match m {
                        // Flow control: keep reading; the server simply stops reading our socket.
                        C::Blocked(_) | C::Unblocked(_) => {}
                        C::Close(c) => {
                            return err(format!(
                                "server closed the connection: {} {}",
                                c.reply_code,
                                c.reply_text.as_str()
                            ))
                        }
                        other => return err(format!("unexpected connection method {other:?}")),
                    }
                }
                AMQPFrame::Method(
                    _,
                    AMQPClass::Channel(amq_protocol::protocol::channel::AMQPMethod::Close(c)),
                ) => {
                    return err(format!(
                        "server closed the channel: {} {}",
                        c.reply_code,
                        c.reply_text.as_str()
                    ))
                }
                AMQPFrame::Heartbeat => {}
                other => return err(format!("publisher got unexpected frame {other}")),
            }
        }
    }
    conn.close().await;
    Ok(st)
}

/// Wait for the pacer's next tick (never resolves when saturated).
async fn next_tick(pace: &mut Pace) -> Result<()> {
    match pace {
        Pace::Saturated => std::future::pending().await,
        Pace::Rate { ticks, .. } => {
            if ticks.changed().await.is_err() {
                // The pacer stops at the end of the run; the end-of-run timer takes over from here.
                std::future::pending::<()>().await;
            }
            Ok(())
        }
    }
}

/// Apply a confirm (ack or nack) for `tag`, or for every tag up to it when `multiple`.
fn settle(
    p: &mut Pending,
    st: &mut PubStats,
    plan: &Plan,
    now: u64,
    tag: u64,
    multiple: bool,
    nack: bool,
) -> Result<()> {
    let last = p.first_tag + p.slots.len() as u64;
    if tag < p.first_tag && !multiple || tag >= last {
        return err(format!(
            "confirm for unknown delivery tag {tag} (outstanding {}..{last})",
            p.first_tag
        ));
    }
    let in_window = now >= plan.warmup_end_ns;
    let mut one = |slot: Option<(u64, u64)>, inflight: &mut usize| {
        if let Some((intended, sent)) = slot {
            *inflight -= 1;
            if in_window {
                if nack {
                    st.nacked += 1;
                } else {
                    st.confirmed += 1;
                }
            }
            // Only messages sent after warm-up count for latency, so start-up costs stay out.
            if intended >= plan.warmup_end_ns && !nack {
                record_ns(&mut st.confirm, now.saturating_sub(intended));
                record_ns(&mut st.confirm_service, now.saturating_sub(sent));
            }
        }
    };
    if multiple {
        while p.first_tag <= tag {
            let Some(slot) = p.slots.pop_front() else {
                break;
            };
            p.first_tag += 1;
            one(slot, &mut p.inflight);
        }
    } else {
        let idx = (tag - p.first_tag) as usize;
        if let Some(slot) = p.slots.get_mut(idx) {
            one(slot.take(), &mut p.inflight);
        }
        // Drop the settled prefix so the deque stays window-sized.
        while let Some(None) = p.slots.front() {
            p.slots.pop_front();
            p.first_tag += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::parse_frame;

    fn plan() -> Plan {
        Plan {
            start_ns: 0,
            warmup_end_ns: 0,
            end_ns: u64::MAX,
        }
    }

    fn stats() -> PubStats {
        PubStats {
            sent: 0,
            confirmed: 0,
            nacked: 0,
            confirm: new_histogram(),
            confirm_service: new_histogram(),
        }
    }

    fn pending(n: u64) -> Pending {
        Pending {
            first_tag: 1,
            slots: (0..n).map(|i| Some((i, i))).collect(),
            inflight: n as usize,
        }
    }

    /// The template decodes as publish + header + body frames, the body split at frame_max, with the
    /// timestamp in the first 8 body bytes.
    #[test]
    fn template_round_trips_through_the_codec() {
        let t = Template::new(4096, "q", 5000, true, 0).unwrap();
        let mut out = Vec::new();
        t.append(&mut out, 0x0102_0304_0506_0708, &mut 1);
        let mut rest = &out[..];
        let mut frames = Vec::new();
        while !rest.is_empty() {
            let (r, f) = parse_frame(rest).unwrap();
            frames.push(f);
            rest = r;
        }
        assert_eq!(frames.len(), 4, "method, header, two body frames");
        match &frames[1] {
            AMQPFrame::Header(_, h) => {
                assert_eq!(h.body_size, 5000);
                assert_eq!(h.properties.delivery_mode(), &Some(2));
            }
            other => panic!("expected header, got {other:?}"),
        }
        match (&frames[2], &frames[3]) {
            (AMQPFrame::Body(_, a), AMQPFrame::Body(_, b)) => {
                assert_eq!(a.len() + b.len(), 5000);
                assert_eq!(a[..8], 0x0102_0304_0506_0708u64.to_be_bytes());
            }
            other => panic!("expected two body frames, got {other:?}"),
        }
    }

    /// With `priorities` 10 every publish carries a priority 0..=9, and all ten occur.
    #[test]
    fn priority_variants_are_drawn_uniformly() {
        let t = Template::new(4096, "q", 16, true, 10).unwrap();
        let (mut rng, mut seen) = (12345u64, [0u32; 10]);
        for _ in 0..10_000 {
            let mut out = Vec::new();
            t.append(&mut out, 7, &mut rng);
            let (rest, _) = parse_frame(&out[..]).unwrap();
            match parse_frame(rest).unwrap().1 {
                AMQPFrame::Header(_, h) => {
                    seen[usize::from(h.properties.priority().unwrap())] += 1;
                }
                other => panic!("expected header, got {other:?}"),
            }
        }
        assert!(seen.iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
    }

    #[test]
    fn multiple_ack_settles_a_prefix() {
        let (mut p, mut st) = (pending(10), stats());
        settle(&mut p, &mut st, &plan(), 100, 4, true, false).unwrap();
        assert_eq!((p.first_tag, p.inflight, st.confirmed), (5, 6, 4));
        assert_eq!(st.confirm.len(), 4);
    }

    #[test]
    fn single_acks_out_of_order_then_prefix_drops() {
        let (mut p, mut st) = (pending(5), stats());
        settle(&mut p, &mut st, &plan(), 100, 3, false, false).unwrap();
        assert_eq!((p.first_tag, p.inflight), (1, 4));
        settle(&mut p, &mut st, &plan(), 100, 1, false, false).unwrap();
        settle(&mut p, &mut st, &plan(), 100, 2, false, false).unwrap();
        // 1..=3 settled: the front of the ring moves past all of them.
        assert_eq!((p.first_tag, p.inflight, p.slots.len()), (4, 2, 2));
        // A multiple ack over an already-settled tag counts nothing twice.
        settle(&mut p, &mut st, &plan(), 100, 5, true, false).unwrap();
        assert_eq!((p.inflight, st.confirmed), (0, 5));
    }

    #[test]
    fn nack_counts_separately_and_unknown_tag_is_an_error() {
        let (mut p, mut st) = (pending(3), stats());
        settle(&mut p, &mut st, &plan(), 100, 2, true, true).unwrap();
        assert_eq!((st.nacked, st.confirmed, st.confirm.len()), (2, 0, 0));
        assert!(settle(&mut p, &mut st, &plan(), 100, 9, false, false).is_err());
    }
}
