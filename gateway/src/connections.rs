//! The registry of live client connections, for the management API
//! (`/api/connections`, `/api/channels`) and metrics: every session
//! registers once it has opened its vhost and drops its [`Registration`]
//! when it ends. A registered connection can be asked to close
//! ([`Connections::close`]): its engine connection is woken, the session
//! finds [`Registration::close_reason`] set and ends the connection as a
//! broker shutdown would (AMQP: 320 CONNECTION_FORCED with the given
//! reason).
//!
//! Sessions keep their own state: the registry holds only what the API
//! shows (who, from where, since when, how many channels, the client's
//! properties, its traffic), bounded by the connections themselves. The
//! traffic counters ([`Traffic`]) are relaxed atomics a session adds its
//! batch's totals to once per batch (`ConnMetrics::flush`), never per
//! frame.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use serde_json::Value;
use weir_engine::consumer::ConnHandle;

/// What the API shows of one connection.
pub struct ConnInfo {
    /// Registry id.
    pub id: u64,
    /// RabbitMQ-style name: `"peer -> local"`.
    pub name: String,
    /// `"AMQP 0-9-1"`, `"MQTT 3.1.1"`, `"MQTT 5"`.
    pub protocol: &'static str,
    /// Client address.
    pub peer: SocketAddr,
    /// Who logged in.
    pub user: String,
    /// The vhost (tenant) it opened.
    pub vhost: String,
    /// When it was registered, ms since the epoch.
    pub connected_at_ms: u64,
    /// Over TLS.
    pub tls: bool,
    /// Open channels (AMQP; 1 for MQTT), readable without a lock.
    pub channels: AtomicU32,
    /// Open channel numbers and rate samples, behind one lock (one word
    /// less on every connection).
    detail: Mutex<Detail>,
    /// MQTT client id, or empty.
    pub client_id: String,
    /// The engine client's id (consumers name their connection by it).
    pub engine_id: u64,
    /// AMQP's start-ok client properties (bounded by the adapter) as
    /// RabbitMQ renders them; `None` for MQTT (shown as its client id).
    /// Boxed: most idle connections (MQTT) have none.
    client_properties: Option<Box<Value>>,
    /// Bytes and socket reads/writes so far.
    pub traffic: Traffic,
    /// Set when asked to close (the reason is in `detail`): the session
    /// checks it once per loop, one relaxed load.
    close_asked: AtomicBool,
    /// The session's engine connection, woken to see `close_asked`: no
    /// waiter or channel of its own per connection (an idle MQTT
    /// connection is counted in single kilobytes).
    wake: Arc<ConnHandle>,
}

/// A connection's traffic, as RabbitMQ counts it: octets and packets (here:
/// socket reads and writes) each way. Added to once per batch.
#[derive(Debug, Default)]
pub struct Traffic {
    /// Bytes read from the client (RabbitMQ's `recv_oct`).
    pub recv_oct: AtomicU64,
    /// Bytes written to the client (`send_oct`).
    pub send_oct: AtomicU64,
    /// Socket reads that returned data (`recv_cnt`).
    pub recv_cnt: AtomicU64,
    /// Socket writes that wrote data (`send_cnt`).
    pub send_cnt: AtomicU64,
}

