//! Shovels (issue 27): move messages from a source to a destination,
//! acknowledging the source only once the destination confirmed, as
//! RabbitMQ's dynamic shovels do and with their definitions
//! ([`def`]): `PUT /api/parameters/shovel/{vhost}/{name}`, the
//! `parameters` of a definitions export or import, `[[shovels]]` in the
//! config file. Status in `GET /api/shovels` and `/metrics`.
//!
//! A shovel is one task ([`run`]) that connects its two ends, moves
//! batches (at most `src-prefetch-count` unacknowledged messages), and on
//! any failure closes both ends (unacknowledged messages go back to the
//! source), waits `reconnect-delay` (doubled per failure in a row, up to a
//! minute) and starts again. Ends on this broker are engine clients acting
//! as the shovel's user ([`local`]), ends elsewhere are lapin ([`amqp`]) or
//! rumqttc ([`mqtt`]) clients, or a NATS client of its own ([`nats`]).
//!
//! Definitions made through the API or an import are kept in
//! `shovels.json` in the data directory (written whole, atomically), with
//! the user who made them; those of the config file are applied at every
//! start and not written there.

pub mod amqp;
pub mod def;
pub mod local;
pub mod mqtt;
pub mod nats;
pub mod run;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use weir_engine::properties::HeaderFormat;

pub use def::{DefError, ShovelDef};

use crate::server::Services;

/// At most this many shovels (every one holds two connections and a task).
pub const MAX_SHOVELS: usize = 1024;

/// One message on its way: what a source took, what a destination needs.
#[derive(Debug, Clone)]
pub struct Msg {
    /// The exchange it was published to at the source ("" for none).
    pub exchange: String,
    /// Its routing key (an MQTT topic is mapped to one).
    pub routing_key: String,
    /// Its header in its format (None: only `persistent` is known).
    pub header: Option<(HeaderFormat, Bytes)>,
    /// The body.
    pub body: Bytes,
    /// Persistent (AMQP delivery mode 2, MQTT QoS ≥ 1).
    pub persistent: bool,
    /// The source's handle for acknowledging it.
    pub ack: u64,
}

/// Why a shovel stopped; it starts again after its reconnect delay.
#[derive(Debug, thiserror::Error)]
pub enum ShovelError {
    /// The AMQP broker at one end.
    #[error("AMQP: {0}")]
    Amqp(#[from] lapin::Error),
    /// The MQTT broker at one end (its error as text: rumqttc's error
    /// types are large, and this one is returned on every path).
    #[error("MQTT: {0}")]
    Mqtt(String),
    /// This broker refused (permissions, a missing queue, limits).
    #[error("{0}")]
    Engine(String),
    /// The destination refused a message.
    #[error("destination refused: {0}")]
    Nacked(String),
    /// An end closed.
    #[error("{0}")]
    Closed(String),
}

impl From<rumqttc::ConnectionError> for ShovelError {
    fn from(e: rumqttc::ConnectionError) -> Self {
        ShovelError::Mqtt(e.to_string())
    }
}

impl From<rumqttc::ClientError> for ShovelError {
    fn from(e: rumqttc::ClientError) -> Self {
        ShovelError::Mqtt(e.to_string())
    }
}

impl ShovelError {
    fn engine(e: impl std::fmt::Display) -> ShovelError {
        ShovelError::Engine(e.to_string())
    }
}

/// A shovel's state, in RabbitMQ's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Connecting its ends.
    Starting,
    /// Moving messages.
    Running,
    /// Stopped by a failure (waiting to reconnect) or done.
    Terminated,
}

impl State {
    /// The name `GET /api/shovels` shows.
    pub fn name(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Terminated => "terminated",
        }
    }
}

/// What a shovel's task reports.
#[derive(Debug)]
pub struct Status {
    /// State and the last error (kept after a recovery, until the next).
    pub state: Mutex<(State, Option<String>)>,
    /// Messages moved (acknowledged at the source, or handed over in
    /// `no-ack` mode).
    pub transferred: AtomicU64,
    /// Failures so far (each one a reconnect).
    pub failures: AtomicU64,
    /// The last rate sample (time, transferred) and the rate it gave.
    rate: Mutex<(Instant, u64, f64)>,
}

impl Status {
    fn new() -> Status {
        Status {
            state: Mutex::new((State::Starting, None)),
            transferred: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            rate: Mutex::new((Instant::now(), 0, 0.0)),
        }
    }

