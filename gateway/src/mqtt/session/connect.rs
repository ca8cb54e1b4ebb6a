//! CONNECT: login (the tenant from a `tenant:user` username, as RabbitMQ's
//! MQTT plugin takes the vhost), takeover of a connected client id, the
//! session queue (kept or started anew), and what happens at the end: the
//! clean session's queue goes, the will is published (after its delay).

use super::{InFlight, Session, Subscription, SCOPE};
use crate::engine::client::SubscribeOptions;
use crate::engine::tenant::QueueDeclare;
use crate::engine::{Client, EngineError, DEFAULT_TENANT};
use crate::metrics::{ConnMetrics, Protocol};
use crate::tenant_gate::TenantGate;
use serde_json::{json, Value};
use std::sync::Arc;
use weir_protocols::mqtt::{Connect, ConnectAccept, ConnectRefusal, QoS, Version, Will};

/// The exchange MQTT topics route through.
pub(crate) const TOPIC_EXCHANGE: &str = crate::engine::topic::MQTT_EXCHANGE;

/// The session queue of `client_id`, named as RabbitMQ's MQTT plugin names it.
pub(crate) fn session_queue(client_id: &str) -> String {
    format!("mqtt-subscription-{client_id}qos1")
}

/// Binding arguments recording a subscription's options (so a resumed
/// session knows them).
pub(crate) fn binding_arguments(s: &Subscription) -> Value {
    json!({
        "x-mqtt-filter": s.filter,
        "x-mqtt-qos": s.qos as u8,
        "x-mqtt-no-local": s.no_local,
        "x-mqtt-retain-as-published": s.retain_as_published,
        "x-mqtt-subscription-id": s.subscription_id,
    })
}

/// The subscription a binding records, if it is one of ours.
fn subscription_of(args: &Value) -> Option<Subscription> {
    let filter = args.get("x-mqtt-filter")?.as_str()?.to_string();
    let qos = match args.get("x-mqtt-qos")?.as_u64()? {
        0 => QoS::AtMostOnce,
        1 => QoS::AtLeastOnce,
        _ => QoS::ExactlyOnce,
    };
    Some(Subscription {
        filter,
        qos,
        no_local: args
            .get("x-mqtt-no-local")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        retain_as_published: args
            .get("x-mqtt-retain-as-published")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        subscription_id: args
            .get("x-mqtt-subscription-id")
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok()),
    })
}

