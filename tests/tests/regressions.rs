//! Regression tests for bugs found in code review, one test per bug. Each
//! fails against the broker as it was before the fixes and passes now.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use weir_tests::raw::{self, longstr, method, shortstr, Frame, RawClient, PROTOCOL_HEADER};
use weir_tests::*;

// ---------------------------------------------------------------------------
// raw frames not in the shared helpers

/// A value of `levels` field arrays nested in one another around a void.
fn nested_arrays(levels: usize) -> Vec<u8> {
    let mut v = vec![b'V'];
    for _ in 0..levels {
        let mut outer = vec![b'A'];
        outer.extend_from_slice(&(v.len() as u32).to_be_bytes());
        outer.extend_from_slice(&v);
        v = outer;
    }
    v
}

/// A field table `{ "k": value }` (length-prefixed).
fn table_with(value: &[u8]) -> Vec<u8> {
    let mut entry = shortstr("k");
    entry.extend_from_slice(value);
    let mut t = (entry.len() as u32).to_be_bytes().to_vec();
    t.extend(entry);
    t
}

/// connection.start-ok with the given client-properties table.
fn start_ok(client_properties: &[u8]) -> Vec<u8> {
    let mut a = client_properties.to_vec();
    a.extend(shortstr("PLAIN"));
    a.extend(longstr(b"\0guest\0guest"));
    a.extend(shortstr("en_US"));
    method(0, 10, 11, &a)
}

/// Content header for class basic with only the `headers` property set.
fn content_header_with_headers(ch: u16, body_size: u64, headers: &[u8]) -> Vec<u8> {
    let mut p = 60u16.to_be_bytes().to_vec();
    p.extend_from_slice(&0u16.to_be_bytes()); // weight
    p.extend_from_slice(&body_size.to_be_bytes());
    p.extend_from_slice(&(1u16 << 13).to_be_bytes()); // headers only
    p.extend_from_slice(headers);
    raw::frame(raw::FRAME_HEADER, ch, &p)
}

/// Content header for class basic with delivery-mode 2 only.
fn persistent_header(ch: u16, body_size: u64) -> Vec<u8> {
    let mut p = 60u16.to_be_bytes().to_vec();
    p.extend_from_slice(&0u16.to_be_bytes()); // weight
    p.extend_from_slice(&body_size.to_be_bytes());
    p.extend_from_slice(&(1u16 << 12).to_be_bytes()); // delivery-mode only
    p.push(2);
    raw::frame(raw::FRAME_HEADER, ch, &p)
}

/// basic.publish + header + one body frame (the body must fit in a frame).
fn publish(ch: u16, exchange: &str, key: &str, body: &[u8], persistent: bool) -> Vec<u8> {
    let mut v = raw::basic_publish(ch, exchange, key);
    if persistent {
        v.extend(persistent_header(ch, body.len() as u64));
    } else {
        v.extend(raw::content_header(ch, body.len() as u64));
    }
    v.extend(raw::body(ch, body));
    v
}

/// queue.declare with only the durable bit set.
fn queue_declare_durable(ch: u16, name: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(name));
    a.push(0b10); // durable
    a.extend_from_slice(&0u32.to_be_bytes());
    method(ch, 50, 10, &a)
}

fn queue_delete(ch: u16, name: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(name));
    a.push(0);
    method(ch, 50, 40, &a)
}

fn queue_purge(ch: u16, name: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(name));
    a.push(0);
    method(ch, 50, 30, &a)
}

fn basic_consume(ch: u16, queue: &str, tag: &str, no_ack: bool) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(queue));
    a.extend(shortstr(tag));
    a.push(if no_ack { 0b10 } else { 0 });
    a.extend_from_slice(&0u32.to_be_bytes());
    method(ch, 60, 20, &a)
}

fn basic_cancel(ch: u16, tag: &str) -> Vec<u8> {
    let mut a = shortstr(tag);
    a.push(0);
    method(ch, 60, 30, &a)
}

fn confirm_select(ch: u16) -> Vec<u8> {
    method(ch, 85, 10, &[0])
}

/// The first short string of a method's arguments (consume-ok's tag).
fn first_shortstr(f: &Frame) -> String {
    let a = &f.payload[4..];
    String::from_utf8_lossy(&a[1..1 + a[0] as usize]).into_owned()
}

