//! RabbitMQ extensions owned by the engine (issue 11), in process
//! (`MemStore`): direct reply-to boxes and their bounds and lifecycle,
//! the validated user-id rule with the `impersonator` tag, the re-check of
//! a user's access (connection.update-secret), and unbinds of missing
//! objects. The same features end to end: tests/tests/compat.rs.

use bytes::Bytes;
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_engine::client::Published;
use weir_engine::exchange::HeaderLookup;
use weir_engine::message::Message;
use weir_engine::meta::DestinationKind;
use weir_engine::permissions::PermissionDef;
use weir_engine::properties::HeaderFormat;
use weir_engine::reply_to::{MAX_PENDING_REPLIES, REPLY_TO, REPLY_TO_PREFIX};
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, DurableWait, Engine, EngineError, DEFAULT_TENANT};

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<serde_json::Value> {
        None
    }
}

fn engine() -> Arc<Engine> {
    Engine::open(MemStore::new(), ManualClock::new()).expect("engine")
}

fn durable(w: DurableWait) {
    w.blocking_recv().expect("store answered").expect("durable");
}

fn publish(c: &mut Client, key: &str, body: &str) -> Published {
    let route = RouteInput {
        exchange: "",
        routing_key: key,
        headers: &NoHeaders,
    };
    c.publish(&route, |id| Message {
        id,
        exchange: Bytes::new(),
        routing_key: Bytes::copy_from_slice(key.as_bytes()),
        properties: Bytes::new(),
        body: Bytes::copy_from_slice(body.as_bytes()),
        header_format: HeaderFormat::new(1),
        persistent: true,
        priority: 0,
        ttl_ms: None,
    })
    .expect("publish")
}

fn routed(p: &Published) -> bool {
    matches!(p, Published::Routed { .. })
}

#[test]
fn direct_reply_to_reaches_the_consuming_scope_only_while_it_consumes() {
    let e = engine();
    let mut requester = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    let mut responder = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    // No reply consumer yet: a request asking for replies is refused.
    assert!(matches!(
        requester.reply_to_address(1),
        Err(EngineError::PreconditionFailed(t)) if t == "fast reply consumer does not exist"
    ));
    // Acknowledging reply consumers and a second one per scope: 406.
    assert!(requester
        .consume_reply_to(1, Bytes::from_static(b"r"), false)
        .is_err());
    requester
        .consume_reply_to(1, Bytes::from_static(b"r"), true)
        .expect("reply consumer");
    assert!(requester
        .consume_reply_to(1, Bytes::from_static(b"r2"), true)
        .is_err());
    let address = requester.reply_to_address(1).expect("address");
    assert!(address.starts_with(REPLY_TO_PREFIX));
    // Passive declares of the pseudo-queue and of the address answer.
    for name in [REPLY_TO, address.as_str()] {
        let (ok, _) = responder
            .declare_queue(QueueDeclare {
                name: name.into(),
                passive: true,
                durable: false,
                exclusive: false,
                auto_delete: false,
                arguments: serde_json::json!({}),
                connection: 0,
            })
            .expect("passive declare");
        assert_eq!((ok.messages, ok.consumers), (0, 1));
    }

    assert!(routed(&publish(&mut responder, &address, "reply")));
    let r = requester.next_reply().expect("the reply");
    assert_eq!((r.scope, &r.consumer_tag[..]), (1, &b"r"[..]));
    assert_eq!(r.routing_key, address.as_bytes());
    assert_eq!(r.message.body, "reply".as_bytes());
    assert!(requester.next_reply().is_none());
    // No queue took it, and nothing was stored.
    assert!(e
        .tenant(DEFAULT_TENANT)
        .expect("tenant")
        .queues()
        .is_empty());

    // Unknown addresses are unroutable.
    let bogus = format!("{REPLY_TO_PREFIX}nope");
    assert!(!routed(&publish(&mut responder, &bogus, "x")));

    // Bounded: replies the client does not take are dropped past the bound.
    for i in 0..MAX_PENDING_REPLIES + 3 {
        assert!(routed(&publish(&mut responder, &address, &i.to_string())));
    }
    let mut n = 0;
    while requester.next_reply().is_some() {
        n += 1;
    }
    assert_eq!(n, MAX_PENDING_REPLIES);

    // Cancelling frees the address: replies are unroutable again.
    assert!(requester.has_subscription(1, b"r"));
    assert!(requester.unsubscribe(1, b"r"));
    assert!(!routed(&publish(&mut responder, &address, "late")));
    // A closed scope too.
    requester
        .consume_reply_to(2, Bytes::from_static(b"r"), true)
        .expect("reply consumer");
    let address2 = requester.reply_to_address(2).expect("address");
    assert_ne!(address, address2);
    requester.release_scope(2);
    assert!(!routed(&publish(&mut responder, &address2, "gone")));
    // And a closed connection.
    requester
        .consume_reply_to(3, Bytes::from_static(b"r"), true)
        .expect("reply consumer");
    let address3 = requester.reply_to_address(3).expect("address");
    requester.close();
    assert!(!routed(&publish(&mut responder, &address3, "gone")));
}

#[test]
fn user_id_must_name_the_principal_unless_impersonator() {
    let e = engine();
    let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    c.check_user_id("guest").expect("own name");
    match c.check_user_id("mallory") {
        Err(EngineError::PreconditionFailed(t)) => assert_eq!(
            t,
            "user_id property set to 'mallory' but authenticated user was 'guest'"
        ),
        other => panic!("expected 406, got {other:?}"),
    }
    c.set_tags(&["impersonator".to_string()]);
    c.check_user_id("mallory").expect("impersonator");
    c.set_tags(&["administrator".to_string()]);
    assert!(c.check_user_id("mallory").is_err(), "tags are replaced");
}

#[test]
fn recheck_access_sees_revoked_permissions() {
    let e = engine();
    durable(
        e.set_permissions(PermissionDef {
            user: "guest".into(),
            vhost: DEFAULT_TENANT.into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
            from_config: false,
        })
        .expect("permissions"),
    );
    let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    c.recheck_access().expect("still allowed");
    if let Some(w) = e.clear_permissions("guest", DEFAULT_TENANT).expect("clear") {
        durable(w);
    }
    assert!(matches!(
        c.recheck_access(),
        Err(EngineError::AccessRefused(_))
    ));
}

#[test]
fn unbinding_from_or_to_something_missing_succeeds() {
    let e = engine();
    let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    for (source, kind, dest) in [
        ("amq.direct", DestinationKind::Queue, "no-such-queue"),
        ("no-such-exchange", DestinationKind::Queue, "no-such-queue"),
        ("amq.direct", DestinationKind::Exchange, "no-such-exchange"),
        ("no-such-exchange", DestinationKind::Exchange, "amq.fanout"),
    ] {
        c.unbind(source, kind, dest, "k", serde_json::json!({}))
            .unwrap_or_else(|e| panic!("{source} -> {dest}: {e}"));
    }
    // The default exchange stays refused.
    assert!(matches!(
        c.unbind("", DestinationKind::Queue, "q", "q", serde_json::json!({})),
        Err(EngineError::AccessRefused(_))
    ));
}
