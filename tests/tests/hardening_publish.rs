//! Issue 20, items 4, 7 (second half) and 9 (import), against the real
//! binary:
//!
//! * one door for publishing: `POST /api/exchanges/…/publish` obeys the
//!   memory and disk alarms (503) and the tenant's `publish-rate` and
//!   `max-queued-messages` (429), like AMQP and MQTT publishers;
//! * definitions have size limits: oversized arguments are 406 over AMQP
//!   and 400 over HTTP, as are long names and policy definitions;
//! * a definitions import is all or nothing across `kill -9`, and 20,000
//!   items import in one store batch (the time is printed).

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use serde_json::{json, Value};
use std::io::Write;
use std::time::{Duration, Instant};
use weir_tests::hardening::wait_until;
use weir_tests::http::Http;
use weir_tests::*;

fn http(b: &Broker) -> Http {
    Http::new(b.http_port(), "guest", "guest")
}

/// A broker whose configuration file is `toml`, with `guest` an
/// administrator with every permission on `/` and the file's tenants.
fn start_with_config(toml: &str) -> (Broker, tempfile::TempDir) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("weir.toml");
    let mut vhosts = vec!["/".to_string()];
    let mut lines = toml.lines();
    while let Some(l) = lines.next() {
        if l.trim() == "[[tenants]]" {
            if let Some(n) = lines.next().and_then(|n| n.split('"').nth(1)) {
                vhosts.push(n.to_string());
            }
        }
    }
    let perms: Vec<String> = vhosts
        .iter()
        .map(|v| {
            format!("{{ vhost = \"{v}\", configure = \".*\", write = \".*\", read = \".*\" }}")
        })
        .collect();
    let toml = format!(
        "{toml}\n[[auth.users]]\nname = \"guest\"\npassword = \"guest\"\ntags = [\"administrator\"]\npermissions = [{}]\n",
        perms.join(", ")
    );
    std::fs::write(&file, toml).expect("config file");
    let b = Broker::start_with(&["--config", file.to_str().expect("utf-8 path")]);
    (b, tmp)
}

fn publish_body(key: &str) -> Value {
    json!({"properties": {"delivery_mode": 2}, "routing_key": key, "payload": "hello", "payload_encoding": "string"})
}

fn depth(h: &Http, vhost: &str, q: &str) -> u64 {
    h.get_json(&format!("/api/queues/{vhost}/{q}"))["messages"]
        .as_u64()
        .unwrap_or(0)
}

/// Waits until `/api/health/checks/alarms` reports an alarm.
async fn wait_for_alarm(h: &Http) {
    wait_until("the resource alarm", OP_TIMEOUT, || async {
        h.get("/api/health/checks/alarms").status != 200
    })
    .await;
}