impl Session {
    pub(super) async fn on_connect(&mut self, c: Connect) {
        // Tenant and user.
        let password = c.password.as_ref().map(|p| p.expose()).unwrap_or_default();
        // Certificate login (`mqtt.ssl_cert_login`, over TLS with a verified
        // client certificate): without a password, the certificate's CN is
        // the user; a username, if given, only picks the tenant
        // (`tenant:` or `tenant:CN`). A password means a password login,
        // as in RabbitMQ.
        let cert_user = self
            .cert_user
            .clone()
            .filter(|_| self.shared.mqtt.ssl_cert_login && password.is_empty());
        let (tenant, user, verdict) = if let Some(cn) = cert_user {
            let tenant = match c.username.as_deref().map(|u| u.split_once(':')) {
                Some(Some((t, u))) if !t.is_empty() && (u.is_empty() || u == cn) => {
                    Some(t.to_string())
                }
                Some(Some((t, u))) if t.is_empty() && (u.is_empty() || u == cn) => {
                    Some(DEFAULT_TENANT.to_string())
                }
                Some(None) if c.username.as_deref() == Some(cn.as_str()) => {
                    Some(DEFAULT_TENANT.to_string())
                }
                Some(_) => None,
                None => Some(DEFAULT_TENANT.to_string()),
            };
            match tenant {
                Some(t) => {
                    let r = self.shared.login_certificate(&cn, self.peer);
                    (t, cn, r.map(drop).map_err(|_| None))
                }
                // A username naming someone else than the certificate.
                None => (String::new(), cn, Err(None)),
            }
        } else if let Some(username) = c.username.clone() {
            let (tenant, user) = match username.split_once(':') {
                Some((t, u)) if !t.is_empty() => (t.to_string(), u.to_string()),
                _ => (DEFAULT_TENANT.to_string(), username.clone()),
            };
            let r = self.shared.login(&user, password, self.peer).await;
            (tenant, user, r.map(drop).map_err(Some))
        } else if let Some(user) = self.shared.mqtt.anonymous_user.clone() {
            // Anonymous (`mqtt.allow_anonymous`, as RabbitMQ's MQTT
            // plugin): the default user, on the default tenant, without a
            // password but with the user's own rules: it must exist, and
            // `guest` is accepted from loopback only, so an anonymous
            // client from another machine is refused as guest would be.
            let r = self.shared.login_certificate(&user, self.peer);
            (
                DEFAULT_TENANT.to_string(),
                user,
                r.map(drop).map_err(|_| None),
            )
        } else {
            self.refuse(
                ConnectRefusal::NotAuthorized,
                "anonymous clients are not allowed (mqtt.allow_anonymous = false)",
            );
            return;
        };
        // A certificate refused costs no hash, but counts against the source.
        let verdict =
            verdict.map_err(|r| r.unwrap_or_else(|| self.shared.login_refused(self.peer)));
        if let Err(refused) = verdict {
            crate::metrics::auth_failure(Protocol::Mqtt);
            let delay = refused.delay();
            tracing::info!(peer = %self.peer, %user, delay_ms = delay.as_millis() as u64, reason = %refused, "MQTT login refused");
            tokio::time::sleep(delay).await;
            // A source over its budget (or with too many logins waiting) is
            // "not authorized" (0x87, 3.1.1: 5), as a broker refusing by
            // policy answers: the password was never checked.
            if refused.is_throttled() {
                self.refuse(ConnectRefusal::NotAuthorized, &refused.to_string());
            } else {
                self.refuse(
                    ConnectRefusal::BadUserNameOrPassword,
                    "bad user name or password",
                );
            }
            return;
        }
        let limit = self.shared.mqtt.max_connections;
        if limit > 0 && self.shared.mqtt.registry.connected() >= limit {
            self.refuse(ConnectRefusal::QuotaExceeded, "too many MQTT connections");
            return;
        }
        let mut client = match Client::open(&self.engine, &tenant, &user) {
            Ok(c) => c,
            // The tenant's max-connections: 0x97 (MQTT 3.1.1: 0x03).
            Err(EngineError::Quota(q)) => {
                crate::metrics::quota_refused(Protocol::Mqtt);
                self.refuse(ConnectRefusal::QuotaExceeded, &q.to_string());
                return;
            }
            Err(e) => {
                // No such tenant, or no permissions there: CONNACK 0x87 / 5.
                let text = match e {
                    EngineError::AccessRefused(t) => t,
                    _ => format!("no vhost '{tenant}'"),
                };
                tracing::info!(peer = %self.peer, %user, %tenant, "MQTT tenant access refused");
                self.refuse(ConnectRefusal::NotAuthorized, &text);
                return;
            }
        };
        let assigned = c.client_id.is_empty().then(|| {
            format!(
                "weir-{}-{}",
                client.id(),
                client.clock().now_ms() % 1_000_000
            )
        });
        let client_id = assigned.clone().unwrap_or_else(|| c.client_id.clone());
        // `{client_id}` in topic permissions.
        client.set_client_id(&client_id);
        let span = tracing::Span::current();
        span.record("client_id", client_id.as_str());
        span.record("user", user.as_str());
        span.record("vhost", tenant.as_str());
        let mut m = Box::new(ConnMetrics::open(Protocol::Mqtt, &tenant));
        m.before_open(&std::mem::take(&mut self.pre_open));
        // An MQTT session is one channel.
        m.channel_opened();
        self.metrics = Some(m);
        self.tenant = tenant;
        self.client_id = client_id.clone();
        self.conn_id = client.id();
        let rule = self.engine.connection_quotas.find(&user, Some(&client_id));
        self.flow.gate = TenantGate::for_client(&client, rule.as_deref()).map(Box::new);
        let engine = client.handle().clone();
        self.client = Some(client);

        let (registration, _took_over) = self
            .shared
            .mqtt
            .registry
            .take(&self.tenant, &client_id, self.conn_id)
            .await;
        self.registration = Some(registration);
        self.listed = Some(
            self.shared
                .connections
                .register(crate::connections::NewConnection {
                    // As RabbitMQ's MQTT plugin names them.
                    protocol: match c.version {
                        Version::V311 => "MQTT 3.1.1",
                        Version::V5 => "MQTT 5.0",
                    },
                    peer: self.peer,
                    local: None,
                    user: &user,
                    vhost: &self.tenant,
                    tls: self.cert_user.is_some(),
                    client_id: &client_id,
                    engine: &engine,
                    client_properties: None,
                }),
        );
        if let Some(l) = &self.listed {
            // An MQTT session is channel 1 (as consumers name it).
            l.set_channels(1);
            if let Some(m) = self.metrics.as_mut() {
                m.report_to(l.info().clone());
            }
        }

        self.session_expiry_secs = c.session_expiry_secs;
        let max_expiry = self.shared.mqtt.max_session_expiry_secs;
        let granted =
            (max_expiry > 0 && self.session_expiry_secs > max_expiry).then_some(max_expiry);
        if let Some(g) = granted {
            self.session_expiry_secs = g;
        }
        let session_present = match self.open_session_queue(c.clean_start).await {
            Ok(present) => present,
            Err(e) => {
                tracing::warn!(peer = %self.peer, client_id = %client_id, error = %e, "cannot open the MQTT session");
                self.refuse(ConnectRefusal::ServerUnavailable, "cannot open the session");
                return;
            }
        };
        self.receive_maximum = u32::from(c.receive_maximum);
        // A resumed session's queue is consumed now, and a new persistent
        // session's is declared now (the session exists from CONNACK on,
        // subscriptions or not); a clean session gets its queue with its
        // first subscription (an idle client without one costs no queue).
        let opened = if session_present {
            self.consume_session_queue()
        } else if self.session_expiry_secs > 0 {
            // CONNACK leaves once the queue's record is durable.
            self.hold = self.durability.ticket();
            self.declare_session_queue()
        } else {
            Ok(())
        };
        if let Err(EngineError::Quota(q)) = &opened {
            // The tenant's max-queues or max-consumers: 0x97.
            crate::metrics::quota_refused(Protocol::Mqtt);
            self.refuse(ConnectRefusal::QuotaExceeded, &q.to_string());
            return;
        }
        if let Err(e) = opened {
            tracing::warn!(peer = %self.peer, client_id = %client_id, error = %e, "cannot consume the MQTT session queue");
            self.refuse(ConnectRefusal::ServerBusy, "the session is in use");
            return;
        }
        self.will = c.will.clone().map(Box::new);
        self.conn.accept(ConnectAccept {
            session_present,
            assigned_client_id: assigned,
            server_keep_alive: None,
            session_expiry_secs: granted.filter(|_| c.version == Version::V5),
            // MQTT 5 request/response: where this client may have its
            // responses sent (the adapter sends it only when asked).
            response_information: Some(format!("responses/{}", self.client_id)),
        });
        let parked = self
            .shared
            .mqtt
            .registry
            .take_resends(&self.tenant, &self.client_id);
        if session_present {
            self.resume_session_state();
            if let Some(ids) = parked {
                self.resume.get_or_insert_default().send1 = ids;
            }
        } else {
            // Left by an expired or ended session of the same client id.
            self.clear_session_state();
        }
        tracing::debug!(peer = %self.peer, client_id = %self.client_id, tenant = %self.tenant, session_present, subscriptions = self.subscriptions.len(), "MQTT session opened");
    }

