//! The shovel's ends on this broker: a Weir queue consumed, or a Weir
//! exchange or queue published to, through one engine [`Client`] opened as
//! the shovel's user — another client of the engine, like a session, so
//! every permission, limit and the durability of confirms is the engine's.

use std::sync::Arc;

use bytes::Bytes;
use weir_engine::client::{Published, SubscribeOptions};
use weir_engine::lease::Settle;
use weir_engine::message::Message;
use weir_engine::properties::{HeaderFormat, NoHeaders, Properties};
use weir_engine::{Client, Engine};

use super::def::Target;
use super::{Msg, ShovelError};

/// The scope the shovel's subscription and leases live in.
const SCOPE: u32 = 1;

/// A queue the shovel names that does not exist is declared durable,
/// without arguments, as RabbitMQ's shovel declares its `src-queue` and
/// `dest-queue` (with the shovel user's configure permission).
async fn ensure_queue(engine: &Engine, client: &mut Client, name: &str) -> Result<(), ShovelError> {
    if client.queue_exists(name) {
        return Ok(());
    }
    let connection = client.id();
    let (_, wait) = client
        .declare_queue(weir_engine::tenant::QueueDeclare {
            name: name.to_string(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: serde_json::json!({}),
            connection,
        })
        .map_err(ShovelError::engine)?;
    crate::session::durable::settled(engine, wait)
        .await
        .map_err(|_| ShovelError::Engine("the store failed".into()))
}

/// A Weir queue the shovel consumes.
pub struct LocalSource {
    client: Client,
    next_tag: u64,
    no_ack: bool,
    queue: String,
}

impl LocalSource {
    /// Subscribes to `queue` of `vhost` as `user`.
    pub async fn open(
        engine: &Arc<Engine>,
        vhost: &str,
        user: &str,
        queue: &str,
        prefetch: u16,
        no_ack: bool,
    ) -> Result<Self, ShovelError> {
        let mut client = Client::open(engine, vhost, user).map_err(ShovelError::engine)?;
        ensure_queue(engine, &mut client, queue).await?;
        client
            .subscribe(
                queue,
                SubscribeOptions {
                    scope: SCOPE,
                    tag: Bytes::from_static(b"weir-shovel"),
                    no_ack,
                    prefetch_count: u32::from(prefetch),
                    ..Default::default()
                },
            )
            .map_err(ShovelError::engine)?;
        Ok(LocalSource {
            client,
            next_tag: 1,
            no_ack,
            queue: queue.to_string(),
        })
    }

    /// Messages in the queue now (for `src-delete-after: queue-length`).
    pub fn queue_length(&self) -> Result<u64, ShovelError> {
        let q = self
            .client
            .queue(&self.queue)
            .map_err(ShovelError::engine)?;
        Ok(q.message_count())
    }

    /// Waits for at least one delivery, then takes what is there, up to `max`.
    pub async fn recv(&mut self, max: usize, out: &mut Vec<Msg>) -> Result<(), ShovelError> {
        let mut notices = Vec::new();
        loop {
            self.client.drain(&mut notices);
            if notices
                .iter()
                .any(|n| matches!(n, weir_engine::consumer::Notice::ConsumerCancelled { .. }))
            {
                return Err(ShovelError::Closed(format!(
                    "queue '{}' was deleted",
                    self.queue
                )));
            }
            notices.clear();
            let clock = self.client.clock().clone();
            let (now, now_ms) = (clock.now(), clock.now_ms());
            while out.len() < max {
                let Some(d) = self.client.next_delivery() else {
                    break;
                };
                let Some(m) = self.client.message_of(&d) else {
                    self.client.discard(d);
                    continue;
                };
                let tag = self.next_tag;
                self.next_tag += 1;
                out.push(Msg {
                    exchange: String::from_utf8_lossy(&m.exchange).into_owned(),
                    routing_key: String::from_utf8_lossy(&m.routing_key).into_owned(),
                    header: Some((m.header_format, m.properties.clone())),
                    body: m.body.clone(),
                    persistent: m.persistent,
                    ack: tag,
                });
                self.client.lease(SCOPE, tag, d, now, now_ms);
            }
            self.client.finish_deliveries();
            if self.client.has_uncommitted() {
                self.client.commit();
            }
            if !out.is_empty() {
                return Ok(());
            }
            self.client.handle().notified().await;
        }
    }

    /// Acknowledges everything up to the batch's last message.
    pub fn ack(&mut self, batch: &[Msg]) -> Result<(), ShovelError> {
        if self.no_ack {
            return Ok(());
        }
        if let Some(last) = batch.last() {
            self.client
                .settle(SCOPE, last.ack, true, Settle::Ack)
                .map_err(ShovelError::engine)?;
            self.client.commit();
        }
        Ok(())
    }
}

impl Drop for LocalSource {
    fn drop(&mut self) {
        // Unacknowledged deliveries go back to the queue.
        self.client.close();
    }
}

/// A Weir exchange or queue the shovel publishes to.
pub struct LocalDest {
    client: Client,
    target: Target,
    engine: Arc<Engine>,
    alarms: tokio::sync::watch::Receiver<crate::server::Alarms>,
}

impl LocalDest {
    /// An engine client of `vhost` as `user`.
    pub async fn open(
        engine: &Arc<Engine>,
        alarms: tokio::sync::watch::Receiver<crate::server::Alarms>,
        vhost: &str,
        user: &str,
        target: Target,
    ) -> Result<Self, ShovelError> {
        let mut client = Client::open(engine, vhost, user).map_err(ShovelError::engine)?;
        if let Target::Queue(q) = &target {
            ensure_queue(engine, &mut client, q).await?;
        }
        Ok(LocalDest {
            client,
            target,
            engine: engine.clone(),
            alarms,
        })
    }

    /// Publishes the batch; with `confirm`, returns once every persistent
    /// copy is durable (the same barrier as a publisher confirm).
    pub async fn send(&mut self, batch: &[Msg], confirm: bool) -> Result<(), ShovelError> {
        // Resource alarms stop the shovel as they stop every publisher.
        if self.alarms.borrow().any() {
            self.alarms
                .wait_for(|a| !a.any())
                .await
                .map_err(|_| ShovelError::Closed("broker shutting down".into()))?;
        }
        let codecs = self.engine.codecs();
        let mut needs_barrier = false;
        for m in batch {
            let (exchange, key) = match &self.target {
                Target::Queue(q) => ("", q.as_str()),
                Target::Exchange { name, key } => {
                    (name.as_str(), key.as_deref().unwrap_or(&m.routing_key))
                }
            };
            let (format, raw, props) = match &m.header {
                Some((f, raw)) => {
                    let p = codecs.decode(*f, raw).unwrap_or_default();
                    (*f, raw.clone(), p)
                }
                None => {
                    let p = Properties {
                        delivery_mode: Some(if m.persistent {
                            weir_engine::properties::DeliveryMode::Persistent
                        } else {
                            weir_engine::properties::DeliveryMode::Transient
                        }),
                        ..Properties::default()
                    };
                    let raw = p
                        .to_bytes()
                        .map_err(|e| ShovelError::Engine(format!("properties: {e}")))?;
                    (HeaderFormat::WEIR, raw, p)
                }
            };
            self.client
                .check_message_size(m.body.len() as u64)
                .map_err(ShovelError::engine)?;
            let route = weir_engine::tenant::RouteInput {
                exchange,
                routing_key: key,
                headers: &NoHeaders,
            };
            let persistent = props.is_persistent();
            let r = self
                .client
                .publish(&route, |id| Message {
                    id,
                    exchange: Bytes::from(exchange.to_string()),
                    routing_key: Bytes::from(key.to_string()),
                    properties: raw,
                    body: m.body.clone(),
                    header_format: format,
                    persistent,
                    priority: props.priority.unwrap_or(0),
                    ttl_ms: props.ttl_ms,
                })
                .map_err(ShovelError::engine)?;
            match r {
                // As RabbitMQ's shovel publishes: not mandatory, so an
                // unroutable message is confirmed and dropped.
                Published::Unroutable => {}
                Published::NoSpace => {
                    return Err(ShovelError::Nacked("the store is out of disk space".into()))
                }
                Published::Routed { refused: true, .. } => {
                    return Err(ShovelError::Nacked(
                        "a destination queue refused the message (overflow reject-publish)".into(),
                    ))
                }
                Published::Routed {
                    needs_barrier: b, ..
                } => needs_barrier |= b,
            }
        }
        let wait =
            (needs_barrier && confirm).then(|| crate::session::durable::appended(&mut self.client));
        self.client.commit();
        if let Some(w) = wait {
            w.await
                .map_err(|_| ShovelError::Nacked("the store failed".into()))?;
        }
        Ok(())
    }
}

impl Drop for LocalDest {
    fn drop(&mut self) {
        self.client.close();
    }
}
