//! `weirctl` against the real `weir` binary (WEIR_BIN, see tests/src/broker.rs):
//! every command group through the management API, checked by reading back
//! (with weirctl's `--json`, and for messages with lapin), and failures
//! exiting non-zero with the API's reason.

use std::process::{Command, Output};

use serde_json::Value;
use weir_tests::*;

/// Runs weirctl against `b` with guest's credentials.
fn ctl(b: &Broker, args: &[&str]) -> Output {
    ctl_as(b, "guest", "guest", args)
}

fn ctl_as(b: &Broker, user: &str, password: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_weirctl"))
        .args(args)
        // Credentials and URL from the environment, as scripts would.
        .env("WEIRCTL_URL", b.http_url())
        .env("WEIRCTL_USER", user)
        .env("WEIRCTL_PASSWORD", password)
        .output()
        .expect("running weirctl")
}

/// Runs a command that must succeed; its standard output.
#[track_caller]
fn ok(b: &Broker, args: &[&str]) -> String {
    let out = ctl(b, args);
    assert!(
        out.status.success(),
        "weirctl {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        b.logs()
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// Runs a `--json` listing; its items.
#[track_caller]
fn json_list(b: &Broker, args: &[&str]) -> Vec<Value> {
    let mut all = args.to_vec();
    all.push("--json");
    let text = ok(b, &all);
    match serde_json::from_str(&text) {
        Ok(Value::Array(items)) => items,
        other => panic!("weirctl {args:?} --json printed {other:?}"),
    }
}

/// The item named `name` in a listing.
fn named<'a>(items: &'a [Value], name: &str) -> Option<&'a Value> {
    items.iter().find(|i| i["name"] == name)
}