    fn refuse(&mut self, r: ConnectRefusal, text: &str) {
        self.end_reason = Some(text.to_string());
        self.conn.refuse(r, text);
    }

    /// Declares the session queue (deleting an old one first for a clean
    /// start) and, for a resumed session, reads its subscriptions back from
    /// the queue's bindings. Returns whether a session was present.
    async fn open_session_queue(&mut self, clean_start: bool) -> Result<bool, EngineError> {
        let name = self.queue();
        let Some(client) = self.client.as_mut() else {
            return Ok(false);
        };
        // Through the client, as any queue of the tenant: configure to
        // delete it, read to see its bindings (the session consumes it next).
        let exists = client.queue(&name).is_ok();
        if exists && clean_start {
            let (_, wait) = client.delete_queue(&name, false, false)?;
            if let Some(w) = wait {
                let _ = w.await;
            }
        }
        if exists && !clean_start {
            // The queue's own bindings, not every binding of amq.topic: a
            // reconnect storm of N sessions costs O(N), not O(N²).
            self.subscriptions = client
                .queue_bindings(&name)?
                .into_iter()
                .filter(|b| b.source == TOPIC_EXCHANGE)
                .filter_map(|b| subscription_of(&b.arguments))
                .collect();
            return Ok(true);
        }
        Ok(false)
    }