    fn set(&self, s: State, reason: Option<String>) {
        let mut g = self.state.lock();
        g.0 = s;
        if reason.is_some() {
            g.1 = reason;
        }
    }

    /// Messages per second since the previous sample (at least a second
    /// apart; read by the API).
    pub fn rate(&self) -> f64 {
        let now = Instant::now();
        let t = self.transferred.load(Ordering::Relaxed);
        let mut g = self.rate.lock();
        let dt = now.duration_since(g.0).as_secs_f64();
        if dt >= 1.0 {
            g.2 = t.saturating_sub(g.1) as f64 / dt;
            *g = (now, t, g.2);
        }
        g.2
    }
}

/// One defined shovel.
pub struct Entry {
    /// Its vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// The parameter value as given (shown and exported unchanged).
    pub value: Value,
    /// The checked definition.
    pub def: ShovelDef,
    /// The user its local ends act as.
    pub user: String,
    /// Defined in the config file (not written to `shovels.json`).
    pub from_config: bool,
    /// What its task reports.
    pub status: Arc<Status>,
    task: Option<tokio::task::AbortHandle>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// How a shovel is kept in `shovels.json`.
#[derive(Serialize, Deserialize)]
struct Stored {
    vhost: String,
    name: String,
    user: String,
    value: Value,
}

/// Errors of the registry.
#[derive(Debug, thiserror::Error)]
pub enum ShovelsError {
    /// The definition is not usable.
    #[error(transparent)]
    Def(#[from] DefError),
    /// Too many shovels.
    #[error("at most {MAX_SHOVELS} shovels")]
    TooMany,
    /// `shovels.json` could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// `shovels.json` could not be read.
    #[error("reading {path}: {why}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
}

/// Every shovel of the broker.
pub struct Shovels {
    file: Option<PathBuf>,
    entries: Mutex<BTreeMap<(String, String), Entry>>,
    services: Mutex<Weak<Services>>,
}

impl Shovels {
    /// The shovels kept in `data_dir` (none kept when None: tests).
    pub fn load(data_dir: Option<&std::path::Path>) -> Result<Shovels, ShovelsError> {
        let file = data_dir.map(|d| d.join("shovels.json"));
        let s = Shovels {
            file,
            entries: Mutex::new(BTreeMap::new()),
            services: Mutex::new(Weak::new()),
        };
        if let Some(f) = &s.file {
            match std::fs::read(f) {
                Ok(bytes) => {
                    let stored: Vec<Stored> =
                        serde_json::from_slice(&bytes).map_err(|e| ShovelsError::Read {
                            path: f.display().to_string(),
                            why: e.to_string(),
                        })?;
                    let mut m = s.entries.lock();
                    for st in stored {
                        match ShovelDef::parse(&st.value, &st.vhost) {
                            Ok(def) => {
                                m.insert(
                                    (st.vhost.clone(), st.name.clone()),
                                    Entry {
                                        vhost: st.vhost,
                                        name: st.name,
                                        value: st.value,
                                        def,
                                        user: st.user,
                                        from_config: false,
                                        status: Arc::new(Status::new()),
                                        task: None,
                                    },
                                );
                            }
                            Err(e) => {
                                tracing::warn!(vhost = %st.vhost, shovel = %st.name, error = %e, "stored shovel ignored")
                            }
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(ShovelsError::Read {
                        path: f.display().to_string(),
                        why: e.to_string(),
                    })
                }
            }
        }
        Ok(s)
    }

    /// Starts every defined shovel; later definitions start at once.
    pub fn start(&self, services: &Arc<Services>) {
        *self.services.lock() = Arc::downgrade(services);
        let mut m = self.entries.lock();
        for e in m.values_mut() {
            if e.task.is_none() {
                e.task = Some(run::spawn(services, e));
            }
        }
    }

    /// Stops every task (at shutdown, before the store closes); the
    /// definitions stay.
    pub fn stop(&self) {
        for e in self.entries.lock().values_mut() {
            if let Some(t) = e.task.take() {
                t.abort();
            }
        }
        *self.services.lock() = Weak::new();
    }

    /// Defines (or redefines, restarting it) a shovel made by `user`.
    /// Returns whether it is new.
    pub fn put(
        &self,
        vhost: &str,
        name: &str,
        value: Value,
        user: &str,
        from_config: bool,
    ) -> Result<bool, ShovelsError> {
        let def = ShovelDef::parse(&value, vhost)?;
        let key = (vhost.to_string(), name.to_string());
        let new;
        {
            let mut m = self.entries.lock();
            new = !m.contains_key(&key);
            if new && m.len() >= MAX_SHOVELS {
                return Err(ShovelsError::TooMany);
            }
            let mut e = Entry {
                vhost: vhost.to_string(),
                name: name.to_string(),
                value,
                def,
                user: user.to_string(),
                from_config,
                status: Arc::new(Status::new()),
                task: None,
            };
            // The old one's task is aborted when its entry drops.
            if let Some(s) = self.services.lock().upgrade() {
                e.task = Some(run::spawn(&s, &e));
            }
            m.insert(key, e);
        }
        if !from_config {
            self.save()?;
        }
        Ok(new)
    }

    /// Deletes a shovel (its task stops; unacknowledged messages return to
    /// its source). False if there was none.
    pub fn delete(&self, vhost: &str, name: &str) -> Result<bool, ShovelsError> {
        let removed = self
            .entries
            .lock()
            .remove(&(vhost.to_string(), name.to_string()));
        match removed {
            None => Ok(false),
            Some(e) => {
                if !e.from_config {
                    drop(e);
                    self.save()?;
                }
                Ok(true)
            }
        }
    }

    /// Restarts a shovel's task (RabbitMQ's `DELETE …/restart`).
    pub fn restart(&self, vhost: &str, name: &str) -> bool {
        let mut m = self.entries.lock();
        let Some(e) = m.get_mut(&(vhost.to_string(), name.to_string())) else {
            return false;
        };
        if let Some(t) = e.task.take() {
            t.abort();
        }
        e.status = Arc::new(Status::new());
        if let Some(s) = self.services.lock().upgrade() {
            e.task = Some(run::spawn(&s, e));
        }
        true
    }

    /// Every shovel of `vhosts` (all when None): (vhost, name, value, def,
    /// status), sorted by vhost and name.
    pub fn list(&self, vhosts: Option<&[String]>) -> Vec<Listed> {
        self.entries
            .lock()
            .values()
            .filter(|e| vhosts.is_none_or(|v| v.contains(&e.vhost)))
            .map(|e| Listed {
                vhost: e.vhost.clone(),
                name: e.name.clone(),
                value: e.value.clone(),
                def: e.def.clone(),
                user: e.user.clone(),
                status: e.status.clone(),
            })
            .collect()
    }

    /// Called by a task that finished (`src-delete-after`): the shovel is
    /// deleted, as RabbitMQ deletes it.
    fn finished(&self, vhost: &str, name: &str, status: &Arc<Status>) {
        let mut m = self.entries.lock();
        let key = (vhost.to_string(), name.to_string());
        // Only if it is still this definition's task.
        if m.get(&key).is_some_and(|e| Arc::ptr_eq(&e.status, status)) {
            if let Some(mut e) = m.remove(&key) {
                // Do not abort the task calling us.
                e.task = None;
                let keep = e.from_config;
                drop(m);
                if !keep {
                    if let Err(err) = self.save() {
                        tracing::warn!(error = %err, "shovels.json not written");
                    }
                }
            }
        }
    }

    fn save(&self) -> Result<(), ShovelsError> {
        let Some(f) = &self.file else { return Ok(()) };
        let stored: Vec<Stored> = self
            .entries
            .lock()
            .values()
            .filter(|e| !e.from_config)
            .map(|e| Stored {
                vhost: e.vhost.clone(),
                name: e.name.clone(),
                user: e.user.clone(),
                value: e.value.clone(),
            })
            .collect();
        let bytes = serde_json::to_vec_pretty(&stored).unwrap_or_default();
        let err = |source| ShovelsError::Write {
            path: f.display().to_string(),
            source,
        };
        let tmp = f.with_extension("json.tmp");
        {
            use std::io::Write;
            let mut w = std::fs::File::create(&tmp).map_err(err)?;
            w.write_all(&bytes).map_err(err)?;
            w.sync_all().map_err(err)?;
        }
        std::fs::rename(&tmp, f).map_err(err)?;
        if let Some(dir) = f.parent() {
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

/// A shovel as listed.
pub struct Listed {
    /// Its vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// The parameter value as given.
    pub value: Value,
    /// The checked definition.
    pub def: ShovelDef,
    /// The user it acts as.
    pub user: String,
    /// Its task's report.
    pub status: Arc<Status>,
}
