//! A shovel's task: connect both ends, move batches, acknowledge the
//! source after the destination confirmed, and on a failure start again
//! after a growing delay.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::amqp::{AmqpDest, AmqpSource};
use super::def::{AckMode, DeleteAfter, Endpoint, Target, MAX_RECONNECT_DELAY};
use super::local::{LocalDest, LocalSource};
use super::mqtt::{MqttDest, MqttSource};
use super::nats::{NatsDest, NatsSource};
use super::{Entry, Msg, ShovelDef, ShovelError, State, Status};
use crate::server::Services;

/// The metric of messages moved, per vhost and shovel.
pub const TRANSFERRED: &str = "weir_shovel_messages_transferred_total";
/// The metric of failures (each one a reconnect), per vhost and shovel.
pub const FAILURES: &str = "weir_shovel_failures_total";
/// 1 while a shovel is running, per vhost and shovel.
pub const RUNNING: &str = "weir_shovel_running";

/// Starts `e`'s task.
pub(super) fn spawn(services: &Arc<Services>, e: &Entry) -> tokio::task::AbortHandle {
    let task = Task {
        services: services.clone(),
        vhost: e.vhost.clone(),
        name: e.name.clone(),
        def: e.def.clone(),
        user: e.user.clone(),
        status: e.status.clone(),
    };
    tokio::spawn(task.run()).abort_handle()
}

struct Task {
    services: Arc<Services>,
    vhost: String,
    name: String,
    def: ShovelDef,
    user: String,
    status: Arc<Status>,
}

enum Source {
    Local(LocalSource),
    Amqp(AmqpSource),
    Mqtt(MqttSource),
    Nats(NatsSource),
}

enum Dest {
    Local(LocalDest),
    Amqp(AmqpDest),
    Mqtt(MqttDest),
    Nats(NatsDest),
}

/// How a session of the shovel ended without failing.
enum Ended {
    /// `src-delete-after` reached.
    Done,
}

impl Task {
    async fn run(self) {
        let labels = [("vhost", self.vhost.clone()), ("shovel", self.name.clone())];
        let running = metrics::gauge!(RUNNING, &labels);
        let failures = metrics::counter!(FAILURES, &labels);
        let mut delay = self.def.reconnect_delay;
        // `src-delete-after`: what is left to move, across reconnects.
        let mut remaining: Option<u64> = match self.def.delete_after {
            DeleteAfter::Never | DeleteAfter::QueueLength => None,
            DeleteAfter::Count(n) => Some(n),
        };
        loop {
            self.status.set(State::Starting, None);
            let before = self.status.transferred.load(Ordering::Relaxed);
            let r = self.session(&mut remaining, &running).await;
            running.set(0.0);
            match r {
                Ok(Ended::Done) => {
                    self.status.set(State::Terminated, Some("finished".into()));
                    tracing::info!(vhost = %self.vhost, shovel = %self.name, "shovel finished (src-delete-after)");
                    self.services
                        .shovels
                        .finished(&self.vhost, &self.name, &self.status);
                    return;
                }
                Err(e) => {
                    failures.increment(1);
                    self.status.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(vhost = %self.vhost, shovel = %self.name, error = %e, retry_in_ms = delay.as_millis() as u64, "shovel failed");
                    self.status.set(State::Terminated, Some(e.to_string()));
                }
            }
            // A session that moved something was healthy: back to the
            // configured delay; failures in a row wait longer each time.
            if self.status.transferred.load(Ordering::Relaxed) > before {
                delay = self.def.reconnect_delay;
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2)
                .min(MAX_RECONNECT_DELAY)
                .max(Duration::from_millis(100));
        }
    }

    fn client_id(&self, side: &str) -> String {
        // MQTT client ids: stable per shovel, so the source's persistent
        // session is resumed after a reconnect.
        let raw = format!("weir-shovel-{side}-{}-{}", self.vhost, self.name);
        raw.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .take(128)
            .collect()
    }

