//! Starting and stopping the broker: open the store, recover the engine,
//! listen, serve connections, and shut down gracefully.

use crate::config::Config;
use crate::engine::Engine;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::Store;
use weir_protocols::amqp::ServerConfig;

/// What every connection task shares.
pub struct Shared {
    /// The engine.
    pub engine: Arc<Engine>,
    /// AMQP limits and identity.
    pub amqp: ServerConfig,
    users: HashMap<String, String>,
    guest_remote: bool,
    /// How long a delivery may stay unacknowledged (None = forever).
    pub consumer_timeout: Option<Duration>,
}

impl Shared {
    /// Checks credentials. The default user `guest` is accepted from loopback
    /// only unless configured otherwise, as in RabbitMQ.
    pub fn authenticate(&self, user: &str, pass: &str, peer: SocketAddr) -> bool {
        let Some(expected) = self.users.get(user) else {
            return false;
        };
        if user == "guest" && !self.guest_remote && !peer.ip().is_loopback() {
            return false;
        }
        // Constant-time comparison is not needed for equal-length secrets held
        // in memory here, but avoid early exit on length anyway.
        expected.len() == pass.len()
            && expected
                .bytes()
                .zip(pass.bytes())
                .fold(0u8, |a, (x, y)| a | (x ^ y))
                == 0
    }
}

/// Startup failures.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The store could not be opened.
    #[error("opening store in {dir}: {source}")]
    Store {
        /// Directory.
        dir: String,
        /// Error.
        source: weir_backend::StoreError,
    },
    /// The engine could not recover.
    #[error("recovering engine: {0}")]
    Engine(#[from] crate::engine::EngineError),
    /// A listener could not bind.
    #[error("binding {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// Error.
        source: std::io::Error,
    },
}

/// A running broker.
pub struct Broker {
    shared: Arc<Shared>,
    store: Arc<LogStore>,
    listener: TcpListener,
}

impl Broker {
    /// Opens the store, recovers the engine and binds the listeners.
    pub async fn start(cfg: &Config) -> Result<Self, ServerError> {
        std::fs::create_dir_all(&cfg.data_dir).map_err(|e| ServerError::Store {
            dir: cfg.data_dir.display().to_string(),
            source: weir_backend::StoreError::io("creating data directory", e),
        })?;
        let opts = LogOptions {
            segment_size: cfg.segment_bytes,
            sync: cfg.fsync,
            ..LogOptions::default()
        };
        let started = std::time::Instant::now();
        if cfg.repair {
            let report =
                weir_backend::log::repair(&cfg.data_dir).map_err(|source| ServerError::Store {
                    dir: cfg.data_dir.display().to_string(),
                    source,
                })?;
            for (d, q) in report.damages.iter().zip(&report.quarantined) {
                tracing::warn!(damage = %d, quarantine = %q.display(), "repaired the store");
            }
            if !report.damages.is_empty() {
                tracing::warn!(lost_message_ids = ?report.lost_message_ids(), "messages lost to damage");
            }
        }
        let store = LogStore::open(&cfg.data_dir, opts).map_err(|source| ServerError::Store {
            dir: cfg.data_dir.display().to_string(),
            source,
        })?;
        let dyn_store: Arc<dyn Store> = store.clone();
        let engine = Engine::open(dyn_store)?;
        release_recovery_memory();
        tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, data_dir = %cfg.data_dir.display(), "store opened");
        let mut users = HashMap::new();
        users.insert("guest".to_string(), cfg.default_pass.clone());
        for u in &cfg.users {
            users.insert(u.name.clone(), u.password.clone());
        }
        let defaults = ServerConfig::default();
        let amqp = ServerConfig {
            frame_max: cfg.frame_max,
            heartbeat: cfg.heartbeat,
            // A persistent message is one store record, which must fit in a
            // segment: refuse larger ones up front with 406, not with a
            // store error after the body arrived.
            max_message_size: defaults.max_message_size.min(
                cfg.segment_bytes
                    .saturating_sub(u64::from(cfg.frame_max) + 1024),
            ),
            ..defaults
        };
        let listener =
            TcpListener::bind(cfg.amqp_listen)
                .await
                .map_err(|source| ServerError::Bind {
                    addr: cfg.amqp_listen,
                    source,
                })?;
        Ok(Broker {
            shared: Arc::new(Shared {
                engine,
                amqp,
                users,
                guest_remote: cfg.guest_remote,
                consumer_timeout: (cfg.consumer_timeout_secs > 0)
                    .then(|| Duration::from_secs(cfg.consumer_timeout_secs)),
            }),
            store,
            listener,
        })
    }

    /// The bound AMQP address.
    pub fn amqp_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `stop` resolves, then closes every connection with
    /// connection.close (320), waits briefly for them, and closes the store.
    pub async fn run(self, stop: impl std::future::Future<Output = ()>) {
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let mut conns = JoinSet::new();
        let engine = self.shared.engine.clone();
        let compactor = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                let e = engine.clone();
                match tokio::task::spawn_blocking(move || e.compact()).await {
                    Ok(Ok(n)) if n > 0 => {
                        tracing::info!(relocated = n, "compacted sparse segments")
                    }
                    Ok(Err(e)) => tracing::warn!(error = %e, "compaction failed"),
                    _ => {}
                }
            }
        });
        if let Ok(addr) = self.amqp_addr() {
            tracing::info!(%addr, "AMQP listener ready");
        }
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        conns.spawn(crate::amqp::session::serve(stream, peer, self.shared.clone(), shutdown_rx.clone()));
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        tracing::info!(
            connections = conns.len(),
            "shutting down: closing connections"
        );
        drop(self.listener);
        let _ = shutdown_tx.send(true);
        let drained = tokio::time::timeout(Duration::from_secs(5), async {
            while conns.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!("some connections did not close in time");
            conns.abort_all();
        }
        compactor.abort();
        match self.store.close() {
            Ok(()) => tracing::info!("store flushed and closed"),
            Err(e) => tracing::error!(error = %e, "closing store"),
        }
    }
}

/// Recovery builds large temporary indexes (every live message of every
/// partition) out of many small allocations; once they are freed, glibc keeps
/// the fragmented heap, and a restarted broker would hold far more memory than
/// the same broker before the restart. Hand the free pages back.
fn release_recovery_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free heap memory; no pointers change.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM");
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