    /// Declares the session queue of a new session (at its first
    /// subscription). Its metadata record precedes the SUBACK's barrier.
    pub(super) fn declare_session_queue(&mut self) -> Result<(), EngineError> {
        if self.client.is_none() {
            return Ok(());
        }
        let conn = self.conn_id;
        let persistent = self.session_expiry_secs > 0;
        let mut args = serde_json::Map::new();
        if persistent && self.session_expiry_secs != u32::MAX {
            args.insert(
                "x-expires".into(),
                json!(u64::from(self.session_expiry_secs) * 1000),
            );
        }
        let max_queued = self.shared.mqtt.max_queued_messages;
        if max_queued > 0 {
            args.insert("x-max-length".into(), json!(max_queued));
            args.insert("x-overflow".into(), json!("drop-head"));
        }
        let name = self.queue();
        let Some(client) = self.client.as_mut() else {
            return Ok(());
        };
        // Through the client: configure on the session queue is checked.
        client.declare_queue(QueueDeclare {
            name,
            passive: false,
            durable: persistent,
            exclusive: !persistent,
            auto_delete: false,
            arguments: Value::Object(args),
            connection: conn,
        })?;
        self.consume_session_queue()
    }

    /// The session's one consumer on its queue, within the client's
    /// receive maximum.
    pub(super) fn consume_session_queue(&mut self) -> Result<(), EngineError> {
        let queue = self.queue();
        let prefetch = self.receive_maximum;
        let Some(client) = self.client.as_mut() else {
            return Ok(());
        };
        client
            .subscribe(
                &queue,
                SubscribeOptions {
                    scope: SCOPE,
                    tag: bytes::Bytes::from_static(b"session"),
                    exclusive: true,
                    prefetch_count: prefetch,
                    ..Default::default()
                },
            )
            .map_err(|e| match e {
                crate::engine::ClientError::Engine(e @ EngineError::AccessRefused(_)) => e,
                e => EngineError::ResourceLocked(e.to_string()),
            })?;
        self.queue_open = true;
        Ok(())
    }

    /// Deletes a clean session's queue (and a persistent one that the
    /// client ended with session expiry 0), through its client (configure
    /// on the queue, as RabbitMQ's MQTT plugin checks).
    pub(super) fn delete_session_queue(&mut self) {
        let name = self.queue();
        if let Some(c) = self.client.as_mut() {
            if let Err(e) = c.delete_queue(&name, false, false) {
                tracing::debug!(client_id = %self.client_id, error = %e, "MQTT session queue not deleted");
            }
        }
    }

    /// A DISCONNECT changed the session expiry (MQTT 5 3.14.2.2.2): the
    /// session queue expires after the new interval (stored with the
    /// queue's definition, so a restart keeps it).
    pub(super) fn set_session_queue_expiry(&mut self) {
        let name = self.queue();
        let secs = self.session_expiry_secs;
        let ms = (secs != u32::MAX).then(|| u64::from(secs) * 1000);
        if let Some(c) = self.client.as_mut() {
            if let Err(e) = c.set_queue_expires(&name, ms) {
                tracing::warn!(client_id = %self.client_id, error = %e, "MQTT session expiry not changed");
            }
        }
    }

    /// Forgets the QoS 2 ids of the session (a new or ended session).
    pub(super) fn clear_session_state(&mut self) {
        let Some(c) = self.client.as_ref() else {
            return;
        };
        if let Err(e) = c.clear_session_state() {
            tracing::warn!(client_id = %self.client_id, error = %e, "MQTT session state not cleared");
        }
    }

