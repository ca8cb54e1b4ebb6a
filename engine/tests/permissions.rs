//! Users, permissions and topic permissions in process (`MemStore`): which
//! operation of the engine client needs which permission (RabbitMQ's
//! table), the regular-expression and variable rules, runtime changes, and
//! the definitions' durability across `Engine::open` of the same store.

use bytes::Bytes;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_engine::auth::hash_password;
use weir_engine::client::{GetAck, Published, SubscribeOptions};
use weir_engine::exchange::{ExchangeDef, ExchangeKind, HeaderLookup};
use weir_engine::message::Message;
use weir_engine::meta::DestinationKind;
use weir_engine::permissions::{PermissionDef, TopicPermissionDef, UserDef};
use weir_engine::properties::HeaderFormat;
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, DurableWait, Engine, EngineError, DEFAULT_TENANT};

const REMOTE: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9));

fn durable(w: DurableWait) {
    w.blocking_recv().expect("store answered").expect("durable");
}

fn user(e: &Engine, name: &str, password: &str) {
    durable(
        e.put_user(UserDef {
            name: name.into(),
            password_hash: hash_password(password.as_bytes()).expect("hash"),
            tags: vec![],
            loopback_only: false,
            from_config: false,
        })
        .expect("put user"),
    );
}

fn perms(e: &Engine, user: &str, vhost: &str, c: &str, w: &str, r: &str) {
    durable(
        e.set_permissions(PermissionDef {
            user: user.into(),
            vhost: vhost.into(),
            configure: c.into(),
            write: w.into(),
            read: r.into(),
            from_config: false,
        })
        .expect("set permissions"),
    );
}

fn topic(e: &Engine, user: &str, vhost: &str, write: &str, read: &str) {
    durable(
        e.set_topic_permissions(TopicPermissionDef {
            user: user.into(),
            vhost: vhost.into(),
            exchange: "amq.topic".into(),
            write: write.into(),
            read: read.into(),
            from_config: false,
        })
        .expect("set topic permissions"),
    );
}

fn tenants(e: &Arc<Engine>) {
    for t in ["a", "b"] {
        if let (_, Some(w)) = e.add_tenant(t).expect("tenant") {
            durable(w);
        }
    }
}

fn refused_text<T>(r: Result<T, EngineError>) -> String {
    match r {
        Err(EngineError::AccessRefused(t)) => t,
        Err(e) => panic!("expected ACCESS_REFUSED, got {e}"),
        Ok(_) => panic!("expected ACCESS_REFUSED, got success"),
    }
}

fn queue(c: &Client, name: &str) -> QueueDeclare {
    QueueDeclare {
        name: name.into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments: serde_json::json!({}),
        connection: c.id(),
    }
}

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<serde_json::Value> {
        None
    }
}

fn publish(c: &mut Client, exchange: &str, key: &str) -> Result<Published, EngineError> {
    let route = RouteInput {
        exchange,
        routing_key: key,
        headers: &NoHeaders,
    };
    c.publish(&route, |id| Message {
        id,
        exchange: Bytes::copy_from_slice(exchange.as_bytes()),
        routing_key: Bytes::copy_from_slice(key.as_bytes()),
        properties: Bytes::new(),
        body: Bytes::from_static(b"m"),
        header_format: HeaderFormat::new(1),
        persistent: false,
        priority: 0,
        ttl_ms: None,
    })
}

#[test]
fn a_user_without_permissions_on_a_tenant_cannot_open_it() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    tenants(&e);
    user(&e, "ua", "pa");
    perms(&e, "ua", "a", ".*", ".*", ".*");
    assert!(Client::open(&e, "a", "ua").is_ok());
    assert_eq!(
        refused_text(Client::open(&e, "b", "ua")),
        "access to vhost 'b' refused for user 'ua'"
    );
    assert!(refused_text(Client::open(&e, "a", "nobody")).contains("vhost 'a'"));
    // A missing tenant is told apart, as RabbitMQ does.
    assert!(matches!(
        Client::open(&e, "zzz", "ua"),
        Err(EngineError::NotFound(_))
    ));
    // The default user of a store without users: guest, on `/` only.
    let fresh = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    tenants(&fresh);
    assert!(Client::open(&fresh, DEFAULT_TENANT, "guest").is_ok());
    assert!(Client::open(&fresh, "a", "guest").is_err());
}