/// Under a resource alarm an HTTP publish is refused with 503 and a JSON
/// reason, as AMQP and MQTT publishers are blocked, and nothing is queued.
async fn refused_under_alarm(args: &[&str], word: &str) {
    let b = Broker::start_with(args);
    let h = http(&b);
    assert_eq!(
        h.put("/api/queues/%2F/alarmed", json!({"durable": true}))
            .status,
        201
    );
    wait_for_alarm(&h).await;
    let r = h.post(
        "/api/exchanges/%2F/amq.default/publish",
        publish_body("alarmed"),
    );
    assert_eq!(r.status, 503, "publish under the {word} alarm: {}", r.text);
    let reason = r.json()["reason"].as_str().unwrap_or_default().to_string();
    assert!(reason.contains(word), "reason: {reason}");
    assert_eq!(depth(&h, "%2F", "alarmed"), 0, "the message was queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_publish_is_refused_under_the_disk_alarm() {
    refused_under_alarm(&["--disk-free-limit", "1PB"], "disk").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_publish_is_refused_under_the_memory_alarm() {
    refused_under_alarm(&["--memory-limit", "1MB"], "memory").await;
}

/// The tenant's publish rate holds over HTTP: beyond it, 429 with a reason
/// and `Retry-After`, and no more accepted than the rate allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_publish_obeys_the_tenant_publish_rate() {
    let (b, _tmp) = start_with_config("[[tenants]]\nname = \"a\"\npublish-rate = 10\n");
    let h = http(&b);
    assert_eq!(h.put("/api/queues/a/paced", json!({})).status, 201);
    let started = Instant::now();
    let (mut ok, mut refused) = (0u64, None);
    for _ in 0..60 {
        let r = h.post(
            "/api/exchanges/a/amq.default/publish",
            publish_body("paced"),
        );
        match r.status {
            200 => ok += 1,
            429 => refused = Some(r),
            s => panic!("publish: {s} {}", r.text),
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let r = refused.expect("no publish was refused over the rate");
    assert!(r.header("retry-after").is_some(), "no Retry-After");
    let reason = r.json()["reason"].as_str().unwrap_or_default().to_string();
    assert!(reason.contains("publish rate"), "reason: {reason}");
    // A second's burst plus the rate over the time taken (generous).
    let allowed = 10.0 * (elapsed + 1.0) + 1.0;
    assert!(
        (ok as f64) <= allowed,
        "{ok} accepted in {elapsed:.2} s at 10/s"
    );
    assert_eq!(depth(&h, "a", "paced"), ok);
}

/// At the tenant's `max-queued-messages` an HTTP publish is refused with
/// 429: the queue holds the quota, not more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_publish_stops_at_max_queued_messages() {
    let (b, _tmp) = start_with_config("[[tenants]]\nname = \"b\"\nmax-queued-messages = 100\n");
    let h = http(&b);
    assert_eq!(h.put("/api/queues/b/full", json!({})).status, 201);
    let mut ok = 0;
    let mut last = None;
    for _ in 0..150 {
        let r = h.post("/api/exchanges/b/amq.default/publish", publish_body("full"));
        match r.status {
            200 => ok += 1,
            429 => last = Some(r),
            s => panic!("publish: {s} {}", r.text),
        }
    }
    assert_eq!(ok, 100, "accepted beyond the quota");
    let reason = last.expect("refused").json()["reason"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(reason.contains("queued messages quota"), "reason: {reason}");
    assert_eq!(depth(&h, "b", "full"), 100);
}

/// Arguments beyond the size limit are refused over AMQP (406) and HTTP
/// (400), as are long names and oversized policy definitions; the broker
/// keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_definitions_are_refused() {
    let b = Broker::start();
    let big = "a".repeat(20_000);
    // AMQP: a 20 KB argument table fits a frame but not the limit.
    let conn = connect(&b.url()).await;
    let ch = conn.create_channel().await.expect("channel");
    let mut args = FieldTable::default();
    args.insert(
        "x-big".into(),
        AMQPValue::LongString(LongString::from(big.clone())),
    );
    let r = ch
        .queue_declare(
            "big-args".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await;
    assert_code(r, 406);
    // HTTP: 400 with the reason, for arguments, names, bindings, policies.
    let h = http(&b);
    let r = h.put(
        "/api/queues/%2F/big-args",
        json!({"arguments": {"x-big": big}}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("arguments"), "{}", r.text);
    let r = h.put(
        "/api/exchanges/%2F/big-x",
        json!({"type": "direct", "arguments": {"x-big": big}}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    let long = "n".repeat(300);
    let r = h.put(&format!("/api/queues/%2F/{long}"), json!({}));
    assert_eq!(r.status, 400, "{}", r.text);
    let r = h.put(
        "/api/policies/%2F/big-policy",
        json!({"pattern": ".*", "definition": {"x-big": big}}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(h.put("/api/queues/%2F/small", json!({})).status, 201);
    let r = h.post(
        "/api/bindings/%2F/e/amq.direct/q/small",
        json!({"routing_key": "k", "arguments": {"x-big": big}}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    let names: Vec<String> = h
        .get_json("/api/queues/%2F")
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|q| q["name"].as_str().map(str::to_string))
        .collect();
    assert_eq!(names, vec!["small".to_string()]);
}

/// A definitions document of `n` queues, each bound to one exchange.
fn document(n: usize) -> String {
    let queues: Vec<Value> = (0..n)
        .map(|i| json!({"name": format!("imp-{i}"), "vhost": "/", "durable": true, "auto_delete": false, "arguments": {}}))
        .collect();
    let bindings: Vec<Value> = (0..n)
        .map(|i| json!({"source": "imp-x", "vhost": "/", "destination": format!("imp-{i}"), "destination_type": "queue", "routing_key": format!("k{i}"), "arguments": {}}))
        .collect();
    json!({
        "exchanges": [{"name": "imp-x", "vhost": "/", "type": "direct", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}],
        "queues": queues,
        "bindings": bindings,
    })
    .to_string()
}

/// Imported queues and bindings (to `imp-x`) the broker has.
fn imported(h: &Http) -> (usize, usize) {
    let d = h.get_json("/api/definitions");
    let count = |k: &str, f: &dyn Fn(&Value) -> bool| {
        d[k].as_array()
            .map(|a| a.iter().filter(|v| f(v)).count())
            .unwrap_or(0)
    };
    (
        count("queues", &|q| {
            q["name"].as_str().is_some_and(|n| n.starts_with("imp-"))
        }),
        count("bindings", &|b| b["source"] == "imp-x"),
    )
}

/// Sends the import without waiting for the answer; returns the socket.
fn send_import(port: u16, body: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let head = format!(
        "POST /api/definitions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("send");
    s.write_all(body.as_bytes()).expect("send");
    s
}

/// `kill -9` during an import (right after the request, and once its
/// first queue is visible) leaves, after a restart, none or all of its
/// queues and bindings: never some.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_killed_midway_leaves_nothing_or_everything() {
    const N: usize = 5_000;
    let body = document(N);
    let mut b = Broker::start();
    for round in 0..2 {
        let h = http(&b);
        let _s = send_import(b.http_port(), &body);
        if round == 1 {
            // Once the import shows: mid-way on a broker that imports item
            // by item, done on one that imports in one step.
            wait_until(
                "the first imported queue",
                Duration::from_secs(60),
                || async {
                    h.get_json("/api/overview")["object_totals"]["queues"]
                        .as_u64()
                        .unwrap_or(0)
                        > 0
                },
            )
            .await;
        }
        b.kill9();
        b.restart();
        let h = http(&b);
        let (q, bound) = imported(&h);
        assert!(
            (q, bound) == (0, 0) || (q, bound) == (N, N),
            "round {round}: {q} queues and {bound} bindings of {N} after kill -9"
        );
        // Start the next round from nothing.
        for i in 0..q {
            h.delete(&format!("/api/queues/%2F/imp-{i}"));
        }
    }
}

/// 20,000 queues and bindings import in one store batch; the time is the
/// benchmark figure (51 s before, item by item with an fsync each), the
/// bound only a generous guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_items_import_in_one_batch() {
    const N: usize = 10_000;
    let b = Broker::start();
    let h = http(&b);
    let body = document(N);
    let started = Instant::now();
    let r = h.send("POST", "/api/definitions", &body, &[]);
    let took = started.elapsed();
    assert_eq!(r.status, 204, "{}", r.text);
    eprintln!(
        "BENCH import of {} items: {:.2} s",
        2 * N + 1,
        took.as_secs_f64()
    );
    assert_eq!(imported(&h), (N, N));
    assert!(
        took < Duration::from_secs(30),
        "import took {took:?} (51 s item by item)"
    );
}

/// A refused import changes nothing: a binding to a missing queue at the
/// end refuses the queues before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_import_changes_nothing() {
    let b = Broker::start();
    let h = http(&b);
    let doc = json!({
        "queues": [{"name": "imp-0", "vhost": "/", "durable": true, "auto_delete": false, "arguments": {}}],
        "exchanges": [{"name": "imp-x", "vhost": "/", "type": "direct", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}],
        "bindings": [{"source": "imp-x", "vhost": "/", "destination": "missing", "destination_type": "queue", "routing_key": "k", "arguments": {}}],
    });
    let r = h.post("/api/definitions", doc);
    assert_eq!(r.status, 404, "{}", r.text);
    assert_eq!(imported(&h), (0, 0));
    assert_eq!(h.get("/api/exchanges/%2F/imp-x").status, 404);
}

/// Moving dead letters back writes copies: under the disk alarm it is
/// refused with 503 and the dead letters stay where they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_dead_letters_is_refused_under_the_disk_alarm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut b = Broker::start_in(dir.path());
    let h = http(&b);
    h.put("/api/exchanges/%2F/dlx", json!({"type": "fanout"}));
    h.put("/api/queues/%2F/dlq", json!({}));
    h.post("/api/bindings/%2F/e/dlx/q/dlq", json!({"routing_key": ""}));
    // TTL 0: dead-lettered as soon as it arrives.
    h.put(
        "/api/queues/%2F/src",
        json!({"arguments": {"x-dead-letter-exchange": "dlx", "x-message-ttl": 0}}),
    );
    for _ in 0..3 {
        let r = h.post(
            "/api/exchanges/%2F/amq.default/publish",
            publish_body("src"),
        );
        assert_eq!(r.status, 200, "{}", r.text);
    }
    wait_until("3 dead letters", OP_TIMEOUT, || async {
        depth(&h, "%2F", "dlq") == 3
    })
    .await;
    b.stop();
    let b = Broker::start_in_with(dir.path(), &["--disk-free-limit", "1PB"]);
    let h = http(&b);
    wait_for_alarm(&h).await;
    let r = h.post("/api/queues/%2F/dlq/requeue-dead-letters", json!({}));
    assert_eq!(r.status, 503, "{}", r.text);
    assert!(r.text.contains("disk"), "{}", r.text);
    assert_eq!(depth(&h, "%2F", "dlq"), 3);
    assert_eq!(depth(&h, "%2F", "src"), 0);
}
