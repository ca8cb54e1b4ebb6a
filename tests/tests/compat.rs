//! RabbitMQ's extensions and spec differences (issue 11), through lapin
//! against the real `weir` binary: idempotent teardown, direct reply-to,
//! alternate exchanges (argument and policy), sender-selected distribution,
//! validated user-id (and the `impersonator` tag), the queue arguments
//! RabbitMQ accepts, headers `x-match: all-with-x / any-with-x`, and
//! connection.update-secret. docs/compatibility.md lists them; the same
//! items run against RabbitMQ in conformance/weirconf/scenarios/compat.py.

#![forbid(unsafe_code)]

use lapin::options::*;
use lapin::types::{AMQPValue, FieldArray, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use std::io::Write;
use std::process::{Command, Stdio};
use weir_tests::*;

const REPLY_TO: &str = "amq.rabbitmq.reply-to";

fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(v.into())
}

async fn declare_exchange(ch: &Channel, name: &str, kind: lapin::ExchangeKind, args: FieldTable) {
    ch.exchange_declare(name.into(), kind, ExchangeDeclareOptions::default(), args)
        .await
        .unwrap_or_else(|e| panic!("declaring exchange {name}: {e}"));
}

async fn bind(ch: &Channel, queue: &str, exchange: &str, key: &str, args: FieldTable) {
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        key.into(),
        QueueBindOptions::default(),
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("binding {queue} to {exchange}: {e}"));
}

/// The bodies in `queue`, taken with basic.get until it is empty.
async fn drain(ch: &Channel, queue: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        out.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
    }
    out
}

/// What a confirmed, possibly mandatory, publish was told: "ack",
/// "returned" (basic.return before the ack) or "nack".
async fn publish(
    ch: &Channel,
    exchange: &str,
    key: &str,
    body: &str,
    props: BasicProperties,
    mandatory: bool,
) -> &'static str {
    let confirm = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions {
                mandatory,
                ..Default::default()
            },
            body.as_bytes(),
            props,
        )
        .await
        .expect("basic.publish");
    let c = within("confirm", confirm).await.expect("confirm");
    match (c.is_ack(), c.take_message().is_some()) {
        (true, false) => "ack",
        (true, true) => "returned",
        (false, _) => "nack",
    }
}

/// `weir hash-password` with `password` on stdin.
fn hash_password(password: &str) -> String {
    let mut child = Command::new(weir_bin())
        .arg("hash-password")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning weir hash-password");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{password}\n").as_bytes())
        .expect("writing the password");
    let out = child.wait_with_output().expect("weir hash-password");
    assert!(out.status.success(), "weir hash-password failed");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string()
}

/// A broker started with `config` (TOML) as its configuration file.
fn broker_with_config(config: &str) -> (Broker, tempfile::TempDir) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("weir.toml");
    std::fs::write(&file, config).expect("writing the configuration");
    let path = file.to_str().expect("utf-8 path").to_string();
    (Broker::start_with(&["--config", &path]), tmp)
}