/// (delivery tag, multiple, is_nack) of a basic.ack / basic.nack.
fn confirm_of(f: &Frame) -> Option<(u64, bool, bool)> {
    let nack = match f.method()? {
        (60, 80) => false,
        (60, 120) => true,
        _ => return None,
    };
    let a = &f.payload[4..];
    let tag = u64::from_be_bytes(a[..8].try_into().unwrap());
    Some((tag, a[8] & 1 != 0, nack))
}

/// Reads methods until `class.method` arrives on `ch`, returning it and
/// everything skipped on the way. Panics on EOF.
async fn read_until(c: &mut RawClient, ch: u16, class: u16, meth: u16) -> (Frame, Vec<Frame>) {
    let mut skipped = Vec::new();
    loop {
        let f = c
            .read_method()
            .await
            .unwrap_or_else(|| panic!("EOF waiting for {class}.{meth} on channel {ch}"));
        if f.method() == Some((10, 50)) {
            panic!(
                "connection.close while waiting for {class}.{meth}: {:?}",
                raw::parse_close(&f)
            );
        }
        if f.channel == ch && f.method() == Some((class, meth)) {
            return (f, skipped);
        }
        skipped.push(f);
    }
}

/// A new channel on `conn` can declare, publish (confirmed) and get.
async fn still_works(conn: &Connection) {
    let ch = confirm_channel(conn).await;
    let q = declare_queue(&ch, "").await;
    publish_confirmed(
        &ch,
        "",
        q.name().as_str(),
        b"ok",
        BasicProperties::default(),
    )
    .await;
    let m = ch
        .basic_get(q.name().as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("message");
    assert_eq!(m.delivery.data, b"ok");
    ch.close(200, "done".into()).await.unwrap();
}

// ---------------------------------------------------------------------------
// 1. Deeply nested field tables

/// ~1000 nested field arrays used to overflow the parser's stack and abort
/// the whole broker: in a start-ok before login, and in message headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deeply_nested_field_tables_are_refused_not_a_crash() {
    let mut broker = Broker::start();

    // Before login: client-properties of a start-ok.
    let mut c = RawClient::connect(broker.addr()).await;
    c.send(PROTOCOL_HEADER).await;
    c.expect_method(10, 10).await; // connection.start
    let _ = c
        .try_send(&start_ok(&table_with(&nested_arrays(1000))))
        .await;
    let close = c
        .expect_connection_close()
        .await
        .expect("socket closed without connection.close (did the broker crash?)");
    assert_eq!(close.code, 502, "{close:?}");
    assert_eq!((close.class_id, close.method_id), (10, 11), "{close:?}");
    c.read_to_eof().await;
    assert!(broker.is_running(), "the broker died");
    assert_broker_healthy(&broker.url()).await;

    // After login: the headers table of a basic.publish content header.
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(1).await;
    c.send(&raw::basic_publish(1, "", "nowhere")).await;
    let _ = c
        .try_send(&content_header_with_headers(
            1,
            1,
            &table_with(&nested_arrays(1000)),
        ))
        .await;
    let _ = c.try_send(&raw::body(1, b"x")).await;
    let close = c
        .expect_connection_close()
        .await
        .expect("socket closed without connection.close (did the broker crash?)");
    assert_eq!(close.code, 501, "{close:?}");
    c.read_to_eof().await;
    assert!(broker.is_running(), "the broker died");
    assert_broker_healthy(&broker.url()).await;
}

// ---------------------------------------------------------------------------
// 2. A stale consumer-cancel notice