#[test]
fn each_operation_needs_its_permission() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    tenants(&e);
    user(&e, "admin", "x");
    perms(&e, "admin", "a", ".*", ".*", ".*");
    user(&e, "u", "x");
    // configure: app.* only; write: the exchange "in" and queues app.*;
    // read: queue app.q and exchange amq.direct.
    perms(
        &e,
        "u",
        "a",
        "^app\\.",
        "^(in|app\\..*)$",
        "^(app\\.q|amq\\.direct)$",
    );
    let mut admin = Client::open(&e, "a", "admin").expect("admin");
    let direct = |name: &str| ExchangeDef {
        name: name.into(),
        kind: ExchangeKind::Direct,
        durable: false,
        auto_delete: false,
        internal: false,
        delayed: false,
        arguments: serde_json::json!({}),
    };
    admin.declare_exchange(direct("in"), false).expect("in");
    admin.declare_queue(queue(&admin, "other")).expect("other");
    let (named, _) = admin
        .declare_queue(queue(&admin, ""))
        .expect("server-named");
    assert!(named.name.starts_with("amq.gen-"), "{}", named.name);
    let mut u = Client::open(&e, "a", "u").expect("u");

    // configure
    u.declare_queue(queue(&u, "app.q"))
        .expect("configure app.q");
    assert_eq!(
        refused_text(u.declare_queue(queue(&u, "q"))),
        "configure access to queue 'q' in vhost 'a' refused for user 'u'"
    );
    // A server-named queue is checked under its generated name (amq.gen-…).
    assert!(refused_text(u.declare_queue(queue(&u, ""))).contains("queue 'amq.gen-"));
    assert!(refused_text(u.declare_exchange(direct("x"), false))
        .starts_with("configure access to exchange 'x'"));
    assert!(refused_text(u.delete_queue("other", false, false)).starts_with("configure access"));
    assert!(refused_text(u.delete_exchange("in", false)).starts_with("configure access"));
    // Passive declares need nothing.
    let mut passive = queue(&u, "other");
    passive.passive = true;
    u.declare_queue(passive).expect("passive declare");
    u.declare_exchange(direct("in"), true)
        .expect("passive exchange declare");
    // A dead-letter exchange needs write on it (and read on the queue).
    let mut dlx = queue(&u, "app.dl");
    dlx.arguments = serde_json::json!({"x-dead-letter-exchange": "nowrite"});
    assert!(refused_text(u.declare_queue(dlx)).starts_with("write access to exchange 'nowrite'"));

    // queue.bind: write on the queue, read on the exchange.
    u.bind(
        "amq.direct",
        DestinationKind::Queue,
        "app.q",
        "k",
        serde_json::json!({}),
    )
    .expect("bind");
    assert_eq!(
        refused_text(u.bind(
            "amq.direct",
            DestinationKind::Queue,
            "other",
            "k",
            serde_json::json!({})
        )),
        "write access to queue 'other' in vhost 'a' refused for user 'u'"
    );
    assert_eq!(
        refused_text(u.bind(
            "amq.fanout",
            DestinationKind::Queue,
            "app.q",
            "k",
            serde_json::json!({})
        )),
        "read access to exchange 'amq.fanout' in vhost 'a' refused for user 'u'"
    );
    // exchange.bind: write on the destination, read on the source.
    assert!(refused_text(u.bind(
        "amq.direct",
        DestinationKind::Exchange,
        "amq.fanout",
        "k",
        serde_json::json!({})
    ))
    .starts_with("write access to exchange 'amq.fanout'"));

    // basic.publish: write on the exchange; the default exchange is amq.default.
    assert!(matches!(
        publish(&mut u, "in", "k"),
        Ok(Published::Unroutable)
    ));
    assert_eq!(
        refused_text(publish(&mut u, "amq.direct", "k")),
        "write access to exchange 'amq.direct' in vhost 'a' refused for user 'u'"
    );
    assert_eq!(
        refused_text(publish(&mut u, "", "app.q")),
        "write access to exchange 'amq.default' in vhost 'a' refused for user 'u'"
    );

    // consume, get, purge: read on the queue.
    let opts = SubscribeOptions {
        tag: Bytes::from_static(b"c"),
        ..Default::default()
    };
    assert!(u.subscribe("other", opts.clone()).is_err());
    u.subscribe("app.q", opts).expect("consume app.q");
    assert!(u.get("other", GetAck::Auto).is_err());
    assert!(u.get("app.q", GetAck::Auto).is_ok());
    assert_eq!(
        refused_text(u.purge_queue("other")),
        "read access to queue 'other' in vhost 'a' refused for user 'u'"
    );
    assert_eq!(u.purge_queue("app.q").expect("purge"), 0);
}

#[test]
fn topic_permissions_restrict_topic_exchanges_only_with_variables() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    tenants(&e);
    user(&e, "u", "x");
    perms(&e, "u", "a", ".*", ".*", ".*");
    topic(&e, "u", "a", "^{username}\\.", "^{client_id}\\.|^public\\.");
    let mut c = Client::open(&e, "a", "u").expect("u");
    c.set_client_id("dev1");
    c.declare_queue(queue(&c, "q")).expect("q");
    assert!(publish(&mut c, "amq.topic", "u.temp").is_ok());
    assert_eq!(
        refused_text(publish(&mut c, "amq.topic", "v.temp")),
        "write access to topic 'v.temp' in exchange 'amq.topic' in vhost 'a' refused for user 'u'"
    );
    // The decision is cached per key: the same refusal again.
    assert!(publish(&mut c, "amq.topic", "v.temp").is_err());
    // Other exchanges (not topic, or no topic permissions) are not restricted.
    assert!(publish(&mut c, "amq.direct", "v.temp").is_ok());
    let bind = |c: &mut Client, key: &str| {
        c.bind(
            "amq.topic",
            DestinationKind::Queue,
            "q",
            key,
            serde_json::json!({}),
        )
    };
    bind(&mut c, "dev1.#").expect("own client id");
    bind(&mut c, "public.*").expect("public");
    assert_eq!(
        refused_text(bind(&mut c, "dev2.#")),
        "read access to topic 'dev2.#' in exchange 'amq.topic' in vhost 'a' refused for user 'u'"
    );
    // A change applies to the open client at its next operation.
    durable(
        e.clear_topic_permissions("u", "a", None)
            .expect("clear")
            .expect("there were some"),
    );
    assert!(publish(&mut c, "amq.topic", "v.temp").is_ok());
    bind(&mut c, "dev2.#").expect("unrestricted now");
    durable(e.clear_permissions("u", "a").expect("clear").expect("some"));
    assert_eq!(
        refused_text(publish(&mut c, "amq.topic", "u.temp")),
        "access to vhost 'a' refused for user 'u'"
    );
}

