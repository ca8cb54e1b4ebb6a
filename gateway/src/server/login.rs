//! Logins for every protocol and the HTTP API: credentials checked behind
//! the login throttle ([`weir_engine::login::LoginGate`]): failure budgets
//! and delays per source address, fair turns at the slow password hash.

use super::Services;
use std::net::SocketAddr;
use std::time::Instant;
use weir_engine::auth::{AuthFailure, Principal};
use weir_engine::login::{Entry, LoginGate, LoginRefused};

impl Services {
    /// Checks credentials (see [`weir_engine::auth`] and
    /// [`weir_engine::login`]). A source over its failure budget is refused
    /// before anything else. Logins that already succeeded are answered
    /// from the authenticator's cache; others wait for their source's turn
    /// at a verification slot and run the slow hash on the blocking pool,
    /// never on a runtime worker. A refusal is recorded against the source
    /// here and carries the delay to serve before answering. The default
    /// user `guest` is accepted from loopback only unless configured
    /// otherwise, as in RabbitMQ.
    pub async fn login(
        &self,
        user: &str,
        pass: &str,
        peer: SocketAddr,
    ) -> Result<Principal, LoginRefused> {
        let ip = peer.ip();
        let failed = move |gate: &LoginGate| LoginRefused::Failed {
            delay: gate.failed(ip, Instant::now()),
        };
        let over_budget = move |gate: &LoginGate| {
            gate.over_budget(ip, Instant::now())
                .then(|| LoginRefused::OverBudget {
                    delay: gate.failed(ip, Instant::now()),
                })
        };
        if let Some(refused) = over_budget(&self.logins) {
            return Err(refused);
        }
        if let Some(r) = self.auth.check_cached(user, pass.as_bytes(), ip) {
            return r.map_err(|AuthFailure| failed(&self.logins));
        }
        let slot = match self.logins.enter(ip, Instant::now()) {
            Entry::Run(slot) => slot,
            Entry::Wait(w) => w.wait().await.ok_or(LoginRefused::Busy)?,
            Entry::Busy => return Err(LoginRefused::Busy),
        };
        // While it waited, its source may have run out of budget, or
        // another connection of the same client may have filled the cache.
        if let Some(refused) = over_budget(&self.logins) {
            return Err(refused);
        }
        if let Some(r) = self.auth.check_cached(user, pass.as_bytes(), ip) {
            return r.map_err(|AuthFailure| failed(&self.logins));
        }
        let (auth, gate, user, pass) = (
            self.auth.clone(),
            self.logins.clone(),
            user.to_owned(),
            pass.to_owned(),
        );
        tokio::task::spawn_blocking(move || {
            let r = auth.authenticate(&user, pass.as_bytes(), ip);
            // Recorded before the slot goes back, so this source's next
            // login in line sees the failure when it checks its budget.
            let r = r.map_err(|AuthFailure| failed(&gate));
            drop(slot);
            r
        })
        .await
        .unwrap_or_else(|_| Err(failed(&self.logins)))
    }

    /// Records a login refused without a password check (a certificate
    /// naming no user) against its source; returns the refusal to serve.
    pub fn login_refused(&self, peer: SocketAddr) -> LoginRefused {
        LoginRefused::Failed {
            delay: self.logins.failed(peer.ip(), Instant::now()),
        }
    }

    /// A login by verified client certificate (its subject CN is `user`),
    /// or an anonymous MQTT client as the default user: the user must
    /// exist and its loopback-only rule holds; no password is checked.
    pub fn login_certificate(
        &self,
        user: &str,
        peer: SocketAddr,
    ) -> Result<Principal, AuthFailure> {
        self.auth.known_user(user, peer.ip())
    }
}