    /// A resumed session's QoS 2 exchanges, as the session state recorded
    /// them: ids the client awaits PUBREL... for (its publishes), and ours:
    /// sent (the message goes again with its id, DUP) or received by the
    /// client (PUBREL again; the message, if its settle was lost, is not
    /// sent again).
    fn resume_session_state(&mut self) {
        let Some(c) = self.client.as_ref() else {
            return;
        };
        let state = match c.session_state() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(client_id = %self.client_id, error = %e, "MQTT session state not read");
                return;
            }
        };
        let mut shared = Vec::new();
        for (k, v) in state {
            let Some((dir, id)) = k.split_once('\0') else {
                continue;
            };
            if dir == super::subscriptions::SHARED_STATE {
                // A shared subscription of the session: joined again below.
                if let Some((group, filter)) = id.split_once('\0') {
                    let sub = serde_json::from_slice::<Value>(&v)
                        .ok()
                        .as_ref()
                        .and_then(subscription_of)
                        .filter(|s| s.filter == filter);
                    shared.push((group.to_string(), filter.to_string(), sub));
                }
                continue;
            }
            let Ok(packet_id) = id.parse::<u16>() else {
                continue;
            };
            let message = v
                .get(1..9)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map(u64::from_le_bytes);
            match (dir, v.first(), message) {
                ("in", _, _) => self.conn.expect_pubrel(packet_id),
                ("out", Some(b'P'), Some(m)) => {
                    self.conn.reserve_packet_id(packet_id);
                    self.resume
                        .get_or_insert_default()
                        .send
                        .insert(m, packet_id);
                }
                ("out", Some(b'R'), Some(m)) => {
                    self.resume.get_or_insert_default().skip.insert(m);
                    self.inflight.insert(
                        packet_id,
                        InFlight {
                            tag: None,
                            message: Some(m),
                            stored: true,
                        },
                    );
                    self.conn.pubrel(packet_id);
                }
                _ => {}
            }
        }
        for (group, filter, sub) in shared {
            let r = match sub {
                Some(sub) => self.subscribe_shared(&group, sub, false),
                None => Err(EngineError::CommandInvalid("unreadable options".into())),
            };
            if let Err(e) = r {
                // Its permission revoked, say: the session goes on without
                // it, and forgets it.
                tracing::info!(client_id = %self.client_id, %group, %filter, error = %e, "MQTT shared subscription not resumed");
                self.state_changes.push((
                    super::subscriptions::shared_state_key(&group, &filter),
                    None,
                ));
            }
        }
    }

    pub(super) fn engine_conn_id(&self) -> u64 {
        self.conn_id
    }

    /// Publishes the will now, or after its delay (cancelled if the client
    /// reconnects first; never later than the session's expiry).
    pub(super) fn schedule_will(&mut self, w: Will, user: String) {
        let engine = self.engine.clone();
        let (tenant, client_id) = (self.tenant.clone(), self.client_id.clone());
        let delay = w.delay_secs.min(self.session_expiry_secs);
        let shared = self.shared.clone();
        if delay == 0 {
            publish_will(&engine, &tenant, &user, &client_id, &w);
            return;
        }
        let (t2, c2) = (tenant.clone(), client_id.clone());
        let task = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_secs(u64::from(delay))).await;
            publish_will(&engine, &tenant, &user, &client_id, &w);
            shared.mqtt.registry.will_done(&tenant, &client_id);
        });
        self.shared
            .mqtt
            .registry
            .delay_will(&t2, &c2, task.abort_handle());
    }
}

/// Publishes a will message through `amq.topic` as its client would have.
fn publish_will(
    engine: &Arc<crate::engine::Engine>,
    tenant: &str,
    user: &str,
    client_id: &str,
    w: &Will,
) {
    let Ok(mut client) = Client::open(engine, tenant, user) else {
        return;
    };
    client.set_client_id(client_id);
    let p = weir_protocols::mqtt::Publish {
        topic: w.topic.clone(),
        payload: w.payload.clone(),
        qos: w.qos,
        retain: w.retain,
        dup: false,
        packet_id: None,
        properties: w.properties.clone(),
    };
    // Routed first: a will its user may not publish is not retained either.
    let routed = super::inbound::route(&mut client, &p, Some(client_id));
    if let Err(e) = &routed {
        tracing::debug!(error = %e, %client_id, "will message not published");
    }
    if w.retain && !matches!(routed, Err(EngineError::AccessRefused(_))) {
        let now = client.clock().now_ms();
        let i = crate::mqtt::message_format::inbound(&p, None, now);
        let _ = client.retain(&p.topic, i.header, p.payload.clone(), i.expires_at_ms, now);
    }
    client.commit();
    client.close();
}