impl Traffic {
    /// Adds a batch: bytes and reads in, bytes and writes out.
    #[inline]
    pub fn add(&self, recv_oct: u64, recv_cnt: u64, send_oct: u64, send_cnt: u64) {
        for (a, n) in [
            (&self.recv_oct, recv_oct),
            (&self.recv_cnt, recv_cnt),
            (&self.send_oct, send_oct),
            (&self.send_cnt, send_cnt),
        ] {
            if n > 0 {
                a.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

/// What the API reads under a connection's lock.
#[derive(Debug, Default)]
struct Detail {
    /// Open channel numbers, ascending, for sessions that report them
    /// ([`Registration::channel_opened`]: AMQP); empty for those that only
    /// count ([`Registration::set_channels`]: MQTT's one channel).
    channels: Vec<u16>,
    /// The traffic at earlier API reads, for [`ConnInfo::rates`]; made by
    /// the first (so a connection nobody looks at carries one pointer).
    samples: Option<Box<[TrafficSample; 2]>>,
    /// Why it was asked to close, once it is.
    close_reason: Option<Box<str>>,
}

/// Octets each way at one time.
#[derive(Clone, Copy, Debug)]
struct TrafficSample {
    /// Wall clock, ms since the epoch (as `connected_at_ms`).
    at_ms: u64,
    recv_oct: u64,
    send_oct: u64,
}

/// The rate window, ms: a rate covers at least this much time once the
/// connection is this old (RabbitMQ samples every 5 s).
const RATE_INTERVAL_MS: u64 = 5_000;

/// Every live connection.
#[derive(Default)]
pub struct Connections {
    next: Mutex<u64>,
    map: RwLock<HashMap<u64, Arc<ConnInfo>>>,
}

/// A session's registration: removed from the registry when dropped.
pub struct Registration {
    info: Arc<ConnInfo>,
    registry: Arc<Connections>,
}

/// What a session registers.
pub struct NewConnection<'a> {
    /// Protocol name as RabbitMQ shows it.
    pub protocol: &'static str,
    /// Client address.
    pub peer: SocketAddr,
    /// Local (listener) address, if known.
    pub local: Option<SocketAddr>,
    /// Who logged in.
    pub user: &'a str,
    /// Its vhost.
    pub vhost: &'a str,
    /// Over TLS.
    pub tls: bool,
    /// MQTT client id, or empty.
    pub client_id: &'a str,
    /// The engine client's connection (its id names its consumers; it is
    /// woken when the connection is asked to close).
    pub engine: &'a Arc<ConnHandle>,
    /// AMQP's client properties (an object); `None` for MQTT.
    pub client_properties: Option<Value>,
}

impl Connections {
    /// Registers a connection.
    pub fn register(self: &Arc<Self>, c: NewConnection<'_>) -> Registration {
        let id = {
            let mut n = self.next.lock();
            *n += 1;
            *n
        };
        let local = c
            .local
            .map_or_else(|| "weir".to_string(), |l| l.to_string());
        let info = Arc::new(ConnInfo {
            id,
            name: format!("{} -> {local}", c.peer),
            protocol: c.protocol,
            peer: c.peer,
            user: c.user.to_string(),
            vhost: c.vhost.to_string(),
            connected_at_ms: weir_engine::Clock::now_ms(&weir_engine::SystemClock),
            tls: c.tls,
            channels: AtomicU32::new(0),
            detail: Mutex::default(),
            client_id: c.client_id.to_string(),
            engine_id: c.engine.id,
            client_properties: c.client_properties.map(Box::new),
            traffic: Traffic::default(),
            close_asked: AtomicBool::new(false),
            wake: c.engine.clone(),
        });
        self.map.write().insert(id, info.clone());
        Registration {
            info,
            registry: self.clone(),
        }
    }

    /// Every live connection, oldest first.
    pub fn list(&self) -> Vec<Arc<ConnInfo>> {
        let mut v: Vec<Arc<ConnInfo>> = self.map.read().values().cloned().collect();
        v.sort_by_key(|c| c.id);
        v
    }

    /// One by name.
    pub fn get(&self, name: &str) -> Option<Arc<ConnInfo>> {
        self.map.read().values().find(|c| c.name == name).cloned()
    }

    /// Connections and channels.
    pub fn counts(&self) -> (u64, u64) {
        let m = self.map.read();
        let ch = m
            .values()
            .map(|c| u64::from(c.channels.load(Ordering::Relaxed)))
            .sum();
        (m.len() as u64, ch)
    }

    /// Asks a connection to close with `reason`; false if it is gone.
    pub fn close(&self, name: &str, reason: &str) -> bool {
        match self.get(name) {
            Some(c) => {
                c.ask_to_close(reason);
                true
            }
            None => false,
        }
    }

    /// Closes every connection of `vhost`.
    pub fn close_vhost(&self, vhost: &str, reason: &str) {
        for c in self.list().iter().filter(|c| c.vhost == vhost) {
            c.ask_to_close(reason);
        }
    }

    /// Closes every connection of `user`.
    pub fn close_user(&self, user: &str, reason: &str) {
        for c in self.list().iter().filter(|c| c.user == user) {
            c.ask_to_close(reason);
        }
    }
}

impl std::fmt::Debug for ConnInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnInfo")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("protocol", &self.protocol)
            .field("user", &self.user)
            .field("vhost", &self.vhost)
            .field("engine_id", &self.engine_id)
            .finish_non_exhaustive()
    }
}

impl ConnInfo {
    /// Records `reason` (the first one wins) and wakes the session.
    fn ask_to_close(&self, reason: &str) {
        self.detail
            .lock()
            .close_reason
            .get_or_insert_with(|| reason.into());
        self.close_asked.store(true, Ordering::Release);
        // Stores a permit if the session is not waiting right now.
        self.wake.wake();
    }

