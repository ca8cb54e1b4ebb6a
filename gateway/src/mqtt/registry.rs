//! Which MQTT client ids are connected, per tenant: a second CONNECT with
//! the same client id takes the session over (the first connection is told
//! to end, MQTT 5 reason 0x8E, and the new one waits until it has released
//! the session's queue). Also the will messages waiting out their delay,
//! cancelled when the client comes back.
//!
//! Every connected client has an entry here, so an entry is kept small (an
//! idle IoT fleet is mostly entries): one key string and one shared
//! [`Handover`] of two `Notify`s, not a channel per direction.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// How long a new connection waits for the one it takes over to finish.
const TAKEOVER_WAIT: Duration = Duration::from_secs(5);

/// Most sessions whose unacknowledged QoS 1 ids are kept for their next
/// connection; beyond it a session's resends get new ids (DUP all the same).
const MAX_PARKED: usize = 100_000;

/// `tenant NUL client id`: an MQTT client id never holds a NUL (it is an
/// MQTT UTF-8 string), so two pairs never make the same key.
fn key(tenant: &str, client_id: &str) -> String {
    let mut k = String::with_capacity(tenant.len() + 1 + client_id.len());
    k.push_str(tenant);
    k.push('\0');
    k.push_str(client_id);
    k
}

/// Between the holder of a client id and the connection taking it over.
/// Both signals are `notify_one` permits: neither is lost when nobody is
/// waiting yet, and each has exactly one waiter.
#[derive(Default)]
struct Handover {
    /// The holder is to end (session taken over).
    kick: Notify,
    /// The holder is done with the session.
    finished: Notify,
}

struct Holder {
    /// Which connection holds it (to unregister only oneself).
    conn: u64,
    handover: Arc<Handover>,
}

/// The registry, shared by every MQTT connection.
#[derive(Default)]
pub struct Registry {
    holders: Mutex<HashMap<String, Holder>>,
    /// Delayed wills by (tenant, client id).
    wills: Mutex<HashMap<String, tokio::task::AbortHandle>>,
    /// Per disconnected persistent session: the packet ids of the QoS 1
    /// messages its client has not acknowledged, by message id, so the next
    /// connection sends them again under the same ids (MQTT-4.4.0-1). In
    /// memory: after a broker restart they get new ids.
    resends: Mutex<HashMap<String, HashMap<u64, u16>>>,
}

/// What a connection keeps while it holds a client id. Dropping it tells a
/// connection taking the session over that this one is done (also when the
/// task ends by a panic).
pub struct Registration {
    handover: Arc<Handover>,
    kicked: bool,
}

impl Registration {
    /// Resolves once, when another connection takes the session over;
    /// afterwards never. Cancel safe (a kick is not lost).
    pub async fn kicked(&mut self) {
        if self.kicked {
            return std::future::pending().await;
        }
        self.handover.kick.notified().await;
        self.kicked = true;
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.handover.finished.notify_one();
    }
}

impl Registry {
    /// Registers connection `conn` as the holder of `client_id` in `tenant`,
    /// ending and awaiting any previous holder (and cancelling its delayed
    /// will). Returns whether a previous connection was taken over.
    pub async fn take(&self, tenant: &str, client_id: &str, conn: u64) -> (Registration, bool) {
        let key = key(tenant, client_id);
        if let Some(w) = self.wills.lock().remove(&key) {
            w.abort();
        }
        let handover = Arc::new(Handover::default());
        let previous = self.holders.lock().insert(
            key.clone(),
            Holder {
                conn,
                handover: handover.clone(),
            },
        );
        let took_over = previous.is_some();
        if let Some(old) = previous {
            old.handover.kick.notify_one();
            let _ = tokio::time::timeout(TAKEOVER_WAIT, old.handover.finished.notified()).await;
            // The old connection, finishing, may have delayed its will:
            // this connection to the session cancels it (MQTT 5 3.1.3.2.2).
            if let Some(w) = self.wills.lock().remove(&key) {
                w.abort();
            }
        }
        (
            Registration {
                handover,
                kicked: false,
            },
            took_over,
        )
    }

    /// Unregisters `conn` as holder of `client_id` (if it still is).
    pub fn release(&self, tenant: &str, client_id: &str, conn: u64) {
        let key = key(tenant, client_id);
        let mut h = self.holders.lock();
        if h.get(&key).is_some_and(|x| x.conn == conn) {
            h.remove(&key);
        }
    }

    /// Keeps a delayed will's task, to be cancelled if the client reconnects.
    pub fn delay_will(&self, tenant: &str, client_id: &str, task: tokio::task::AbortHandle) {
        if let Some(old) = self.wills.lock().insert(key(tenant, client_id), task) {
            old.abort();
        }
    }

    /// The delayed will of `client_id` ran: forget it.
    pub fn will_done(&self, tenant: &str, client_id: &str) {
        self.wills.lock().remove(&key(tenant, client_id));
    }

    /// Keeps a disconnecting session's unacknowledged QoS 1 ids (message id
    /// → packet id) for its next connection.
    pub fn park_resends(&self, tenant: &str, client_id: &str, ids: HashMap<u64, u16>) {
        let mut r = self.resends.lock();
        if r.len() < MAX_PARKED {
            r.insert(key(tenant, client_id), ids);
        }
    }

    /// Takes what [`Self::park_resends`] kept for `client_id`.
    pub fn take_resends(&self, tenant: &str, client_id: &str) -> Option<HashMap<u64, u16>> {
        self.resends.lock().remove(&key(tenant, client_id))
    }

    /// Connected MQTT clients.
    pub fn connected(&self) -> usize {
        self.holders.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;

    #[tokio::test]
    async fn a_takeover_kicks_the_holder_and_waits_until_it_is_done() {
        let reg = Arc::new(Registry::default());
        let (mut first, took) = reg.take("/", "c", 1).await;
        assert!(!took);
        let r2 = reg.clone();
        let second = tokio::spawn(async move { r2.take("/", "c", 2).await });
        // The kick arrives whether or not the holder was waiting for it.
        first.kicked().await;
        assert!(!second.is_finished(), "the new holder waits for the old");
        reg.release("/", "c", 1);
        drop(first);
        let (_, took) = second.await.expect("take");
        assert!(took);
        assert_eq!(
            reg.connected(),
            1,
            "the old holder's release left the new one"
        );
    }

    #[tokio::test]
    async fn a_holder_that_finished_before_the_takeover_is_not_waited_for() {
        let reg = Registry::default();
        let (first, _) = reg.take("/", "c", 1).await;
        drop(first);
        // Its permit is there before anyone waits: done at the first poll.
        let (_, took) = reg.take("/", "c", 2).now_or_never().expect("no wait");
        assert!(took);
    }
}
