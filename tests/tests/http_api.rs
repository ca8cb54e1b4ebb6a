//! The management API (`/api`) against the real `weir` binary: every
//! endpoint, its errors (404, 400 with a JSON reason, 401, 403), and its
//! figures checked against known traffic made with lapin.

use std::time::{Duration, Instant};

use lapin::options::*;
use lapin::BasicProperties;
use serde_json::{json, Value};
use weir_tests::http::Http;
use weir_tests::*;

fn admin(b: &Broker) -> Http {
    Http::new(b.http_port(), "guest", "guest")
}

/// Polls `f` until it returns Some, for figures the broker updates
/// asynchronously (rates sampled every 5 s); bounded.
fn eventually<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[track_caller]
fn assert_error(r: &weir_tests::http::Resp, status: u16) -> Value {
    assert_eq!(r.status, status, "expected {status}: {}", r.text);
    let v = r.json();
    assert!(v["error"].is_string(), "no error field: {v}");
    assert!(
        v["reason"].as_str().is_some_and(|s| !s.is_empty()),
        "no reason: {v}"
    );
    v
}

/// Creates a user with `tags` and (optionally) full permissions on `/`.
fn add_user(h: &Http, name: &str, tags: &str, perms_on_root: bool) {
    let r = h.put(
        &format!("/api/users/{name}"),
        json!({ "password": "pw", "tags": tags }),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    if perms_on_root {
        let r = h.put(
            &format!("/api/permissions/%2F/{name}"),
            json!({ "configure": ".*", "write": ".*", "read": ".*" }),
        );
        assert_eq!(r.status, 201, "{}", r.text);
    }
}

#[tokio::test]
async fn auth_401_and_403() {
    let b = Broker::start();
    let h = admin(&b);
    // No credentials, wrong password: 401 with RabbitMQ's realm and body.
    let r = Http::anonymous(b.http_port()).get("/api/overview");
    assert_error(&r, 401);
    assert_eq!(
        r.header("www-authenticate"),
        Some("Basic realm=\"RabbitMQ Management\"")
    );
    assert_error(&h.as_user("guest", "wrong").get("/api/queues"), 401);
    assert_error(&h.as_user("nobody", "pw").get("/api/queues"), 401);
    // A user without a management tag cannot use the API at all.
    add_user(&h, "plain", "", true);
    assert_error(&h.as_user("plain", "pw").get("/api/overview"), 401);
    // management: its own vhosts only; no users, no vhost creation.
    add_user(&h, "mgmt", "management", false);
    let m = h.as_user("mgmt", "pw");
    assert_eq!(m.get_json("/api/whoami")["tags"], json!(["management"]));
    assert_error(&m.get("/api/queues/%2F"), 403);
    assert_eq!(m.get_json("/api/queues"), json!([]));
    assert_error(&m.get("/api/users"), 403);
    assert_error(&m.put("/api/vhosts/v9", json!({})), 403);
    assert_error(
        &m.put(
            "/api/policies/%2F/p",
            json!({"pattern": ".*", "definition": {"max-length": 1}}),
        ),
        403,
    );
    // With permissions on `/` it sees and declares there.
    h.put(
        "/api/permissions/%2F/mgmt",
        json!({"configure": "^m\\.", "write": ".*", "read": ".*"}),
    );
    assert_eq!(m.get("/api/queues/%2F").status, 200);
    assert_eq!(m.put("/api/queues/%2F/m.q", json!({})).status, 201);
    // ... but the engine checks the configure pattern per object: 403.
    assert_error(&m.put("/api/queues/%2F/other", json!({})), 403);
    // monitoring reads everything, changes nothing it has no rights for.
    add_user(&h, "mon", "monitoring", false);
    let mon = h.as_user("mon", "pw");
    let qs = mon.get_json("/api/queues");
    assert_eq!(qs.as_array().map(Vec::len), Some(1), "{qs}");
    assert_error(&mon.put("/api/queues/%2F/x", json!({})), 403);
    // policymaker: policies where it has access.
    add_user(&h, "pol", "policymaker", true);
    let p = h.as_user("pol", "pw");
    assert_eq!(
        p.put(
            "/api/policies/%2F/p1",
            json!({"pattern": "^m\\.", "definition": {"max-length": 5}, "apply-to": "queues"})
        )
        .status,
        201
    );
    assert_eq!(
        p.get_json("/api/policies/%2F/p1")["definition"]["max-length"],
        5
    );
    assert_eq!(h.get_json("/api/queues/%2F/m.q")["policy"], "p1");
    assert_eq!(p.delete("/api/policies/%2F/p1").status, 204);
    assert_error(&p.get("/api/policies/%2F/p1"), 404);
}

#[tokio::test]
async fn guest_is_loopback_only_here_too() {
    // The test client is on loopback, so guest works (shown above); the
    // rule itself is the authenticator's, shared with AMQP and tested there.
    let b = Broker::start();
    assert_eq!(admin(&b).get_json("/api/whoami")["name"], "guest");
}

#[tokio::test]
async fn errors_404_400() {
    let b = Broker::start();
    let h = admin(&b);
    assert_error(&h.get("/api/nothing-here"), 404);
    assert_error(&h.get("/api/queues/%2F/missing"), 404);
    assert_error(&h.get("/api/queues/no-vhost"), 404);
    assert_error(&h.get("/api/exchanges/%2F/missing"), 404);
    assert_error(&h.delete("/api/queues/%2F/missing"), 404);
    assert_error(&h.get("/api/users/missing"), 404);
    assert_error(&h.get("/api/connections/missing"), 404);
    // Bad JSON, bad arguments, inequivalent redeclare, bad paging: 400.
    let r = h.request("PUT", "/api/queues/%2F/q", None, &[]);
    assert_eq!(
        r.status, 201,
        "an empty body declares with defaults: {}",
        r.text
    );
    let bad = h.send("PUT", "/api/queues/%2F/q2", "{not json", &[]);
    assert!(assert_error(&bad, 400)["reason"]
        .as_str()
        .unwrap()
        .contains("JSON"));
    let mut raw = Http::new(b.http_port(), "guest", "guest").post(
        "/api/queues/%2F/q/get",
        json!({"count": 1, "ackmode": "nonsense", "encoding": "auto"}),
    );
    assert!(assert_error(&raw, 400)["reason"]
        .as_str()
        .unwrap()
        .contains("ackmode"));
    raw = h.put("/api/queues/%2F/q", json!({"durable": false}));
    let v = assert_error(&raw, 400);
    assert!(
        v["reason"].as_str().unwrap().contains("inequivalent"),
        "{v}"
    );
    assert_error(
        &h.put(
            "/api/queues/%2F/bad",
            json!({"arguments": {"x-max-length": "ten"}}),
        ),
        400,
    );
    assert_error(&h.get("/api/queues?page=1&page_size=501"), 400);
    assert_error(&h.get("/api/queues?page=0"), 400);
    assert_error(&h.get("/api/queues?name=(&use_regex=true"), 400);
    assert_error(&h.put("/api/exchanges/%2F/x", json!({"type": "nope"})), 400);
    let r = h.request("PUT", "/api/exchanges/%2F/x", None, &[]);
    assert_error(&r, 400);
    assert_error(
        &h.post(
            "/api/exchanges/%2F/amq.default/publish",
            json!({"routing_key": "q", "payload": "!!", "payload_encoding": "base64"}),
        ),
        400,
    );
    // Reserved exchanges cannot be deleted.
    assert_error(&h.delete("/api/exchanges/%2F/amq.direct"), 403);
}

/// Publish 100, consume 50 with one channel, ack 40: ready 50, leased 10,
/// attempts right; then the channel closes and the 10 come back having
/// been delivered once.
#[tokio::test]
async fn figures_against_known_traffic() {
    let b = Broker::start();
    let h = admin(&b);
    assert_eq!(
        h.put("/api/queues/%2F/work", json!({"durable": true}))
            .status,
        201
    );
    let conn = connect(&b.url()).await;
    let pch = confirm_channel(&conn).await;
    for i in 0..100 {
        publish_confirmed(&pch, "", "work", format!("m{i}").as_bytes(), persistent()).await;
    }
    let q = h.get_json("/api/queues/%2F/work");
    assert_eq!(q["messages_ready"], 100);
    assert_eq!(q["message_stats"]["publish"], 100);
    assert_eq!(q["message_bytes_ready"], 290);
    let cch = conn.create_channel().await.unwrap();
    cch.basic_qos(50, BasicQosOptions::default()).await.unwrap();
    let mut consumer = consume(&cch, "work", "c1").await;
    let mut tags = Vec::new();
    for _ in 0..50 {
        tags.push(next_delivery(&mut consumer).await.delivery_tag);
    }
    // The consumer and its connection are listed.
    let cons = h.get_json("/api/consumers/%2F");
    assert_eq!(cons[0]["consumer_tag"], "c1");
    assert_eq!(cons[0]["prefetch_count"], 50);
    assert_eq!(cons[0]["queue"]["name"], "work");
    assert_eq!(h.get_json("/api/queues/%2F/work")["consumers"], 1);
    // Cancelled before acking (else the freed credit delivers more); its
    // 50 deliveries stay leased to the channel.
    cch.basic_cancel("c1".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    for t in &tags[..40] {
        cch.basic_ack(*t, BasicAckOptions::default()).await.unwrap();
    }
    // A synchronous method after the acks on the same channel: the broker
    // has processed them (frames are handled in order).
    queue_len(&cch, "work").await;
    let q = h.get_json("/api/queues/%2F/work");
    assert_eq!(q["messages_ready"], 50, "{q}");
    assert_eq!(q["messages_unacknowledged"], 10, "{q}");
    assert_eq!(q["messages"], 60);
    assert_eq!(q["consumers"], 0);
    assert_eq!(q["message_stats"]["deliver_get"], 50);
    assert_eq!(q["message_stats"]["ack"], 40);
    assert_eq!(q["message_stats"]["redeliver"], 0);
    // Every ready message is undelivered so far.
    assert_eq!(q["delivery_attempts"]["max"], 0);
    assert_eq!(q["delivery_attempts"]["histogram"][0]["count"], 50);
    let conns = h.get_json("/api/connections");
    assert_eq!(conns[0]["user"], "guest");
    assert_eq!(conns[0]["vhost"], "/");
    assert_eq!(conns[0]["channels"], 2);
    assert_eq!(h.get_json("/api/channels").as_array().unwrap().len(), 2);
    let o = h.get_json("/api/overview");
    assert_eq!(o["object_totals"]["connections"], 1);
    assert_eq!(o["queue_totals"]["messages_ready"], 50);

    // The channel closes: its 10 leases return, delivered once.
    cch.close(200, "bye".into()).await.unwrap();
    queue_len(&pch, "work").await;
    let q = h.get_json("/api/queues/%2F/work");
    assert_eq!(q["messages_ready"], 60, "{q}");
    assert_eq!(q["messages_unacknowledged"], 0);
    assert_eq!(q["delivery_attempts"]["max"], 1);
    assert_eq!(q["delivery_attempts"]["histogram"][0]["count"], 50);
    assert_eq!(q["delivery_attempts"]["histogram"][1]["count"], 10);
    let a = h.get_json("/api/queues/%2F/work/attempts");
    assert_eq!(a["delivery_attempts"], q["delivery_attempts"]);
    // Getting one of them again counts as a redelivery.
    let got = h.post(
        "/api/queues/%2F/work/get",
        json!({"count": 1, "ackmode": "ack_requeue_false", "encoding": "auto"}),
    );
    assert_eq!(got.status, 200);
    let got = got.json();
    assert_eq!(got[0]["redelivered"], true, "{got}");
    let q = h.get_json("/api/queues/%2F/work");
    assert_eq!(q["message_stats"]["redeliver"], 1);
    assert_eq!(q["messages_ready"], 59);
}

#[tokio::test]
async fn oldest_message_age_grows() {
    let b = Broker::start();
    let h = admin(&b);
    h.put("/api/queues/%2F/aged", json!({}));
    let q = h.get_json("/api/queues/%2F/aged");
    assert_eq!(q["oldest_message_age_ms"], 0);
    assert_eq!(q["head_message_timestamp"], Value::Null);
    let conn = connect(&b.url()).await;
    let ch = confirm_channel(&conn).await;
    publish_confirmed(&ch, "", "aged", b"first", BasicProperties::default()).await;
    let first = h.get_json("/api/queues/%2F/aged");
    let head = first["head_message_timestamp"].clone();
    assert!(head.as_u64().is_some(), "{first}");
    // A later message, published and confirmed after the first read: the
    // head stays the first message and its age does not go down.
    publish_confirmed(&ch, "", "aged", b"second", BasicProperties::default()).await;
    let second = h.get_json("/api/queues/%2F/aged");
    assert_eq!(second["head_message_timestamp"], head);
    let (a1, a2) = (
        first["oldest_message_age_ms"].as_u64().unwrap(),
        second["oldest_message_age_ms"].as_u64().unwrap(),
    );
    assert!(a2 >= a1, "age went down: {a1} then {a2}");
    // And it does grow (time passing is the event: bounded wait for it).
    eventually("the age to grow", Duration::from_secs(5), || {
        let a = h.get_json("/api/queues/%2F/aged")["oldest_message_age_ms"]
            .as_u64()
            .unwrap();
        (a > a1).then_some(())
    });
    assert_eq!(second["retention"]["messages"], 2);
    assert_eq!(second["retention"]["bytes"], 11);
}

#[tokio::test]
async fn rates_move_under_load() {
    let b = Broker::start();
    let h = admin(&b);
    h.put("/api/queues/%2F/busy", json!({}));
    // Starts the sampler.
    let q = h.get_json("/api/queues/%2F/busy");
    assert_eq!(q["message_stats"]["publish_details"]["rate"], 0.0);
    assert_eq!(q["messages_details"]["rate"], 0.0);
    assert!(q["latency_ms"].is_null(), "nothing delivered yet: {q}");
    let conn = connect(&b.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publisher = {
        let (ch, stop) = (ch.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = ch
                    .basic_publish(
                        "".into(),
                        "busy".into(),
                        BasicPublishOptions::default(),
                        b"x",
                        BasicProperties::default(),
                    )
                    .await;
                tokio::task::yield_now().await;
            }
        })
    };
    // Published and not consumed: the publish rate and the depth's rate
    // of change both move up.
    let rate = {
        let h = h.clone();
        tokio::task::spawn_blocking(move || {
            eventually("a publish rate", Duration::from_secs(30), || {
                let q = h.get_json("/api/queues/%2F/busy");
                let r = q["message_stats"]["publish_details"]["rate"]
                    .as_f64()
                    .unwrap();
                let growth = q["messages_details"]["rate"].as_f64().unwrap();
                let o = h.get_json("/api/overview");
                let total = o["message_stats"]["publish_details"]["rate"]
                    .as_f64()
                    .unwrap();
                let total_growth = o["queue_totals"]["messages_details"]["rate"]
                    .as_f64()
                    .unwrap();
                (r > 0.0 && total > 0.0 && growth > 0.0 && total_growth > 0.0).then_some(r)
            })
        })
        .await
        .unwrap()
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    publisher.await.unwrap();
    assert!(rate > 0.0);
    // Consumed: the depth falls, and the delivered messages had waited
    // (the mean wait in the queue is reported once deliveries happen).
    let mut consumer = ch
        .basic_consume(
            "busy".into(),
            "drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .unwrap();
    let drain = tokio::spawn(async move { while let Some(Ok(_)) = consumer.next().await {} });
    tokio::task::spawn_blocking(move || {
        let (mut drained, mut waited) = (false, false);
        eventually(
            "a falling depth and a latency",
            Duration::from_secs(30),
            || {
                let q = h.get_json("/api/queues/%2F/busy");
                drained |= q["messages_details"]["rate"].as_f64().unwrap() < 0.0;
                waited |= q["latency_ms"].as_f64().is_some_and(|l| l > 0.0)
                    && h.get_json("/api/overview")["latency_ms"]
                        .as_f64()
                        .is_some_and(|l| l > 0.0);
                (drained && waited).then_some(())
            },
        )
    })
    .await
    .unwrap();
    drain.abort();
}

#[tokio::test]
async fn queue_get_purge_delete() {
    let b = Broker::start();
    let h = admin(&b);
    assert_eq!(
        h.put(
            "/api/queues/%2F/g",
            json!({"durable": false, "auto_delete": false, "arguments": {"x-max-length": 100}})
        )
        .status,
        201
    );
    assert_eq!(
        h.put(
            "/api/queues/%2F/g",
            json!({"durable": false, "arguments": {"x-max-length": 100}})
        )
        .status,
        204
    );
    for i in 0..3 {
        let r = h.post(
            "/api/exchanges/%2F/amq.default/publish",
            json!({"routing_key": "g", "payload": format!("hello-{i}"), "payload_encoding": "string",
                   "properties": {"delivery_mode": 1, "headers": {"k": "v"}, "content_type": "text/plain"}}),
        );
        assert_eq!(r.json(), json!({"routed": true}));
    }
    let r = h.post(
        "/api/exchanges/%2F/amq.default/publish",
        json!({"routing_key": "nowhere", "payload": "x", "payload_encoding": "string", "properties": {}}),
    );
    assert_eq!(r.json(), json!({"routed": false}));
    // Peek: requeued, so still there, now redelivered.
    let got = h
        .post(
            "/api/queues/%2F/g/get",
            json!({"count": 2, "ackmode": "ack_requeue_true", "encoding": "auto", "truncate": 3}),
        )
        .json();
    assert_eq!(got.as_array().unwrap().len(), 2);
    assert_eq!(got[0]["payload"], "hel");
    assert_eq!(got[0]["payload_bytes"], 7);
    assert_eq!(got[0]["payload_encoding"], "string");
    assert_eq!(got[0]["properties"]["headers"]["k"], "v");
    assert_eq!(got[0]["properties"]["content_type"], "text/plain");
    assert_eq!(got[0]["message_count"], 2);
    assert_eq!(h.get_json("/api/queues/%2F/g")["messages"], 3);
    let got = h
        .post(
            "/api/queues/%2F/g/get",
            json!({"count": 1, "ackmode": "reject_requeue_false", "encoding": "base64"}),
        )
        .json();
    assert_eq!(got[0]["payload_encoding"], "base64");
    assert_eq!(got[0]["payload"], "aGVsbG8tMA==");
    assert_eq!(got[0]["redelivered"], true);
    assert_eq!(h.get_json("/api/queues/%2F/g")["messages"], 2);
    // The queue's bindings: the default exchange's.
    let bs = h.get_json("/api/queues/%2F/g/bindings");
    assert_eq!(bs[0]["source"], "");
    assert_eq!(bs[0]["routing_key"], "g");
    // Purge.
    assert_eq!(h.delete("/api/queues/%2F/g/contents").status, 204);
    assert_eq!(h.get_json("/api/queues/%2F/g")["messages"], 0);
    // if-empty / if-unused.
    h.post(
        "/api/exchanges/%2F/amq.default/publish",
        json!({"routing_key": "g", "payload": "x", "payload_encoding": "string"}),
    );
    assert_error(&h.delete("/api/queues/%2F/g?if-empty=true"), 400);
    assert_eq!(h.delete("/api/queues/%2F/g").status, 204);
    assert_error(&h.get("/api/queues/%2F/g"), 404);
}

#[tokio::test]
async fn listing_pagination_filter_sort() {
    let b = Broker::start();
    let h = admin(&b);
    for i in 0..25 {
        assert_eq!(
            h.put(&format!("/api/queues/%2F/list-{i:02}"), json!({}))
                .status,
            201
        );
    }
    h.put("/api/queues/%2F/other", json!({}));
    h.post(
        "/api/exchanges/%2F/amq.default/publish",
        json!({"routing_key": "list-07", "payload": "x", "payload_encoding": "string"}),
    );
    let all = h.get_json("/api/queues");
    assert_eq!(all.as_array().unwrap().len(), 26);
    let p = h.get_json("/api/queues?page=2&page_size=10");
    assert_eq!(p["page"], 2);
    assert_eq!(p["page_size"], 10);
    assert_eq!(p["page_count"], 3);
    assert_eq!(p["total_count"], 26);
    assert_eq!(p["filtered_count"], 26);
    assert_eq!(p["item_count"], 10);
    assert_eq!(p["items"][0]["name"], "list-10");
    let f = h.get_json("/api/queues/%2F?page=1&page_size=100&name=list-1");
    assert_eq!(f["filtered_count"], 10);
    let r = h.get_json("/api/queues?page=1&page_size=5&name=%5Elist-0%5B12%5D%24&use_regex=true");
    assert_eq!(r["filtered_count"], 2, "{r}");
    let s = h.get_json("/api/queues?page=1&page_size=1&sort=messages&sort_reverse=true");
    assert_eq!(s["items"][0]["name"], "list-07");
    let s = h.get_json("/api/queues?sort=name&sort_reverse=true&columns=name,messages");
    assert_eq!(s[0], json!({"name": "other", "messages": 0}));
    // Sorting on a rendered field works too.
    let s = h.get_json("/api/queues?page=1&page_size=1&sort=message_bytes&sort_reverse=true");
    assert_eq!(s["items"][0]["name"], "list-07");
    assert_error(&h.get("/api/queues?page=9&page_size=10"), 400);
    // Exchanges and vhosts paginate the same way.
    let x = h.get_json("/api/exchanges?page=1&page_size=2");
    assert_eq!(x["items"][0]["name"], "");
    assert_eq!(x["total_count"], 6);
}

#[tokio::test]
async fn exchanges_and_bindings() {
    let b = Broker::start();
    let h = admin(&b);
    assert_eq!(
        h.put(
            "/api/exchanges/%2F/ex",
            json!({"type": "topic", "durable": true})
        )
        .status,
        201
    );
    assert_eq!(
        h.put("/api/exchanges/%2F/ex2", json!({"type": "fanout"}))
            .status,
        201
    );
    let x = h.get_json("/api/exchanges/%2F/ex");
    assert_eq!(x["type"], "topic");
    assert_eq!(x["durable"], true);
    h.put("/api/queues/%2F/bq", json!({}));
    let r = h.post(
        "/api/bindings/%2F/e/ex/q/bq",
        json!({"routing_key": "a.*", "arguments": {}}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let loc = r.header("location").unwrap().to_string();
    assert_eq!(loc, "a.%2A");
    let r = h.post("/api/bindings/%2F/e/ex/e/ex2", json!({"routing_key": "#"}));
    assert_eq!(r.status, 201);
    let between = h.get_json("/api/bindings/%2F/e/ex/q/bq");
    assert_eq!(between[0]["routing_key"], "a.*");
    let one = h.get_json(&format!(
        "/api/bindings/%2F/e/ex/q/bq/{}",
        loc.replace('%', "%25")
    ));
    assert_eq!(one["destination"], "bq");
    assert_eq!(h.get_json("/api/bindings/%2F").as_array().unwrap().len(), 2);
    assert_eq!(
        h.get_json("/api/exchanges/%2F/ex/bindings/source")
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        h.get_json("/api/exchanges/%2F/ex2/bindings/destination")
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(h.get_json("/api/bindings").as_array().unwrap().len(), 2);
    // Routed through the binding.
    let r = h.post("/api/exchanges/%2F/ex/publish", json!({"routing_key": "a.b", "payload": "p", "payload_encoding": "string", "properties": {}}));
    assert_eq!(r.json()["routed"], true);
    assert_eq!(h.get_json("/api/queues/%2F/bq")["messages"], 1);
    let r = h.post(
        "/api/exchanges/%2F/ex/publish",
        json!({"routing_key": "b", "payload": "p", "payload_encoding": "string", "properties": {}}),
    );
    assert_eq!(r.json()["routed"], false);
    assert_error(
        &h.post(
            "/api/bindings/%2F/e/ex/q/missing",
            json!({"routing_key": "k"}),
        ),
        404,
    );
    assert_error(&h.get("/api/bindings/%2F/e/ex/q/bq/nope"), 404);
    assert_eq!(
        h.delete(&format!(
            "/api/bindings/%2F/e/ex/q/bq/{}",
            loc.replace('%', "%25")
        ))
        .status,
        204
    );
    assert_eq!(h.get_json("/api/bindings/%2F/e/ex/q/bq"), json!([]));
    assert_eq!(h.delete("/api/exchanges/%2F/ex").status, 204);
    assert_error(&h.get("/api/exchanges/%2F/ex"), 404);
}

#[tokio::test]
async fn vhosts_users_permissions_persist() {
    let mut b = Broker::start();
    let h = admin(&b);
    assert_eq!(h.put("/api/vhosts/tenant-a", json!({})).status, 201);
    assert_eq!(h.put("/api/vhosts/tenant-a", json!({})).status, 204);
    add_user(&h, "alice", "management", false);
    assert_eq!(
        h.put(
            "/api/users/alice",
            json!({"password": "pw2", "tags": "monitoring,management"})
        )
        .status,
        204
    );
    assert_eq!(
        h.put(
            "/api/permissions/tenant-a/alice",
            json!({"configure": ".*", "write": ".*", "read": ".*"})
        )
        .status,
        201
    );
    assert_eq!(
        h.put(
            "/api/topic-permissions/tenant-a/alice",
            json!({"exchange": "amq.topic", "write": "^a", "read": ".*"})
        )
        .status,
        201
    );
    assert_error(
        &h.put(
            "/api/permissions/nope/alice",
            json!({"configure": ".*", "write": ".*", "read": ".*"}),
        ),
        400,
    );
    h.put("/api/queues/tenant-a/kept", json!({"durable": true}));
    b.stop();
    b.restart();
    let h = admin(&b);
    let v = h.get_json("/api/vhosts/tenant-a");
    assert_eq!(v["name"], "tenant-a");
    let u = h.get_json("/api/users/alice");
    assert_eq!(u["tags"], json!(["monitoring", "management"]));
    assert!(u["password_hash"]
        .as_str()
        .unwrap()
        .starts_with("$argon2id$"));
    let p = h.get_json("/api/permissions/tenant-a/alice");
    assert_eq!(p["configure"], ".*");
    assert_eq!(
        h.get_json("/api/topic-permissions/tenant-a/alice")[0]["write"],
        "^a"
    );
    assert_eq!(
        h.get_json("/api/users/alice/permissions")[0]["vhost"],
        "tenant-a"
    );
    assert_eq!(
        h.get_json("/api/vhosts/tenant-a/permissions")
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert!(h.get_json("/api/permissions").as_array().unwrap().len() >= 3);
    assert!(!h
        .get_json("/api/topic-permissions")
        .as_array()
        .unwrap()
        .is_empty());
    // The new password works, over AMQP too.
    let alice = h.as_user("alice", "pw2");
    assert_eq!(alice.get_json("/api/whoami")["name"], "alice");
    let conn = connect(&b.url_with("alice", "pw2", "tenant-a")).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(queue_len(&ch, "kept").await, 0);
    // Deleting the vhost closes its connections and removes everything.
    assert_eq!(h.delete("/api/vhosts/tenant-a").status, 204);
    within("the connection to close", async {
        while conn.status().connected() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_error(&h.get("/api/vhosts/tenant-a"), 404);
    assert_error(&h.get("/api/permissions/tenant-a/alice"), 404);
    assert_error(&h.delete("/api/vhosts/tenant-a"), 404);
    b.stop();
    b.restart();
    let h = admin(&b);
    assert_error(&h.get("/api/vhosts/tenant-a"), 404);
    // Users: delete, 404 after.
    assert_eq!(h.delete("/api/users/alice").status, 204);
    assert_error(&h.delete("/api/users/alice"), 404);
    assert_error(
        &h.put(
            "/api/users/bob",
            json!({"password_hash": "not-argon", "tags": ""}),
        ),
        400,
    );
    assert_error(&h.put("/api/users/bob", json!({"tags": ""})), 400);
    assert!(h.get_json("/api/users/without-permissions").is_array());
}

#[tokio::test]
async fn close_connection_with_reason() {
    let b = Broker::start();
    let h = admin(&b);
    let conn = connect(&b.url()).await;
    let _ch = conn.create_channel().await.unwrap();
    let mut events = error_events(&conn);
    let list = h.get_json("/api/connections");
    let name = list[0]["name"].as_str().unwrap().to_string();
    assert_eq!(list[0]["protocol"], "AMQP 0-9-1");
    let enc: String = name
        .bytes()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == b'.' {
                (c as char).to_string()
            } else {
                format!("%{c:02X}")
            }
        })
        .collect();
    assert_eq!(h.get_json(&format!("/api/connections/{enc}"))["name"], name);
    assert_eq!(
        h.get_json(&format!("/api/connections/{enc}/channels"))
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        h.get_json("/api/vhosts/%2F/connections")
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let r = h.request(
        "DELETE",
        &format!("/api/connections/{enc}"),
        None,
        &[("X-Reason", "maintenance window")],
    );
    assert_eq!(r.status, 204, "{}", r.text);
    // 320 CONNECTION_FORCED with the X-Reason text.
    let text = loop {
        match within("the close", events.next()).await {
            Some(lapin::Event::Error(e)) => {
                assert_eq!(reply_code(&e), Some(320), "{e:?}");
                break format!("{e:?}");
            }
            Some(_) => continue,
            None => panic!("event stream ended"),
        }
    };
    assert!(text.contains("maintenance window"), "{text}");
    within("the connection to be gone from the list", async {
        while !h
            .get_json("/api/connections")
            .as_array()
            .unwrap()
            .is_empty()
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn definitions_export_import() {
    let b = Broker::start();
    let h = admin(&b);
    h.put("/api/vhosts/dv", json!({}));
    h.put("/api/exchanges/dv/dx", json!({"type": "direct"}));
    h.put(
        "/api/queues/dv/dq",
        json!({"durable": true, "arguments": {"x-max-length": 10}}),
    );
    h.post("/api/bindings/dv/e/dx/q/dq", json!({"routing_key": "k"}));
    h.put(
        "/api/policies/dv/dp",
        json!({"pattern": "^dq$", "definition": {"message-ttl": 1000}}),
    );
    let d = h.get_json("/api/definitions");
    assert!(d["queues"]
        .as_array()
        .unwrap()
        .iter()
        .any(|q| q["name"] == "dq"));
    assert!(d["vhosts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["name"] == "dv"));
    let one = h.get_json("/api/definitions/dv");
    assert_eq!(one["exchanges"][0]["name"], "dx");

    // Into a fresh broker, plus a RabbitMQ-style user whose hash Weir
    // cannot verify (skipped and named).
    let b2 = Broker::start();
    let h2 = admin(&b2);
    let mut d2 = d.clone();
    d2["users"].as_array_mut().unwrap().push(json!({
        "name": "rabbit-user", "password_hash": "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR",
        "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["management"], "limits": {}
    }));
    let r = h2.post("/api/definitions", d2);
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["skipped_users"], json!(["rabbit-user"]));
    assert_eq!(
        h2.get_json("/api/queues/dv/dq")["arguments"]["x-max-length"],
        10
    );
    assert_eq!(h2.get_json("/api/queues/dv/dq")["policy"], "dp");
    assert_eq!(
        h2.get_json("/api/bindings/dv/e/dx/q/dq")[0]["routing_key"],
        "k"
    );
    // A vhost-scoped import.
    let r = h2.post("/api/definitions/dv", json!({"queues": [{"name": "dq2", "durable": true, "auto_delete": false, "arguments": {}}]}));
    assert_eq!(r.status, 204, "{}", r.text);
    assert_eq!(h2.get_json("/api/queues/dv/dq2")["durable"], true);
    assert_error(
        &h2.post(
            "/api/definitions",
            json!({"queues": [{"vhost": "nope", "name": "x"}]}),
        ),
        400,
    );
}

#[tokio::test]
async fn health_aliveness_overview() {
    let b = Broker::start();
    let h = admin(&b);
    assert_eq!(h.get_json("/api/health/checks/alarms")["status"], "ok");
    assert_eq!(h.get_json("/api/aliveness-test/%2F")["status"], "ok");
    assert_error(&h.get("/api/aliveness-test/none"), 404);
    let o = h.get_json("/api/overview");
    assert_eq!(o["product_name"], "Weir");
    assert!(o["object_totals"]["queues"].as_u64().unwrap() >= 1);
    assert_eq!(h.get_json("/api/operator-policies"), json!([]));
}

/// Weir's own: dead letters go back to the queue they came from.
#[tokio::test]
async fn requeue_dead_letters() {
    let b = Broker::start();
    let h = admin(&b);
    h.put("/api/exchanges/%2F/dlx", json!({"type": "fanout"}));
    h.put("/api/queues/%2F/dlq", json!({}));
    h.post("/api/bindings/%2F/e/dlx/q/dlq", json!({"routing_key": ""}));
    h.put(
        "/api/queues/%2F/src",
        json!({"arguments": {"x-dead-letter-exchange": "dlx"}}),
    );
    h.put("/api/queues/%2F/unrelated", json!({}));
    let conn = connect(&b.url()).await;
    let ch = confirm_channel(&conn).await;
    for i in 0..5 {
        publish_confirmed(
            &ch,
            "",
            "src",
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    // One message in the DLQ that did not come from a dead-lettering.
    publish_confirmed(&ch, "", "dlq", b"stray", BasicProperties::default()).await;
    let c = conn.create_channel().await.unwrap();
    let mut consumer = consume(&c, "src", "rej").await;
    for _ in 0..5 {
        let d = next_delivery(&mut consumer).await;
        c.basic_reject(d.delivery_tag, BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    c.basic_cancel("rej".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    let dl = eventually("5 dead letters", Duration::from_secs(10), || {
        let q = h.get_json("/api/queues/%2F/dlq");
        (q["messages"] == 6).then_some(q)
    });
    assert_eq!(dl["messages"], 6);
    let src = h.get_json("/api/queues/%2F/src");
    assert_eq!(src["message_stats"]["dead_lettered"], 5);
    let r = h.post("/api/queues/%2F/dlq/requeue-dead-letters", json!({}));
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json(), json!({"moved": 5, "kept": 1}));
    assert_eq!(h.get_json("/api/queues/%2F/src")["messages"], 5);
    assert_eq!(h.get_json("/api/queues/%2F/dlq")["messages"], 1);
    let got = h
        .post(
            "/api/queues/%2F/src/get",
            json!({"count": 1, "ackmode": "ack_requeue_true", "encoding": "auto"}),
        )
        .json();
    assert!(
        got[0]["properties"]["headers"]["x-death"].is_array(),
        "{got}"
    );
}

/// A dead-letter queue larger than one batch (1,000) moves in batches; a
/// message that stays (the stray one, first in line) stays leased across
/// batches, so no later batch takes it again and the answer counts it once.
#[tokio::test]
async fn requeue_dead_letters_in_batches() {
    const N: usize = 1_100;
    let b = Broker::start();
    let h = admin(&b);
    h.put("/api/exchanges/%2F/dlx", json!({"type": "fanout"}));
    h.put("/api/queues/%2F/dlq", json!({}));
    h.post("/api/bindings/%2F/e/dlx/q/dlq", json!({"routing_key": ""}));
    // Every message dead-letters at once (length limit 0, drop-head).
    h.put(
        "/api/queues/%2F/src",
        json!({"arguments": {"x-dead-letter-exchange": "dlx", "x-max-length": 0}}),
    );
    let conn = connect(&b.url()).await;
    let ch = confirm_channel(&conn).await;
    publish_confirmed(&ch, "", "dlq", b"stray", BasicProperties::default()).await;
    let mut confirms = Vec::with_capacity(N);
    for i in 0..N {
        confirms.push(
            ch.basic_publish(
                "".into(),
                "src".into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        c.await.unwrap();
    }
    eventually("the dead letters", Duration::from_secs(30), || {
        (h.get_json("/api/queues/%2F/dlq")["messages"] == N + 1).then_some(())
    });
    // The source again, without its limit, for the letters to go back to.
    assert_eq!(h.delete("/api/queues/%2F/src").status, 204);
    h.put("/api/queues/%2F/src", json!({}));
    let r = h.post("/api/queues/%2F/dlq/requeue-dead-letters", json!({}));
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json(), json!({"moved": N, "kept": 1}));
    assert_eq!(h.get_json("/api/queues/%2F/src")["messages"], N);
    assert_eq!(h.get_json("/api/queues/%2F/dlq")["messages"], 1);
}

/// A get stops once the payloads it took reach 16 MiB, whatever `count`
/// asks: the answer is built in memory.
#[tokio::test]
async fn get_is_bounded_by_bytes() {
    let b = Broker::start();
    let h = admin(&b);
    h.put("/api/queues/%2F/big", json!({}));
    let conn = connect(&b.url()).await;
    let ch = confirm_channel(&conn).await;
    let body = vec![b'x'; 6 << 20];
    for _ in 0..4 {
        publish_confirmed(&ch, "", "big", &body, BasicProperties::default()).await;
    }
    let got = h.post(
        "/api/queues/%2F/big/get",
        json!({"count": 4, "ackmode": "ack_requeue_true", "encoding": "auto"}),
    );
    assert_eq!(got.status, 200, "{}", got.text);
    // 6 + 6 MiB is under the bound, the third reaches it: three of four.
    assert_eq!(got.json().as_array().unwrap().len(), 3);
    assert_eq!(h.get_json("/api/queues/%2F/big")["messages"], 4);
}

/// `/api/connections` shows what clients say about themselves (AMQP
/// start-ok client properties and `connection_name`, the MQTT client id and
/// protocol version) and each connection's traffic, which sessions add once
/// per batch; `/api/channels` and friends list the open channel numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_show_client_properties_and_traffic() {
    const N: u64 = 25;
    let b = Broker::start_mqtt_with(&[]);
    assert!(
        b.wait_for_log("MQTT listener ready", START_TIMEOUT),
        "{}",
        b.run_logs()
    );
    let h = admin(&b);
    let props = lapin::ConnectionProperties::default()
        .with_connection_name("orders-api".into())
        .with_client_property("product".into(), "weir-test-suite".into())
        .with_client_property("version".into(), "1.2.3".into())
        .with_client_property("information".into(), "https://example.org".into())
        // Longer than the 1 KiB kept per string: left out.
        .with_client_property("blob".into(), "x".repeat(2000).into());
    let conn = within("connect", lapin::Connection::connect(&b.url(), props))
        .await
        .expect("connect");
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "traffic").await;
    // Each publish waits for its confirm, so each is at least one socket
    // read by the broker and one write back: recv_cnt and send_cnt (socket
    // reads and writes, as RabbitMQ counts packets) reach N.
    let body = [7u8; 100];
    for _ in 0..N {
        publish_confirmed(&ch, "", "traffic", &body, BasicProperties::default()).await;
    }
    let named = |list: &Value| {
        list.as_array()?
            .iter()
            .find(|c| c["user_provided_name"] == "orders-api")
            .cloned()
    };
    // The last batch's counts are added after its confirms are written:
    // wait for them, bounded.
    let c = eventually("the publishes in the traffic counters", OP_TIMEOUT, || {
        let c = named(&h.get_json("/api/connections"))?;
        (c["recv_cnt"].as_u64()? >= N && c["send_cnt"].as_u64()? >= N).then_some(c)
    });
    let cp = &c["client_properties"];
    assert_eq!(cp["connection_name"], "orders-api", "{c}");
    assert_eq!(cp["product"], "weir-test-suite", "{c}");
    assert_eq!(cp["version"], "1.2.3", "{c}");
    assert_eq!(cp["platform"], "rust", "{c}");
    assert_eq!(cp["information"], "https://example.org", "{c}");
    // Nested tables render as objects, as RabbitMQ renders field tables.
    assert_eq!(cp["capabilities"]["publisher_confirms"], true, "{c}");
    assert!(cp.get("blob").is_none(), "a 2 KB property is not kept: {c}");
    assert_eq!(c["protocol"], "AMQP 0-9-1");
    // N bodies of 100 bytes at least, plus the frames around them.
    assert!(c["recv_oct"].as_u64().unwrap() > N * 100, "{c}");
    assert!(c["send_oct"].as_u64().unwrap() > 0, "{c}");
    assert!(c["recv_oct_details"]["rate"].as_f64().is_some(), "{c}");
    assert!(c["send_oct_details"]["rate"].as_f64().is_some(), "{c}");

    // The same on the connection's own page, and its channel.
    let name = c["name"].as_str().unwrap().to_string();
    let one = h.get_json(&format!("/api/connections/{}", pct(&name)));
    assert_eq!(one["client_properties"]["product"], "weir-test-suite");
    assert!(one["recv_oct"].as_u64().unwrap() >= c["recv_oct"].as_u64().unwrap());
    let chans = h.get_json(&format!("/api/connections/{}/channels", pct(&name)));
    assert_eq!(chans.as_array().map(Vec::len), Some(1), "{chans}");
    let ch_name = format!("{name} ({})", ch.id());
    assert_eq!(chans[0]["name"], ch_name.as_str(), "{chans}");
    assert_eq!(chans[0]["number"], ch.id(), "{chans}");
    assert_eq!(chans[0]["connection_details"]["name"], name.as_str());
    assert_eq!(
        h.get_json(&format!("/api/channels/{}", pct(&ch_name)))["number"],
        ch.id()
    );
    assert_error(
        &h.get(&format!("/api/channels/{}", pct(&format!("{name} (999)")))),
        404,
    );
    assert_eq!(
        h.get_json("/api/vhosts/%2F/channels")[0]["name"],
        ch_name.as_str()
    );

    // MQTT: the client id and the protocol version.
    let mut o = rumqttc::MqttOptions::new("sensor-17", "127.0.0.1", b.mqtt_port());
    o.set_credentials("guest", "guest");
    let (client, mut eventloop) = rumqttc::AsyncClient::new(o, 10);
    within("MQTT CONNACK", async {
        loop {
            match eventloop.poll().await {
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_))) => break,
                Ok(_) => {}
                Err(e) => panic!("MQTT connect: {e}"),
            }
        }
    })
    .await;
    let m = eventually("the MQTT connection's CONNECT counted", OP_TIMEOUT, || {
        let list = h.get_json("/api/connections");
        let m = list
            .as_array()?
            .iter()
            .find(|c| c["client_properties"]["client_id"] == "sensor-17")?
            .clone();
        (m["recv_oct"].as_u64()? > 0).then_some(m)
    });
    assert_eq!(m["protocol"], "MQTT 3.1.1", "{m}");
    assert!(m.get("user_provided_name").is_none(), "{m}");
    assert_eq!(m["channels"], 1, "{m}");
    drop(client);
    conn.close(200, "bye".into()).await.unwrap();
}

/// Percent-encodes a connection or channel name for a path segment.
fn pct(s: &str) -> String {
    s.bytes()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == b'.' {
                (c as char).to_string()
            } else {
                format!("%{c:02X}")
            }
        })
        .collect()
}