    /// The numbers of its open channels, ascending (`1..=channels` for a
    /// session that only counts them).
    pub fn channel_numbers(&self) -> Vec<u16> {
        let d = self.detail.lock();
        if d.channels.is_empty() {
            let n = self
                .channels
                .load(Ordering::Relaxed)
                .min(u32::from(u16::MAX)) as u16;
            return (1..=n).collect();
        }
        d.channels.clone()
    }

    /// What the client said about itself, as RabbitMQ shows it: AMQP's
    /// client properties, MQTT's `{"client_id": ...}`.
    pub fn client_properties(&self) -> Value {
        match &self.client_properties {
            Some(p) => Value::clone(p),
            None if self.client_id.is_empty() => Value::Object(Default::default()),
            None => serde_json::json!({ "client_id": self.client_id }),
        }
    }

    /// The client's own name for the connection: its `connection_name`
    /// client property (RabbitMQ's `user_provided_name`), if text.
    pub fn user_provided_name(&self) -> Option<&str> {
        self.client_properties.as_deref()?["connection_name"].as_str()
    }

    /// Octets per second received and sent, over the time since the older
    /// of two samples taken by API reads at least 5 s apart (so between 5
    /// and 10 s while the API is read at least that often; since the
    /// connection opened at first). Costs the API a lock of this
    /// connection's own; sessions never take it.
    pub fn rates(&self) -> (f64, f64) {
        let now = TrafficSample {
            at_ms: weir_engine::Clock::now_ms(&weir_engine::SystemClock),
            recv_oct: self.traffic.recv_oct.load(Ordering::Relaxed),
            send_oct: self.traffic.send_oct.load(Ordering::Relaxed),
        };
        let mut d = self.detail.lock();
        let s = d.samples.get_or_insert_with(|| {
            let start = TrafficSample {
                at_ms: self.connected_at_ms,
                recv_oct: 0,
                send_oct: 0,
            };
            Box::new([start; 2])
        });
        if now.at_ms.saturating_sub(s[1].at_ms) >= RATE_INTERVAL_MS {
            s[0] = s[1];
            s[1] = now;
        }
        let ms = now.at_ms.saturating_sub(s[0].at_ms);
        if ms == 0 {
            return (0.0, 0.0);
        }
        let per_sec = |a: u64, b: u64| a.saturating_sub(b) as f64 * 1000.0 / ms as f64;
        (
            per_sec(now.recv_oct, s[0].recv_oct),
            per_sec(now.send_oct, s[0].send_oct),
        )
    }
}

impl Registration {
    /// Its entry.
    pub fn info(&self) -> &Arc<ConnInfo> {
        &self.info
    }

    /// Records the number of open channels (a session that does not
    /// report their numbers: they are shown as `1..=n`).
    pub fn set_channels(&self, n: usize) {
        self.info
            .channels
            .store(u32::try_from(n).unwrap_or(u32::MAX), Ordering::Relaxed);
    }