/// Queue nq1 is deleted (channel 2) while, in the same read, channel 1
/// cancels consumer T on nq1 and consumes nq2 under the same tag T. The
/// deletion's cancel notice for the old T used to remove the new T from the
/// channel's table, so closing the channel left it attached to nq2 as a
/// ghost that took nq2's messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_cancel_notice_does_not_orphan_a_reused_consumer_tag() {
    let broker = Broker::start();
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(1).await;
    c.open_channel(2).await;
    for q in ["nq1", "nq2"] {
        c.send(&raw::queue_declare(1, q)).await;
        c.expect_method(50, 11).await;
    }
    c.send(&basic_consume(1, "nq1", "T", false)).await;
    c.expect_method(60, 21).await;

    // One write, so the server handles all three before it looks at the
    // notices the deletion raised.
    let mut burst = queue_delete(2, "nq1");
    burst.extend(basic_cancel(1, "T"));
    burst.extend(basic_consume(1, "nq2", "T", true));
    c.send(&burst).await;
    read_until(&mut c, 2, 50, 41).await; // queue.delete-ok
    let (ok, _) = read_until(&mut c, 1, 60, 21).await; // consume-ok for the new T
    assert_eq!(first_shortstr(&ok), "T");

    // Closing the channel must take the new T away from nq2.
    c.send(&raw::channel_close(1)).await;
    read_until(&mut c, 1, 20, 41).await;

    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    let q = ch
        .queue_declare(
            "nq2".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare nq2");
    assert_eq!(
        q.consumer_count(),
        0,
        "a consumer survived its channel's close"
    );

    let mut consumer = ch
        .basic_consume(
            "nq2".into(),
            "healthy".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    for i in 0..10 {
        publish_confirmed(
            &ch,
            "",
            "nq2",
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    for i in 0..10 {
        let d = next_delivery(&mut consumer).await;
        assert_eq!(d.data, format!("m{i}").as_bytes());
    }
    let q = ch
        .queue_declare(
            "nq2".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare nq2");
    assert_eq!(q.consumer_count(), 1);
    assert_eq!(q.message_count(), 0);
}

// ---------------------------------------------------------------------------
// 3. Publisher confirms across a channel reopening

/// Confirms still pending in the store when channel 1 is closed used to be
/// written to the next opening of channel 1, acking tags it never used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirms_of_a_closed_channel_do_not_reach_its_reopening() {
    const N: u64 = 300;
    /// Trials that must close the channel with confirms still pending.
    const WANT_RACES: usize = 3;
    const MAX_TRIALS: usize = 30;

    let broker = Broker::start();
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(9).await;
    c.send(&queue_declare_durable(9, "cq")).await;
    c.expect_method(50, 11).await;

    let body = vec![b'y'; 4000];
    let mut races = 0;
    let mut trials = 0;
    while races < WANT_RACES && trials < MAX_TRIALS {
        trials += 1;
        c.open_channel(1).await;
        c.send(&confirm_select(1)).await;
        c.expect_method(85, 11).await;
        let mut burst = Vec::new();
        for _ in 0..N {
            burst.extend(publish(1, "", "cq", &body, true));
        }
        c.send(&burst).await;
        // One write: close, reopen, confirm mode again, one (unroutable,
        // so confirmed at once) publish.
        let mut burst = raw::channel_close(1);
        burst.extend(raw::channel_open(1));
        burst.extend(confirm_select(1));
        burst.extend(publish(1, "", "no-such-queue", b"z", false));
        c.send(&burst).await;

        // Confirms before the close-ok belong to the old opening.
        let (_, before) = read_until(&mut c, 1, 20, 41).await;
        let old_acked = before
            .iter()
            .filter(|f| f.channel == 1)
            .filter_map(confirm_of)
            .map(|(tag, _, _)| tag)
            .max()
            .unwrap_or(0);
        if old_acked < N {
            races += 1;
        }
        let (_, mut after) = read_until(&mut c, 1, 20, 11).await; // open-ok
        let (_, more) = read_until(&mut c, 1, 85, 11).await; // select-ok
        after.extend(more);
        let (ack1, more) = read_until(&mut c, 1, 60, 80).await;
        after.extend(more);
        after.push(ack1);
        // A persistent publish on the new opening: its confirm is ordered
        // behind every earlier append to cq, so any stale confirm of the old
        // opening has been written by the time it arrives.
        c.send(&publish(1, "", "cq", b"flush", true)).await;
        loop {
            let (f, more) = read_until(&mut c, 1, 60, 80).await;
            after.extend(more);
            let done = confirm_of(&f).is_some_and(|(tag, _, _)| tag == 2);
            after.push(f);
            if done {
                break;
            }
        }
        let confirms: Vec<_> = after
            .iter()
            .filter(|f| f.channel == 1)
            .filter_map(confirm_of)
            .map(|(tag, _multiple, nack)| (tag, nack))
            .collect();
        // (A multiple ack of tag 1 covers tag 1 only, so `multiple` is moot.)
        assert_eq!(
            confirms,
            vec![(1, false), (2, false)],
            "trial {trials} (old opening acked up to {old_acked} of {N} before close-ok): \
             confirms on the reopened channel"
        );

        c.send(&raw::channel_close(1)).await;
        read_until(&mut c, 1, 20, 41).await;
        c.send(&queue_purge(9, "cq")).await;
        read_until(&mut c, 9, 50, 31).await;
    }
    assert!(
        races >= WANT_RACES,
        "only {races} of {trials} trials closed the channel with confirms pending; \
         the test did not exercise the race"
    );
}

// ---------------------------------------------------------------------------
// 4. Auto-delete exchanges: tested in process since, in
// engine/tests/routing.rs (`auto_delete_exchange_goes_with_its_last_binding_only`,
// `a_long_auto_delete_exchange_chain_cascades_without_recursion`).

// ---------------------------------------------------------------------------
// 5. Server-generated consumer tags

/// Generated tags were derived from the channel's consumer count, so
/// consume, consume, cancel the first, consume again reused the second's
/// tag and the broker closed the connection with 530.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_consumer_tags_are_unique() {
    let broker = Broker::start();
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(1).await;
    c.send(&raw::queue_declare(1, "ctq1")).await;
    c.expect_method(50, 11).await;
    let mut tags = Vec::new();
    for _ in 0..2 {
        c.send(&basic_consume(1, "ctq1", "", false)).await;
        tags.push(first_shortstr(&c.expect_method(60, 21).await));
    }
    c.send(&basic_cancel(1, &tags[0])).await;
    c.expect_method(60, 31).await;
    c.send(&basic_consume(1, "ctq1", "", false)).await;
    let f = c.read_method().await.expect("EOF after the third consume");
    assert_ne!(
        f.method(),
        Some((10, 50)),
        "connection closed: {:?}",
        raw::parse_close(&f)
    );
    assert_eq!(f.method(), Some((60, 21)), "unexpected {f:?}");
    tags.push(first_shortstr(&f));
    assert!(tags.iter().all(|t| !t.is_empty()), "{tags:?}");
    assert!(
        tags[0] != tags[1] && tags[1] != tags[2] && tags[0] != tags[2],
        "tags not distinct: {tags:?}"
    );
}

// ---------------------------------------------------------------------------
// 6. Messages bigger than a store segment

/// With 1 MiB segments a 2 MiB persistent message cannot be stored; it used
/// to fail in the store after the body arrived and close the connection with
/// 541. It must be refused on the channel with 406.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_larger_than_a_segment_is_a_channel_406() {
    let broker = Broker::start_with(&["--segment-mb", "1"]);
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    ch.queue_declare(
        "bigq".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare bigq");
    let mut events = error_events(&conn);
    let _confirm = ch
        .basic_publish(
            "".into(),
            "bigq".into(),
            BasicPublishOptions::default(),
            &vec![b'x'; 2 << 20],
            persistent(),
        )
        .await;
    assert_eq!(next_error_code(&mut events).await, 406);
    assert!(
        conn.status().connected(),
        "the connection was closed, not the channel"
    );
    still_works(&conn).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(queue_len(&ch, "bigq").await, 0);
    // A message that fits still goes through on the same connection.
    let ch = confirm_channel(&conn).await;
    publish_confirmed(&ch, "", "bigq", &vec![b'x'; 64 << 10], persistent()).await;
    assert_eq!(queue_len(&ch, "bigq").await, 1);
}

// ---------------------------------------------------------------------------
// 7. Empty queue name

/// An empty queue name means the channel's last declared queue; with none
/// declared on the channel it is 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_queue_name_means_last_declared_queue() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "q").await;
    for i in 0..4 {
        publish_confirmed(
            &ch,
            "",
            "q",
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    let got = ch
        .basic_get("".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get with an empty queue name")
        .expect("a message from q");
    assert_eq!(got.delivery.data, b"m0");
    let purged = ch
        .queue_purge("".into(), QueuePurgeOptions::default())
        .await
        .expect("queue.purge with an empty queue name");
    assert_eq!(purged, 3);
    assert_eq!(queue_len(&ch, "q").await, 0);

    // No queue declared on this channel (q was declared on another one).
    let ch2 = conn.create_channel().await.unwrap();
    assert_code(
        ch2.basic_get("".into(), BasicGetOptions { no_ack: true })
            .await,
        404,
    );
    assert!(!ch2.status().connected(), "the channel must be closed");
    assert!(conn.status().connected());
    still_works(&conn).await;
}