/// A command that must fail; its standard error.
#[track_caller]
fn fails(b: &Broker, args: &[&str]) -> String {
    let out = ctl(b, args);
    assert!(!out.status.success(), "weirctl {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn queues_declare_list_purge_delete() {
    let b = Broker::start();
    assert!(ok(&b, &["queues", "declare", "jobs"]).contains("declared"));
    let q = json_list(&b, &["queues", "list"]);
    let jobs = named(&q, "jobs").expect("jobs listed");
    assert_eq!(jobs["vhost"], "/");
    assert_eq!(jobs["durable"], true);

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let conn = rt.block_on(connect(&b.url()));
    let ch = rt.block_on(confirm_channel(&conn));
    for i in 0..7 {
        rt.block_on(publish_confirmed(
            &ch,
            "",
            "jobs",
            format!("m{i}").as_bytes(),
            persistent(),
        ));
    }
    let q = json_list(&b, &["queues", "list", "--vhost", "/"]);
    assert_eq!(named(&q, "jobs").expect("jobs")["messages"], 7);
    // The table for people shows the queue and its depth.
    let table = ok(&b, &["queues", "list"]);
    let row = table
        .lines()
        .find(|l| l.contains("jobs"))
        .expect("a row for jobs");
    assert!(row.split_whitespace().any(|c| c == "7"), "{table}");

    ok(&b, &["queues", "purge", "jobs"]);
    assert_eq!(rt.block_on(queue_len(&ch, "jobs")), 0);
    ok(&b, &["queues", "delete", "jobs"]);
    assert!(named(&json_list(&b, &["queues", "list"]), "jobs").is_none());
    let err = fails(&b, &["queues", "delete", "jobs"]);
    assert!(err.contains("404"), "{err}");
}

#[test]
fn requeue_dead_letters_moves_them_back() {
    let b = Broker::start();
    ok(&b, &["queues", "declare", "work.dlq"]);
    ok(
        &b,
        &[
            "queues",
            "declare",
            "work",
            "--arguments",
            r#"{"x-dead-letter-exchange":"","x-dead-letter-routing-key":"work.dlq"}"#,
        ],
    );
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let conn = rt.block_on(connect(&b.url()));
    let ch = rt.block_on(confirm_channel(&conn));
    for i in 0..3 {
        rt.block_on(publish_confirmed(
            &ch,
            "",
            "work",
            format!("m{i}").as_bytes(),
            persistent(),
        ));
    }
    // Rejected without requeue: dead-lettered into work.dlq.
    for _ in 0..3 {
        let got = rt
            .block_on(ch.basic_get("work".into(), lapin::options::BasicGetOptions::default()))
            .expect("basic.get")
            .expect("a message");
        rt.block_on(
            got.delivery
                .reject(lapin::options::BasicRejectOptions { requeue: false }),
        )
        .expect("reject");
    }
    // Rejects have no reply and dead-lettering runs on the broker's timer
    // task: wait (bounded) for the dead-letter queue to hold all three.
    rt.block_on(weir_tests::hardening::wait_until(
        "3 dead letters",
        OP_TIMEOUT,
        || async { queue_len(&ch, "work.dlq").await == 3 },
    ));

    let out: Value = serde_json::from_str(&ok(
        &b,
        &["queues", "requeue-dead-letters", "work.dlq", "--json"],
    ))
    .expect("JSON answer");
    assert_eq!(out["moved"], 3, "{out}");
    assert_eq!(rt.block_on(queue_len(&ch, "work")), 3);
    assert_eq!(rt.block_on(queue_len(&ch, "work.dlq")), 0);
}

#[test]
fn exchanges_and_bindings() {
    let b = Broker::start();
    ok(&b, &["exchanges", "declare", "events", "--type", "topic"]);
    let x = json_list(&b, &["exchanges", "list"]);
    assert_eq!(named(&x, "events").expect("events")["type"], "topic");
    ok(&b, &["queues", "declare", "audit"]);
    ok(
        &b,
        &[
            "bindings",
            "declare",
            "--source",
            "events",
            "--destination",
            "audit",
            "--routing-key",
            "a.#",
        ],
    );
    let has = |items: &[Value]| {
        items.iter().any(|i| {
            i["source"] == "events" && i["destination"] == "audit" && i["routing_key"] == "a.#"
        })
    };
    assert!(has(&json_list(&b, &["bindings", "list"])));

    // The binding routes: a publish to the exchange lands in the queue.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let conn = rt.block_on(connect(&b.url()));
    let ch = rt.block_on(confirm_channel(&conn));
    rt.block_on(publish_confirmed(&ch, "events", "a.b", b"x", persistent()));
    assert_eq!(rt.block_on(queue_len(&ch, "audit")), 1);

    ok(
        &b,
        &[
            "bindings",
            "delete",
            "--source",
            "events",
            "--destination",
            "audit",
            "--routing-key",
            "a.#",
        ],
    );
    assert!(!has(&json_list(&b, &["bindings", "list"])));
    let err = fails(
        &b,
        &[
            "bindings",
            "delete",
            "--source",
            "events",
            "--destination",
            "audit",
            "--routing-key",
            "a.#",
        ],
    );
    assert!(err.contains("no binding"), "{err}");
    ok(&b, &["exchanges", "delete", "events"]);
    assert!(named(&json_list(&b, &["exchanges", "list"]), "events").is_none());
}

#[test]
fn vhosts_users_permissions_policies_definitions() {
    let b = Broker::start();
    ok(&b, &["vhosts", "declare", "tenant-a"]);
    assert!(named(&json_list(&b, &["vhosts", "list"]), "tenant-a").is_some());
    ok(
        &b,
        &[
            "users",
            "declare",
            "alice",
            "--new-password",
            "s3cret",
            "--tags",
            "monitoring",
        ],
    );
    assert!(named(&json_list(&b, &["users", "list"]), "alice").is_some());
    ok(
        &b,
        &[
            "permissions",
            "declare",
            "alice",
            "--vhost",
            "tenant-a",
            "--write",
            "^$",
        ],
    );
    let perms = json_list(&b, &["permissions", "list"]);
    let p = perms
        .iter()
        .find(|p| p["user"] == "alice" && p["vhost"] == "tenant-a")
        .expect("alice's permissions");
    assert_eq!(p["write"], "^$");
    // alice logs in over the API with her password (and is refused with another).
    assert!(ctl_as(
        &b,
        "alice",
        "s3cret",
        &["queues", "list", "--vhost", "tenant-a"]
    )
    .status
    .success());
    let bad = ctl_as(&b, "alice", "wrong", &["queues", "list"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("401"));

    ok(
        &b,
        &[
            "policies",
            "declare",
            "cap",
            "--vhost",
            "tenant-a",
            "--pattern",
            "^cap\\.",
            "--definition",
            r#"{"max-length":10}"#,
            "--apply-to",
            "queues",
        ],
    );
    let pol = json_list(&b, &["policies", "list", "--vhost", "tenant-a"]);
    assert_eq!(
        named(&pol, "cap").expect("cap")["definition"]["max-length"],
        10
    );

    // Export, delete, import: the definitions come back.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("defs.json");
    let file = file.to_str().expect("utf-8 path");
    ok(&b, &["definitions", "export", "--file", file]);
    ok(&b, &["policies", "delete", "cap", "--vhost", "tenant-a"]);
    ok(
        &b,
        &["permissions", "delete", "alice", "--vhost", "tenant-a"],
    );
    ok(&b, &["users", "delete", "alice"]);
    assert!(named(&json_list(&b, &["users", "list"]), "alice").is_none());
    ok(&b, &["definitions", "import", file]);
    assert!(named(&json_list(&b, &["users", "list"]), "alice").is_some());
    assert!(named(&json_list(&b, &["policies", "list"]), "cap").is_some());

    ok(&b, &["vhosts", "delete", "tenant-a"]);
    assert!(named(&json_list(&b, &["vhosts", "list"]), "tenant-a").is_none());
}

#[test]
fn status_and_errors() {
    let b = Broker::start();
    let status = ok(&b, &["status"]);
    assert!(status.contains("Weir"), "{status}");
    assert!(status.contains("alarms"), "{status}");
    let json: Value = serde_json::from_str(&ok(&b, &["status", "--json"])).expect("status --json");
    assert!(json["overview"]["object_totals"].is_object(), "{json}");

    // Bad input: the API's error and reason, and a non-zero exit.
    let err = fails(
        &b,
        &[
            "queues",
            "declare",
            "x",
            "--arguments",
            r#"{"x-max-length":"many"}"#,
        ],
    );
    assert!(err.contains("400"), "{err}");
    let err = fails(&b, &["queues", "purge", "missing"]);
    assert!(err.contains("404") && err.contains("Not Found"), "{err}");
    // Nothing listening: a transport error, not a panic.
    let out = Command::new(env!("CARGO_BIN_EXE_weirctl"))
        .args([
            "--url",
            &format!("http://127.0.0.1:{}", free_port()),
            "status",
        ])
        .output()
        .expect("running weirctl");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach"));
}