    async fn open_source(&self) -> Result<(Source, Option<u64>), ShovelError> {
        let d = &self.def;
        let no_ack = d.ack_mode == AckMode::NoAck;
        Ok(match &d.src {
            Endpoint::Local { vhost, target } => {
                let Target::Queue(q) = target else {
                    return Err(ShovelError::Closed("a local source is a queue".into()));
                };
                let s = LocalSource::open(
                    &self.services.engine,
                    vhost,
                    &self.user,
                    q,
                    d.prefetch,
                    no_ack,
                )
                .await?;
                let len = s.queue_length()?;
                (Source::Local(s), Some(len))
            }
            Endpoint::Amqp { uri, target } => {
                let s = AmqpSource::open(uri, target, d.prefetch, no_ack).await?;
                let len = s.queue_length();
                (Source::Amqp(s), Some(len))
            }
            Endpoint::Mqtt { uri, topic, qos } => {
                let filter = topic.as_deref().unwrap_or("#");
                let s = MqttSource::open(
                    uri,
                    &self.client_id("src"),
                    filter,
                    *qos,
                    d.prefetch,
                    no_ack,
                )
                .await?;
                (Source::Mqtt(s), None)
            }
            Endpoint::Nats {
                uri,
                subject,
                stream,
                consumer,
            } => {
                let js = stream.clone().zip(consumer.clone());
                let s = NatsSource::open(uri, subject.as_deref().unwrap_or(""), js).await?;
                (Source::Nats(s), None)
            }
        })
    }

    async fn open_dest(&self) -> Result<Dest, ShovelError> {
        let d = &self.def;
        Ok(match &d.dest {
            Endpoint::Local { vhost, target } => Dest::Local(
                LocalDest::open(
                    &self.services.engine,
                    self.services.alarms.subscribe(),
                    vhost,
                    &self.user,
                    target.clone(),
                )
                .await?,
            ),
            Endpoint::Amqp { uri, target } => Dest::Amqp(AmqpDest::open(uri, target).await?),
            Endpoint::Mqtt { uri, topic, qos } => Dest::Mqtt(
                MqttDest::open(
                    uri,
                    &self.client_id("dest"),
                    topic.clone(),
                    *qos,
                    d.prefetch,
                )
                .await?,
            ),
            Endpoint::Nats {
                uri,
                subject,
                stream,
                ..
            } => Dest::Nats(NatsDest::open(uri, subject.clone(), stream.is_some()).await?),
        })
    }

    async fn session(
        &self,
        remaining: &mut Option<u64>,
        running: &metrics::Gauge,
    ) -> Result<Ended, ShovelError> {
        // Destination first: messages are taken only once they can go.
        let mut dest = self.open_dest().await?;
        let (mut src, queue_length) = self.open_source().await?;
        if remaining.is_none() && self.def.delete_after == DeleteAfter::QueueLength {
            // The queue's length when the shovel first started.
            *remaining = Some(queue_length.unwrap_or(0));
        }
        self.status.set(State::Running, None);
        running.set(1.0);
        let labels = [("vhost", self.vhost.clone()), ("shovel", self.name.clone())];
        let transferred = metrics::counter!(super::run::TRANSFERRED, &labels);
        let codecs = self.services.engine.codecs();
        let prefetch = usize::from(self.def.prefetch);
        let mut batch: Vec<Msg> = Vec::with_capacity(prefetch);
        let r = async {
            loop {
                let max = match *remaining {
                    Some(0) => return Ok(Ended::Done),
                    Some(n) => prefetch.min(usize::try_from(n).unwrap_or(usize::MAX)),
                    None => prefetch,
                };
                batch.clear();
                match &mut src {
                    Source::Local(s) => s.recv(max, &mut batch).await?,
                    Source::Amqp(s) => s.recv(max, &mut batch).await?,
                    Source::Mqtt(s) => s.recv(max, &mut batch).await?,
                    Source::Nats(s) => s.recv(max, &mut batch).await?,
                }
                let confirm = self.def.ack_mode == AckMode::OnConfirm;
                match &mut dest {
                    Dest::Local(d) => d.send(&batch, confirm).await?,
                    Dest::Amqp(d) => d.send(&batch, confirm, &codecs).await?,
                    Dest::Mqtt(d) => d.send(&batch, confirm).await?,
                    Dest::Nats(d) => d.send(&batch, confirm).await?,
                }
                match &mut src {
                    Source::Local(s) => s.ack(&batch)?,
                    Source::Amqp(s) => s.ack(&batch).await?,
                    Source::Mqtt(s) => s.ack(&batch).await?,
                    Source::Nats(s) => s.ack(&batch).await?,
                }
                let n = batch.len() as u64;
                self.status.transferred.fetch_add(n, Ordering::Relaxed);
                transferred.increment(n);
                if let Some(r) = remaining.as_mut() {
                    *r = r.saturating_sub(n);
                }
            }
        }
        .await;
        if let Source::Amqp(s) = src {
            s.close().await;
        }
        if let Dest::Amqp(d) = dest {
            d.close().await;
        }
        r
    }
}