#[test]
fn definitions_survive_a_restart_and_users_change_at_runtime() {
    let store = MemStore::new();
    {
        let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        tenants(&e);
        user(&e, "u", "old");
        user(&e, "gone", "x");
        perms(&e, "u", "a", "^c$", "^w$", "^r$");
        perms(&e, "gone", "a", ".*", ".*", ".*");
        topic(&e, "u", "a", "^w\\.", "^r\\.");
        assert!(e.authenticator().authenticate("u", b"old", REMOTE).is_ok());
        // A changed password: the old one is refused at once (cache too).
        user(&e, "u", "new");
        assert!(e
            .authenticator()
            .check_cached("u", b"old", REMOTE)
            .is_none());
        assert!(e.authenticator().authenticate("u", b"old", REMOTE).is_err());
        durable(e.delete_user("gone").expect("delete").expect("existed"));
        assert!(Client::open(&e, "a", "gone").is_err());
        // Permissions need an existing user and tenant.
        assert!(matches!(
            e.set_permissions(PermissionDef::full("nobody", "a")),
            Err(EngineError::NotFound(_))
        ));
        assert!(matches!(
            e.set_permissions(PermissionDef::full("u", "nope")),
            Err(EngineError::NotFound(_))
        ));
    }
    let e = Engine::open(store.reopen(), ManualClock::new()).expect("reopened");
    assert!(e.authenticator().authenticate("u", b"new", REMOTE).is_ok());
    assert!(e
        .authenticator()
        .authenticate("gone", b"x", REMOTE)
        .is_err());
    assert_eq!(e.users().len(), 1, "no default guest once users are stored");
    assert_eq!(
        e.permissions().list(),
        vec![PermissionDef {
            user: "u".into(),
            vhost: "a".into(),
            configure: "^c$".into(),
            write: "^w$".into(),
            read: "^r$".into(),
            from_config: false,
        }]
    );
    assert_eq!(e.permissions().list_topic().len(), 1);
    let mut c = Client::open(&e, "a", "u").expect("u");
    assert!(c.declare_queue(queue(&c, "c")).is_ok());
    assert!(c.declare_queue(queue(&c, "d")).is_err());
    assert!(Client::open(&e, "a", "gone").is_err());
}

#[test]
fn configured_definitions_replace_earlier_configured_ones_only() {
    let store = MemStore::new();
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    tenants(&e);
    user(&e, "api-user", "x");
    perms(&e, "api-user", "a", ".*", ".*", ".*");
    let cfg_user = |name: &str| UserDef {
        name: name.into(),
        password_hash: weir_engine::auth::GUEST_PASSWORD_HASH.into(),
        tags: vec![],
        loopback_only: false,
        from_config: true,
    };
    let full = |u: &str, v: &str| PermissionDef {
        from_config: true,
        ..PermissionDef::full(u, v)
    };
    let apply = |c: weir_engine::definitions::Configured| {
        for w in e.apply_configured(c).expect("apply") {
            durable(w);
        }
    };
    apply(weir_engine::definitions::Configured {
        users: vec![cfg_user("c1"), cfg_user("c2")],
        permissions: vec![full("c1", "a"), full("c2", "b")],
        topic_permissions: vec![],
    });
    assert!(Client::open(&e, "a", "c1").is_ok());
    assert!(Client::open(&e, "b", "c2").is_ok());
    // The next start's configuration drops c2 and c1's access to a.
    apply(weir_engine::definitions::Configured {
        users: vec![cfg_user("c1")],
        permissions: vec![full("c1", "b")],
        topic_permissions: vec![],
    });
    let e2 = Engine::open(store.reopen(), ManualClock::new()).expect("reopened");
    for e in [&e, &e2] {
        assert!(Client::open(e, "a", "c1").is_err());
        assert!(Client::open(e, "b", "c1").is_ok());
        assert!(Client::open(e, "b", "c2").is_err());
        assert!(e
            .authenticator()
            .authenticate("c2", b"guest", REMOTE)
            .is_err());
        // What the configuration never set stays.
        assert!(Client::open(e, "a", "api-user").is_ok());
    }
}