// ---------------------------------------------------------------------------
// 1. idempotent teardown

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unbind_and_delete_of_missing_objects_succeed() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_exchange(&ch, "x", lapin::ExchangeKind::Direct, FieldTable::default()).await;
    declare_queue(&ch, "q").await;
    bind(&ch, "q", "x", "k", FieldTable::default()).await;
    let unbind = |q: &'static str, x: &'static str, k: &'static str| {
        let ch = ch.clone();
        async move {
            ch.queue_unbind(q.into(), x.into(), k.into(), FieldTable::default())
                .await
        }
    };
    unbind("no-such-queue", "x", "k")
        .await
        .expect("missing queue: unbind-ok");
    unbind("q", "no-such-exchange", "k")
        .await
        .expect("missing exchange: unbind-ok");
    unbind("q", "x", "never-bound")
        .await
        .expect("missing binding: unbind-ok");
    ch.exchange_unbind(
        "no-such-destination".into(),
        "x".into(),
        "k".into(),
        ExchangeUnbindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("missing destination exchange: unbind-ok");
    ch.exchange_unbind(
        "x".into(),
        "no-such-source".into(),
        "k".into(),
        ExchangeUnbindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("missing source exchange: unbind-ok");
    ch.queue_delete("no-such-queue".into(), QueueDeleteOptions::default())
        .await
        .expect("missing queue: delete-ok");
    ch.exchange_delete("no-such-exchange".into(), ExchangeDeleteOptions::default())
        .await
        .expect("missing exchange: delete-ok");
    // The channel is still open and the real binding untouched.
    publish_confirmed(&ch, "x", "k", b"m", BasicProperties::default()).await;
    assert_eq!(drain(&ch, "q").await, ["m"]);
    // The default exchange stays refused.
    let ch2 = conn.create_channel().await.expect("channel");
    assert_code(
        ch2.queue_unbind("q".into(), "".into(), "q".into(), FieldTable::default())
            .await,
        403,
    );
}

// ---------------------------------------------------------------------------
// 2. direct reply-to

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_reply_to_routes_replies_to_the_consuming_channel() {
    let broker = Broker::start();
    let client = connect(&broker.url()).await;
    let server = connect(&broker.url()).await;

    // Refusals, each closing its channel with 406 as RabbitMQ does.
    let ch = client.create_channel().await.expect("channel");
    assert_code(
        ch.basic_consume(
            REPLY_TO.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await,
        406,
    );
    let ch = confirm_channel(&client).await;
    let asks = BasicProperties::default().with_reply_to(REPLY_TO.into());
    let r = ch
        .basic_publish(
            "".into(),
            "nowhere".into(),
            BasicPublishOptions::default(),
            b"x",
            asks.clone(),
        )
        .await;
    match r {
        Ok(confirm) => assert_code(confirm.await, 406),
        Err(e) => assert_eq!(reply_code(&e), Some(406), "{e:?}"),
    }

    // The reply consumer, and a second one on its channel refused.
    let ch = confirm_channel(&client).await;
    let no_ack = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let mut replies = ch
        .basic_consume(REPLY_TO.into(), "rpc".into(), no_ack, FieldTable::default())
        .await
        .expect("reply consumer");
    let other = client.create_channel().await.expect("channel");
    other
        .basic_consume(REPLY_TO.into(), "a".into(), no_ack, FieldTable::default())
        .await
        .expect("one reply consumer per channel");
    assert_code(
        other
            .basic_consume(REPLY_TO.into(), "b".into(), no_ack, FieldTable::default())
            .await,
        406,
    );

    // A request through a real queue: its reply-to is the channel's address.
    let sch = confirm_channel(&server).await;
    declare_queue(&sch, "requests").await;
    publish_confirmed(
        &ch,
        "",
        "requests",
        b"req",
        asks.with_correlation_id("c1".into()),
    )
    .await;
    let req = sch
        .basic_get("requests".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
        .expect("the request");
    let address = req
        .delivery
        .properties
        .reply_to()
        .as_ref()
        .expect("a reply-to")
        .as_str()
        .to_string();
    assert!(
        address.starts_with("amq.rabbitmq.reply-to.") && address.len() > REPLY_TO.len() + 16,
        "{address}"
    );
    // A passive declare of the address answers; no queue exists.
    let q = sch
        .queue_declare(
            address.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare of a live reply address");
    assert_eq!(q.message_count(), 0);

    // Replies from another connection and from the same channel.
    let props = BasicProperties::default().with_correlation_id("c1".into());
    assert_eq!(
        publish(&sch, "", &address, "reply-1", props, false).await,
        "ack"
    );
    publish_confirmed(&ch, "", &address, b"reply-2", BasicProperties::default()).await;
    for want in ["reply-1", "reply-2"] {
        let d = next_delivery(&mut replies).await;
        assert_eq!(d.data, want.as_bytes());
        assert_eq!(d.routing_key.as_str(), address);
        assert_eq!(d.exchange.as_str(), "");
        assert!(!d.redelivered);
        if want == "reply-1" {
            assert_eq!(
                d.properties
                    .correlation_id()
                    .as_ref()
                    .map(ShortString::as_str),
                Some("c1")
            );
        }
    }

    // Unknown address, cancelled consumer, closed channel: unroutable.
    let unknown = "amq.rabbitmq.reply-to.not-a-real-address";
    let none = BasicProperties::default;
    assert_eq!(
        publish(&sch, "", unknown, "x", none(), true).await,
        "returned"
    );
    assert_eq!(publish(&sch, "", unknown, "x", none(), false).await, "ack");
    ch.basic_cancel("rpc".into(), BasicCancelOptions::default())
        .await
        .expect("cancel");
    assert_eq!(
        publish(&sch, "", &address, "late", none(), true).await,
        "returned"
    );
    let ch2 = confirm_channel(&client).await;
    let _r2 = ch2
        .basic_consume(
            REPLY_TO.into(),
            "rpc2".into(),
            no_ack,
            FieldTable::default(),
        )
        .await
        .expect("a new reply consumer");
    publish_confirmed(
        &ch2,
        "",
        "requests",
        b"req2",
        BasicProperties::default().with_reply_to(REPLY_TO.into()),
    )
    .await;
    let req2 = sch
        .basic_get("requests".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
        .expect("the second request");
    let address2 = req2
        .delivery
        .properties
        .reply_to()
        .as_ref()
        .expect("reply-to")
        .as_str()
        .to_string();
    assert_ne!(address2, address, "each reply consumer has its own address");
    ch2.close(200, "bye".into()).await.expect("close");
    assert_eq!(
        publish(&sch, "", &address2, "gone", none(), true).await,
        "returned"
    );
}

// ---------------------------------------------------------------------------
// 3. alternate exchanges (argument and policy)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alternate_exchange_takes_what_cannot_be_routed() {
    let (broker, _tmp) = broker_with_config(
        "[[policies]]\nname = \"ae\"\npattern = '^pol-ae\\.'\napply-to = \"exchanges\"\n\
         definition = { alternate-exchange = \"ae-by-policy\" }\n",
    );
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    let fanout = lapin::ExchangeKind::Fanout;
    let direct = lapin::ExchangeKind::Direct;
    declare_exchange(&ch, "ae2", fanout.clone(), FieldTable::default()).await;
    declare_exchange(
        &ch,
        "ae",
        direct.clone(),
        table(&[("alternate-exchange", s("ae2"))]),
    )
    .await;
    declare_exchange(
        &ch,
        "x",
        direct.clone(),
        table(&[("alternate-exchange", s("ae"))]),
    )
    .await;
    for q in ["main", "lost", "lost2", "by-policy"] {
        declare_queue(&ch, q).await;
    }
    bind(&ch, "main", "x", "main", FieldTable::default()).await;
    bind(&ch, "lost", "ae", "lost", FieldTable::default()).await;
    let none = BasicProperties::default;
    assert_eq!(publish(&ch, "x", "main", "m1", none(), true).await, "ack");
    assert_eq!(publish(&ch, "x", "lost", "m2", none(), true).await, "ack");
    // A CC key that routes: the alternate is not asked.
    let cc = none().with_headers(table(&[(
        "CC",
        AMQPValue::FieldArray(FieldArray::from(vec![s("main")])),
    )]));
    assert_eq!(publish(&ch, "x", "nothing", "m3", cc, true).await, "ack");
    // Neither x nor its alternates route it: returned.
    assert_eq!(
        publish(&ch, "x", "nowhere", "m4", none(), true).await,
        "returned"
    );
    bind(&ch, "lost2", "ae2", "", FieldTable::default()).await;
    assert_eq!(
        publish(&ch, "x", "nowhere", "m5", none(), true).await,
        "ack"
    );
    assert_eq!(drain(&ch, "main").await, ["m1", "m3"]);
    assert_eq!(drain(&ch, "lost").await, ["m2"]);
    assert_eq!(drain(&ch, "lost2").await, ["m5"]);

    // An alternate named by a policy; the exchange's own argument wins.
    declare_exchange(&ch, "ae-by-policy", fanout.clone(), FieldTable::default()).await;
    bind(&ch, "by-policy", "ae-by-policy", "", FieldTable::default()).await;
    declare_exchange(&ch, "pol-ae.x", direct.clone(), FieldTable::default()).await;
    declare_exchange(
        &ch,
        "pol-ae.own",
        direct,
        table(&[("alternate-exchange", s("ae"))]),
    )
    .await;
    assert_eq!(
        publish(&ch, "pol-ae.x", "k", "p1", none(), true).await,
        "ack"
    );
    assert_eq!(
        publish(&ch, "pol-ae.own", "lost", "p2", none(), true).await,
        "ack"
    );
    assert_eq!(drain(&ch, "by-policy").await, ["p1"]);
    assert_eq!(drain(&ch, "lost").await, ["p2"]);
}

// ---------------------------------------------------------------------------
// 4. sender-selected distribution

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cc_and_bcc_add_routing_keys_and_bcc_is_removed() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_exchange(&ch, "t", lapin::ExchangeKind::Topic, FieldTable::default()).await;
    for (q, key) in [("main", "a.main"), ("cc", "a.cc"), ("bcc", "a.bcc")] {
        declare_queue(&ch, q).await;
        bind(&ch, q, "t", key, FieldTable::default()).await;
    }
    let arr = |keys: &[&str]| {
        AMQPValue::FieldArray(FieldArray::from(
            keys.iter().map(|k| s(k)).collect::<Vec<_>>(),
        ))
    };
    let props = BasicProperties::default().with_headers(table(&[
        ("CC", arr(&["a.cc", "a.main"])),
        ("BCC", arr(&["a.bcc"])),
        ("keep", s("me")),
    ]));
    publish_confirmed(&ch, "t", "a.main", b"x", props).await;
    for q in ["main", "cc", "bcc"] {
        let m = ch
            .basic_get(q.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
            .unwrap_or_else(|| panic!("{q} got the message"));
        let headers = m.delivery.properties.headers().clone().expect("headers");
        let keys: Vec<&str> = headers.inner().keys().map(|k| k.as_str()).collect();
        assert!(
            keys.contains(&"CC") && keys.contains(&"keep"),
            "{q}: {keys:?}"
        );
        assert!(!keys.contains(&"BCC"), "BCC reached a consumer of {q}");
        // One copy per queue, however many keys reached it.
        assert!(drain(&ch, q).await.is_empty(), "{q} got a second copy");
    }
}

// ---------------------------------------------------------------------------
// 5. validated user-id

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_id_must_name_the_user_unless_impersonator() {
    let (imp, plain) = (hash_password("imp-pass"), hash_password("plain-pass"));
    let (broker, _tmp) = broker_with_config(&format!(
        "[[auth.users]]\nname = \"imp\"\npassword_hash = \"{imp}\"\ntags = [\"impersonator\"]\n\
         [[auth.users]]\nname = \"plain\"\npassword_hash = \"{plain}\"\n"
    ));
    let conn = connect(&broker.url_with("plain", "plain-pass", "%2f")).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "q").await;
    let as_user = |u: &str| BasicProperties::default().with_user_id(u.into());
    publish_confirmed(&ch, "", "q", b"own", as_user("plain")).await;
    let forged = ch
        .basic_publish(
            "".into(),
            "q".into(),
            BasicPublishOptions::default(),
            b"forged",
            as_user("imp"),
        )
        .await;
    match forged {
        Ok(confirm) => assert_code(confirm.await, 406),
        Err(e) => assert_eq!(reply_code(&e), Some(406), "{e:?}"),
    }
    let ch = confirm_channel(&conn).await;
    assert_eq!(
        drain(&ch, "q").await,
        ["own"],
        "the forged message was not queued"
    );

    let imp = connect(&broker.url_with("imp", "imp-pass", "%2f")).await;
    let ich = confirm_channel(&imp).await;
    publish_confirmed(&ich, "", "q", b"on-behalf", as_user("plain")).await;
    let m = ich
        .basic_get("q".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
        .expect("the impersonated message");
    assert_eq!(
        m.delivery
            .properties
            .user_id()
            .as_ref()
            .map(ShortString::as_str),
        Some("plain")
    );
}

// ---------------------------------------------------------------------------
// 6. queue arguments RabbitMQ accepts

/// A declare: queue name, arguments, the reply code expected (None: ok).
type Case = (&'static str, Vec<(&'static str, AMQPValue)>, Option<u16>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_queue_arguments_are_checked_like_rabbitmq() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let quorum = || ("x-queue-type", s("quorum"));
    let int = |n: i64| AMQPValue::LongLongInt(n);
    let cases: Vec<Case> = vec![
        ("lazy", vec![("x-queue-mode", s("lazy"))], None),
        ("bad-mode", vec![("x-queue-mode", s("bogus"))], Some(406)),
        (
            "master",
            vec![("x-queue-master-locator", s("min-masters"))],
            None,
        ),
        (
            "leader-on-classic",
            vec![("x-queue-leader-locator", s("balanced"))],
            Some(406),
        ),
        (
            "q-leader",
            vec![quorum(), ("x-queue-leader-locator", s("balanced"))],
            None,
        ),
        (
            "q-bad-leader",
            vec![quorum(), ("x-queue-leader-locator", s("x"))],
            Some(406),
        ),
        (
            "q-group",
            vec![quorum(), ("x-quorum-initial-group-size", int(3))],
            None,
        ),
        (
            "q-group-0",
            vec![quorum(), ("x-quorum-initial-group-size", int(0))],
            Some(406),
        ),
        (
            "q-alo",
            vec![
                quorum(),
                ("x-dead-letter-strategy", s("at-least-once")),
                ("x-overflow", s("reject-publish")),
                ("x-dead-letter-exchange", s("dlx")),
            ],
            None,
        ),
        (
            "q-bad-strategy",
            vec![quorum(), ("x-dead-letter-strategy", s("x"))],
            Some(406),
        ),
        (
            "q-in-memory",
            vec![quorum(), ("x-max-in-memory-length", int(5))],
            None,
        ),
        (
            "q-in-memory-neg",
            vec![quorum(), ("x-max-in-memory-length", int(-1))],
            Some(406),
        ),
        (
            "q-lazy",
            vec![quorum(), ("x-queue-mode", s("lazy"))],
            Some(406),
        ),
    ];
    for (name, args, want) in cases {
        let ch = conn.create_channel().await.expect("channel");
        let r = ch.queue_declare(name.into(), durable, table(&args)).await;
        match want {
            None => {
                r.unwrap_or_else(|e| panic!("{name}: {e}"));
            }
            Some(code) => assert_code(r, code),
        }
    }
    // Redeclares compare them.
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_declare(
        "lazy".into(),
        durable,
        table(&[("x-queue-mode", s("lazy"))]),
    )
    .await
    .expect("same arguments");
    assert_code(
        ch.queue_declare("lazy".into(), durable, FieldTable::default())
            .await,
        406,
    );
    let ch = conn.create_channel().await.expect("channel");
    assert_code(
        ch.queue_declare(
            "q-group".into(),
            durable,
            table(&[quorum(), ("x-quorum-initial-group-size", int(2))]),
        )
        .await,
        406,
    );
}

// ---------------------------------------------------------------------------
// 7. headers exchange: all-with-x, any-with-x

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_all_with_x_and_any_with_x_match_x_headers() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_exchange(
        &ch,
        "h",
        lapin::ExchangeKind::Headers,
        FieldTable::default(),
    )
    .await;
    let bindings = [
        (
            "all",
            "all",
            vec![("x-tenant", s("a")), ("kind", s("order"))],
        ),
        (
            "all-with-x",
            "all-with-x",
            vec![("x-tenant", s("a")), ("kind", s("order"))],
        ),
        (
            "any-with-x",
            "any-with-x",
            vec![("x-tenant", s("a")), ("kind", s("nobody"))],
        ),
    ];
    for (q, mode, mut args) in bindings {
        declare_queue(&ch, q).await;
        args.push(("x-match", s(mode)));
        bind(&ch, q, "h", "", table(&args)).await;
    }
    let msgs = [
        ("order-a", vec![("x-tenant", s("a")), ("kind", s("order"))]),
        ("order-b", vec![("x-tenant", s("b")), ("kind", s("order"))]),
        ("only-x-a", vec![("x-tenant", s("a"))]),
    ];
    for (body, headers) in msgs {
        let props = BasicProperties::default().with_headers(table(&headers));
        publish_confirmed(&ch, "h", "", body.as_bytes(), props).await;
    }
    assert_eq!(drain(&ch, "all").await, ["order-a", "order-b"]);
    assert_eq!(drain(&ch, "all-with-x").await, ["order-a"]);
    assert_eq!(drain(&ch, "any-with-x").await, ["order-a", "only-x-a"]);
}

// ---------------------------------------------------------------------------
// 8. connection-level extras

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_secret_is_answered_and_the_connection_works_on() {
    let broker = Broker::start();
    let conn: Connection = connect(&broker.url()).await;
    within(
        "update-secret",
        conn.update_secret("guest".into(), "rotation".into()),
    )
    .await
    .expect("update-secret-ok");
    // RabbitMQ's internal users keep their login whatever the new secret
    // (it is meant for expiring tokens); so does Weir.
    within(
        "update-secret",
        conn.update_secret("a-rotated-token".into(), "rotation".into()),
    )
    .await
    .expect("update-secret-ok");
    assert!(conn.status().connected());
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "after").await;
    publish_confirmed(&ch, "", "after", b"m", BasicProperties::default()).await;
    assert_eq!(drain(&ch, "after").await, ["m"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_login_is_closed_with_403_and_the_reason() {
    // lapin announces `authentication_failure_close`: the refusal comes as
    // connection.close 403 with RabbitMQ's text, not a bare disconnect.
    let broker = Broker::start();
    let r = Connection::connect(
        &broker.url_with("guest", "wrong", "%2f"),
        lapin::ConnectionProperties::default(),
    )
    .await;
    let e = r.expect_err("a wrong password is refused");
    assert_eq!(reply_code(&e), Some(403), "{e:?}");
    assert!(e.to_string().contains("ACCESS_REFUSED"), "{e}");
}
