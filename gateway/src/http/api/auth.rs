//! HTTP Basic authentication with Weir's users (the authenticator every
//! protocol logs in with, so `guest` stays loopback-only) and RabbitMQ's
//! management tags:
//!
//! * `administrator`: everything;
//! * `monitoring`: reads every vhost's objects, connections and figures;
//! * `policymaker`: policies and parameters of the vhosts it has access to,
//!   plus what `management` allows;
//! * `management`: the objects of the vhosts it has permissions in.
//!
//! A user without any of these tags cannot use the API (401 "Not management
//! user", as RabbitMQ). A tag or vhost permission missing for a request is
//! 403 with a JSON reason.

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::http::StatusCode;
use base64::Engine as _;

use crate::http::error::ApiError;

/// The authenticated user of a request.
#[derive(Clone, Debug)]
pub struct Caller {
    /// Login name.
    pub name: String,
    /// Its tags.
    pub tags: Vec<String>,
}

impl Caller {
    fn has(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }

    /// Tagged `administrator`.
    pub fn is_admin(&self) -> bool {
        self.has("administrator")
    }

    /// Sees every vhost's objects (`administrator` or `monitoring`).
    pub fn is_monitor(&self) -> bool {
        self.is_admin() || self.has("monitoring")
    }

    /// May manage policies (`administrator` or `policymaker`).
    pub fn is_policymaker(&self) -> bool {
        self.is_admin() || self.has("policymaker")
    }

    /// 403 unless an administrator.
    pub fn require_admin(&self) -> Result<(), ApiError> {
        if self.is_admin() {
            Ok(())
        } else {
            Err(ApiError::forbidden("Not administrator user"))
        }
    }

    /// 403 unless `administrator` or `monitoring`.
    pub fn require_monitor(&self) -> Result<(), ApiError> {
        if self.is_monitor() {
            Ok(())
        } else {
            Err(ApiError::forbidden("Not monitor user"))
        }
    }

    /// 403 unless `administrator` or `policymaker`.
    pub fn require_policymaker(&self) -> Result<(), ApiError> {
        if self.is_policymaker() {
            Ok(())
        } else {
            Err(ApiError::forbidden("Not policymaker user"))
        }
    }

    /// Whether the user may see `vhost`'s objects: monitors see all, others
    /// the vhosts they have permissions in.
    pub fn sees_vhost(&self, engine: &weir_engine::Engine, vhost: &str) -> bool {
        self.is_monitor() || engine.permissions().access(&self.name, vhost).is_some()
    }

    /// Whether the user has permissions in `vhost` (what changing objects
    /// there takes; the engine then checks the configure/write/read
    /// patterns per object).
    pub fn has_access(&self, engine: &weir_engine::Engine, vhost: &str) -> bool {
        engine.permissions().access(&self.name, vhost).is_some()
    }

    /// 404 for a missing vhost, 403 when the user may not see it.
    pub fn require_vhost(&self, engine: &weir_engine::Engine, vhost: &str) -> Result<(), ApiError> {
        if engine.tenant(vhost).is_none() {
            return Err(ApiError::not_found());
        }
        if self.sees_vhost(engine, vhost) {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "Access refused to vhost '{vhost}' for user '{}'",
                self.name
            )))
        }
    }
}

/// The management tags; a user needs one of them to use the API.
const MANAGEMENT_TAGS: [&str; 4] = ["administrator", "monitoring", "policymaker", "management"];

impl FromRequestParts<super::super::State> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &super::super::State,
    ) -> Result<Self, Self::Rejection> {
        let (user, pass) =
            credentials(parts).ok_or_else(|| ApiError::unauthorized("Not_Authorized"))?;
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0)
            .ok_or_else(|| ApiError::unauthorized("Not_Authorized"))?;
        let principal = match state.shared.login(&user, &pass, peer).await {
            Ok(p) => p,
            Err(refused) => {
                // The same growing delay per address as failed AMQP logins.
                tokio::time::sleep(refused.delay()).await;
                return Err(if refused.is_throttled() {
                    // The source's doing, not these credentials': 429.
                    ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "too_many_requests",
                        format!("{refused}; retry later"),
                    )
                } else {
                    ApiError::unauthorized("Not_Authorized")
                });
            }
        };
        if !principal
            .tags
            .iter()
            .any(|t| MANAGEMENT_TAGS.contains(&t.as_str()))
        {
            return Err(ApiError::unauthorized("Not management user"));
        }
        Ok(Caller {
            name: principal.name,
            tags: principal.tags,
        })
    }
}

/// User and password of an `Authorization: Basic` header.
fn credentials(parts: &Parts) -> Option<(String, String)> {
    let v = parts.headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, b64) = v.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let (u, p) = s.split_once(':')?;
    Some((u.to_string(), p.to_string()))
}
