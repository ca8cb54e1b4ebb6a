//! Which MQTT client ids are connected, per tenant: a second CONNECT with
//! the same client id takes the session over (the first connection is told
//! to end, MQTT 5 reason 0x8E, and the new one waits until it has released
//! the session's queue). Also the will messages waiting out their delay,
//! cancelled when the client comes back.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::{oneshot, watch};

/// How long a new connection waits for the one it takes over to finish.
const TAKEOVER_WAIT: Duration = Duration::from_secs(5);

type Key = (String, String);

struct Holder {
    /// Which connection holds it (to unregister only oneself).
    conn: u64,
    /// Tells the holder to end (session taken over).
    kick: Option<oneshot::Sender<()>>,
    /// Set (or dropped) when the holder has finished.
    finished: watch::Receiver<bool>,
}

/// The registry, shared by every MQTT connection.
#[derive(Default)]
pub struct Registry {
    holders: Mutex<HashMap<Key, Holder>>,
    /// Delayed wills by (tenant, client id).
    wills: Mutex<HashMap<Key, tokio::task::AbortHandle>>,
}

/// What a connection keeps while it holds a client id.
pub struct Registration {
    /// Resolves when another connection takes the session over (taken
    /// once it did).
    pub kicked: Option<oneshot::Receiver<()>>,
    /// Set when this connection is done with the session.
    pub finished: watch::Sender<bool>,
}

impl Registry {
    /// Registers connection `conn` as the holder of `client_id` in `tenant`,
    /// ending and awaiting any previous holder (and cancelling its delayed
    /// will). Returns whether a previous connection was taken over.
    pub async fn take(&self, tenant: &str, client_id: &str, conn: u64) -> (Registration, bool) {
        let key = (tenant.to_string(), client_id.to_string());
        if let Some(w) = self.wills.lock().remove(&key) {
            w.abort();
        }
        let (kick_tx, kicked) = oneshot::channel();
        let (finished, finished_rx) = watch::channel(false);
        let previous = self.holders.lock().insert(
            key,
            Holder {
                conn,
                kick: Some(kick_tx),
                finished: finished_rx,
            },
        );
        let took_over = previous.is_some();
        if let Some(mut old) = previous {
            if let Some(k) = old.kick.take() {
                let _ = k.send(());
            }
            let _ = tokio::time::timeout(TAKEOVER_WAIT, old.finished.wait_for(|done| *done)).await;
        }
        (
            Registration {
                kicked: Some(kicked),
                finished,
            },
            took_over,
        )
    }

    /// Unregisters `conn` as holder of `client_id` (if it still is).
    pub fn release(&self, tenant: &str, client_id: &str, conn: u64) {
        let key = (tenant.to_string(), client_id.to_string());
        let mut h = self.holders.lock();
        if h.get(&key).is_some_and(|x| x.conn == conn) {
            h.remove(&key);
        }
    }

    /// Keeps a delayed will's task, to be cancelled if the client reconnects.
    pub fn delay_will(&self, tenant: &str, client_id: &str, task: tokio::task::AbortHandle) {
        let key = (tenant.to_string(), client_id.to_string());
        if let Some(old) = self.wills.lock().insert(key, task) {
            old.abort();
        }
    }

    /// The delayed will of `client_id` ran: forget it.
    pub fn will_done(&self, tenant: &str, client_id: &str) {
        self.wills
            .lock()
            .remove(&(tenant.to_string(), client_id.to_string()));
    }

    /// Connected MQTT clients.
    pub fn connected(&self) -> usize {
        self.holders.lock().len()
    }
}
