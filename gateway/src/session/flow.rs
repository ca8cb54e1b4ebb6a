//! What stops a session from reading its client: the broker's resource
//! alarms and the tenant's gate (block, publish rate, store share).
//!
//! As in RabbitMQ, a connection is blocked when it publishes while an
//! alarm (or its tenant's block) is set: the publish in hand is taken, then
//! its socket is not read until the alarm clears. One that only consumes,
//! acks, purges or deletes is never blocked: that is what frees resources.
//! The alarms are looked at once per turn (one atomic load, no waiter
//! registered); only a blocked connection waits for them to change.

use crate::server::Alarms;
use crate::tenant_gate::{self, TenantGate};
use tokio::sync::watch;
use weir_engine::Client;

/// One session's view of the alarms and of its tenant's gate.
pub struct Flow {
    alarms: watch::Receiver<Alarms>,
    /// The alarms as last seen.
    alarm: Alarms,
    /// The tenant's block and publish rate (boxed: an idle connection of an
    /// unlimited tenant carries none).
    pub gate: Option<Box<TenantGate>>,
    /// It published while an alarm was set: not read until it clears.
    pub blocked: bool,
}

impl Flow {
    /// The flow of a new session, with the alarms as they are now.
    pub fn new(mut alarms: watch::Receiver<Alarms>) -> Self {
        let alarm = *alarms.borrow_and_update();
        Flow {
            alarms,
            alarm,
            gate: None,
            blocked: false,
        }
    }

    /// The alarms as last seen.
    pub fn alarm(&self) -> Alarms {
        self.alarm
    }

    /// At the start of a turn: takes the alarms and the tenant's block if
    /// either changed (one atomic load each when not).
    pub fn refresh_if_changed(&mut self) {
        if self.alarms.has_changed().unwrap_or(false)
            || self.gate.as_mut().is_some_and(|g| g.refresh())
        {
            self.refresh();
        }
    }

    /// Takes the current alarm state; a cleared alarm unblocks.
    pub fn refresh(&mut self) {
        self.alarm = *self.alarms.borrow_and_update();
        if let Some(g) = self.gate.as_mut() {
            g.refresh();
        }
        self.blocked &= self.alarmed();
    }

    /// Whether publishers are to be blocked: the tenant's quota (checked
    /// first: it blocks only its tenant) or a global alarm.
    pub fn alarmed(&self) -> bool {
        self.gate.as_ref().is_some_and(|g| g.blocked()) || self.alarm.any()
    }

    /// Whether the tenant's block (not a global alarm) is what blocks.
    pub fn tenant_blocked(&self) -> bool {
        self.gate.as_ref().is_some_and(|g| g.blocked())
    }

    /// A publish of `bytes` was taken: owed to the rates, and no more
    /// reads while an alarm or the tenant's block is set. The block is
    /// looked at per publish (one atomic load), so a batch does not run
    /// far past the quota.
    pub fn published(&mut self, bytes: usize) {
        if let Some(g) = self.gate.as_mut() {
            g.refresh();
            g.published(bytes);
        }
        self.blocked |= self.alarmed();
    }

    /// After a batch: a gate for a connection that had none once the store
    /// says its tenant is over its share of the writer, then the gate's own
    /// end of batch (rate debt, store-share pause).
    pub fn end_batch(&mut self, client: Option<&mut Client>) {
        if self.gate.is_none() {
            self.gate = client
                .as_deref()
                .and_then(TenantGate::for_store_share)
                .map(Box::new);
        }
        if let Some(g) = self.gate.as_mut() {
            g.end_batch(client);
        }
    }

    /// Whether the client may be read: not blocked, not paused by a rate
    /// or the store share.
    pub fn may_read(&self) -> bool {
        !self.blocked && !self.gate.as_ref().is_some_and(|g| g.paused())
    }

    /// When a rate's pause ends (a deadline of the driver's timer).
    pub fn deadline(&self) -> Option<std::time::Instant> {
        self.gate.as_ref()?.pause_deadline()
    }

    /// The driver's timer fired: a rate's pause that is over ends.
    pub fn on_timer(&mut self, now: std::time::Instant) {
        if let Some(g) = self.gate.as_mut() {
            g.end_pause_if_due(now);
        }
    }

    /// Resolves once the alarms changed (only while blocked) or the gate's
    /// block or pause did, with the new state taken; never otherwise.
    pub async fn changed(&mut self) {
        let blocked = self.blocked;
        tokio::select! {
            r = self.alarms.changed(), if blocked => {
                if r.is_err() {
                    // The broker is going: no alarm changes any more.
                    std::future::pending::<()>().await;
                }
            }
            // The tenant's block changed, or its store-share pause is over.
            () = tenant_gate::wake(self.gate.as_deref_mut(), blocked) => {}
        }
        self.refresh();
    }
}