    /// Channel `ch` opened (not per message: channel.open and close are
    /// rare next to publishes, and bounded by channel-max).
    pub fn channel_opened(&self, ch: u16) {
        let open = &mut self.info.detail.lock().channels;
        if let Err(i) = open.binary_search(&ch) {
            open.insert(i, ch);
        }
        self.info
            .channels
            .store(open.len() as u32, Ordering::Relaxed);
    }

    /// Channel `ch` closed.
    pub fn channel_closed(&self, ch: u16) {
        let open = &mut self.info.detail.lock().channels;
        if let Ok(i) = open.binary_search(&ch) {
            open.remove(i);
        }
        self.info
            .channels
            .store(open.len() as u32, Ordering::Relaxed);
    }

    /// Why the connection was asked to close, once it is (one relaxed
    /// load until then). The session calls it after every wake-up.
    pub fn close_reason(&self) -> Option<String> {
        if !self.info.close_asked.load(Ordering::Acquire) {
            return None;
        }
        self.info
            .detail
            .lock()
            .close_reason
            .as_deref()
            .map(String::from)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.map.write().remove(&self.info.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{ConnMetrics, PreOpen, Protocol};

    fn register(
        r: &Arc<Connections>,
        client_id: &str,
        client_properties: Option<Value>,
    ) -> Registration {
        r.register(NewConnection {
            protocol: "AMQP 0-9-1",
            peer: "127.0.0.1:5000".parse().expect("addr"),
            local: None,
            user: "guest",
            vhost: "/",
            tls: false,
            client_id,
            engine: &ConnHandle::new(1),
            client_properties,
        })
    }

    #[test]
    fn channels_and_client_properties() {
        let r = Arc::new(Connections::default());
        let amqp = register(
            &r,
            "",
            Some(serde_json::json!({"connection_name": "orders", "product": "x"})),
        );
        for ch in [3, 1, 7] {
            amqp.channel_opened(ch);
        }
        amqp.channel_closed(3);
        let info = amqp.info();
        assert_eq!(info.channel_numbers(), vec![1, 7]);
        assert_eq!(info.channels.load(Ordering::Relaxed), 2);
        assert_eq!(info.user_provided_name(), Some("orders"));
        assert_eq!(info.client_properties()["product"], "x");

        let mqtt = register(&r, "sensor-1", None);
        mqtt.set_channels(1);
        let info = mqtt.info();
        assert_eq!(info.channel_numbers(), vec![1]);
        assert_eq!(info.user_provided_name(), None);
        assert_eq!(
            info.client_properties(),
            serde_json::json!({"client_id": "sensor-1"})
        );
        assert_eq!(r.counts(), (2, 3));
    }

    #[test]
    fn traffic_is_added_per_flush() {
        let r = Arc::new(Connections::default());
        let reg = register(&r, "", None);
        let mut m = ConnMetrics::open(Protocol::Amqp, "/");
        let mut pre = PreOpen::default();
        pre.read(8);
        pre.wrote(500);
        m.before_open(&pre);
        m.report_to(reg.info().clone());
        m.bytes_in(100);
        m.bytes_in(50);
        m.bytes_out(20);
        let t = &reg.info().traffic;
        // Nothing shared until the batch ends.
        assert_eq!(t.recv_oct.load(Ordering::Relaxed), 0);
        m.flush();
        let got = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(
            (
                got(&t.recv_oct),
                got(&t.recv_cnt),
                got(&t.send_oct),
                got(&t.send_cnt)
            ),
            (158, 3, 520, 2)
        );
        // An empty batch adds nothing; the next one adds its own.
        m.flush();
        m.bytes_in(1);
        m.flush();
        assert_eq!((got(&t.recv_oct), got(&t.recv_cnt)), (159, 4));
        let (recv_rate, send_rate) = reg.info().rates();
        assert!(recv_rate >= 0.0 && send_rate >= 0.0);
    }
}
