//! What every connection shares: [`Services`], and the resource
//! [`Alarms`] the monitors set.

use crate::engine::Engine;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use weir_engine::auth::Authenticator;
use weir_engine::login::LoginGate;
use weir_protocols::amqp::ServerConfig;

/// The broker's services, shared by every connection task and the HTTP
/// API: the engine, the protocols' limits, logins, alarms, the registry of
/// live connections.
pub struct Services {
    /// The engine.
    pub engine: Arc<Engine>,
    /// AMQP limits and identity.
    pub amqp: ServerConfig,
    /// MQTT limits, connected client ids, delayed wills.
    pub mqtt: crate::mqtt::MqttShared,
    /// Users and their password hashes (every protocol logs in here).
    pub auth: Arc<Authenticator>,
    /// How long a delivery may stay unacknowledged (None = forever).
    pub consumer_timeout: Option<Duration>,
    /// Resource alarms (memory, disk), set and cleared by the monitors in
    /// the monitors (`server/monitors.rs`); every session subscribes.
    pub alarms: watch::Sender<Alarms>,
    /// How long a partly received message may make no progress (None = forever).
    pub partial_content_timeout: Option<Duration>,
    /// Logins per source address: failure budgets and delays, and fair
    /// turns at the slow password verifications (one per CPU at once: each
    /// holds ~19 MiB for tens of milliseconds).
    pub logins: LoginGate,
    /// Set after large frees (purge, delete): the memory monitor trims the
    /// heap on its next tick.
    pub(super) trim_wanted: AtomicBool,
    /// Live client connections, for the management API (see
    /// [`crate::connections`]).
    pub connections: Arc<crate::connections::Connections>,
    /// Shovels (issue 27): their definitions and tasks.
    pub shovels: Arc<crate::shovel::Shovels>,
}

impl Services {
    /// Asks the memory monitor to return freed heap memory to the system soon
    /// (after a purge or a delete freed many messages).
    pub fn request_trim(&self) {
        self.trim_wanted.store(true, Ordering::Relaxed);
    }
}

/// Which resource alarms are set. While any is, publishing connections are
/// not read and clients get `connection.blocked`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Alarms {
    /// Resident memory above `--memory-limit`.
    pub memory: bool,
    /// Free space of the data directory's filesystem below `--disk-free-limit`.
    pub disk: bool,
}

impl Alarms {
    /// Whether publishers are blocked.
    pub fn any(&self) -> bool {
        self.memory || self.disk
    }

    /// The reason given in `connection.blocked`, as RabbitMQ words it.
    pub fn reason(&self) -> &'static str {
        match (self.memory, self.disk) {
            (true, _) => "low on memory",
            (false, true) => "low on disk space",
            (false, false) => "",
        }
    }
}
