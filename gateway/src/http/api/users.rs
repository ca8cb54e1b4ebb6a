//! `/api/users…`, `/api/permissions…`, `/api/topic-permissions…`:
//! administrators only, through the engine's durable definitions.
//! Passwords are hashed with argon2id (off the async workers); a given
//! `password_hash` must be an argon2 PHC string (RabbitMQ's salted SHA-256
//! hashes are refused with 400: Weir cannot verify them).

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use weir_engine::permissions::{PermissionDef, TopicPermissionDef, UserDef};

use super::auth::Caller;
use super::list::{list, ListQuery, Listable};
use super::{durable, engine, parse_body};
use crate::http::error::ApiError;

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/users", get(list_users))
        .route("/api/users/without-permissions", get(without_permissions))
        .route(
            "/api/users/{name}",
            get(show_user).put(put_user).delete(delete_user),
        )
        .route("/api/users/{name}/permissions", get(user_permissions))
        .route(
            "/api/users/{name}/topic-permissions",
            get(user_topic_permissions),
        )
        .route("/api/permissions", get(list_permissions))
        .route(
            "/api/permissions/{vhost}/{user}",
            get(show_permission)
                .put(put_permission)
                .delete(delete_permission),
        )
        .route("/api/topic-permissions", get(list_topic_permissions))
        .route(
            "/api/topic-permissions/{vhost}/{user}",
            get(show_topic_permission)
                .put(put_topic_permission)
                .delete(delete_topic_permission),
        )
}

/// A user as RabbitMQ shows it.
pub(crate) fn user_json(u: &UserDef) -> Value {
    json!({
        "name": u.name,
        "password_hash": u.password_hash,
        "hashing_algorithm": "argon2id",
        "tags": u.tags,
        "limits": {},
    })
}

/// Permissions as RabbitMQ shows them.
pub(crate) fn permission_json(p: &PermissionDef) -> Value {
    json!({ "user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read })
}

/// Topic permissions as RabbitMQ shows them.
pub(crate) fn topic_permission_json(p: &TopicPermissionDef) -> Value {
    json!({ "user": p.user, "vhost": p.vhost, "exchange": p.exchange, "write": p.write, "read": p.read })
}

struct Item(String, Value);

impl Listable for Item {
    fn name(&self) -> &str {
        &self.0
    }
    fn default_key(&self) -> (&str, &str) {
        (&self.0, "")
    }
    fn render(&self) -> Value {
        self.1.clone()
    }
}

async fn list_users(
    State(state): State<crate::http::State>,
    caller: Caller,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let items = engine(&state)
        .users()
        .iter()
        .map(|u| Item(u.name.clone(), user_json(u)))
        .collect();
    Ok(Json(list(&q, items)?))
}

async fn without_permissions(
    State(state): State<crate::http::State>,
    caller: Caller,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let e = engine(&state);
    let perms = e.permissions().list();
    let with: std::collections::HashSet<&str> = perms.iter().map(|p| p.user.as_str()).collect();
    Ok(Json(Value::Array(
        e.users()
            .iter()
            .filter(|u| !with.contains(u.name.as_str()))
            .map(user_json)
            .collect(),
    )))
}

fn find_user(state: &crate::http::State, name: &str) -> Result<UserDef, ApiError> {
    engine(state)
        .users()
        .into_iter()
        .find(|u| u.name == name)
        .ok_or_else(ApiError::not_found)
}

async fn show_user(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    Ok(Json(user_json(&find_user(&state, &name)?)))
}

#[derive(Deserialize)]
struct UserBody {
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    password_hash: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    hashing_algorithm: Option<String>,
    #[serde(default)]
    tags: Option<Value>,
}

/// Tags as RabbitMQ takes them: a comma-separated string or a list.
pub(crate) fn parse_tags(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    Ok(match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::bad_request("tags are strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::bad_request("tags: a string or a list")),
    })
}

/// Builds a user from a password or a hash (hashing off the workers).
pub(crate) async fn make_user(
    name: &str,
    password: Option<String>,
    password_hash: Option<String>,
    tags: Vec<String>,
    keep_hash: Option<String>,
) -> Result<UserDef, ApiError> {
    let hash = match (password, password_hash) {
        (Some(p), _) => {
            tokio::task::spawn_blocking(move || weir_engine::auth::hash_password(p.as_bytes()))
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?
                .map_err(|e| ApiError::bad_request(e.to_string()))?
        }
        (None, Some(h)) if h.is_empty() => {
            return Err(ApiError::bad_request(
                "users without a password are not supported",
            ))
        }
        (None, Some(h)) => {
            if !h.starts_with("$argon2") {
                return Err(ApiError::bad_request(
                    "password_hash must be an argon2 PHC string (weir hash-password prints one)",
                ));
            }
            h
        }
        (None, None) => keep_hash
            .ok_or_else(|| ApiError::bad_request("password or password_hash is required"))?,
    };
    Ok(UserDef {
        name: name.to_string(),
        password_hash: hash,
        tags,
        loopback_only: false,
        from_config: false,
    })
}

async fn put_user(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    let b: UserBody = parse_body(&body)?;
    let existing = find_user(&state, &name).ok();
    let tags = parse_tags(b.tags.as_ref())?;
    let u = make_user(
        &name,
        b.password,
        b.password_hash,
        tags,
        existing.as_ref().map(|u| u.password_hash.clone()),
    )
    .await?;
    let wait = engine(&state).put_user(u)?;
    durable(&state, Some(wait)).await?;
    Ok(super::created(existing.is_none()))
}

async fn delete_user(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    match engine(&state).delete_user(&name)? {
        None => Err(ApiError::not_found()),
        Some(w) => {
            durable(&state, Some(w)).await?;
            state.shared.connections.close_user(&name, "user deleted");
            Ok(StatusCode::NO_CONTENT)
        }
    }
}

async fn user_permissions(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    find_user(&state, &name)?;
    Ok(Json(Value::Array(
        engine(&state)
            .permissions()
            .list()
            .iter()
            .filter(|p| p.user == name)
            .map(permission_json)
            .collect(),
    )))
}

async fn user_topic_permissions(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    find_user(&state, &name)?;
    Ok(Json(Value::Array(
        engine(&state)
            .permissions()
            .list_topic()
            .iter()
            .filter(|p| p.user == name)
            .map(topic_permission_json)
            .collect(),
    )))
}

async fn list_permissions(
    State(state): State<crate::http::State>,
    caller: Caller,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    Ok(Json(Value::Array(
        engine(&state)
            .permissions()
            .list()
            .iter()
            .map(permission_json)
            .collect(),
    )))
}

async fn show_permission(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    engine(&state)
        .permissions()
        .list()
        .iter()
        .find(|p| p.vhost == vhost && p.user == user)
        .map(|p| Json(permission_json(p)))
        .ok_or_else(ApiError::not_found)
}

#[derive(Deserialize)]
struct PermissionBody {
    configure: String,
    write: String,
    read: String,
}

async fn put_permission(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    let b: PermissionBody = parse_body(&body)?;
    let e = engine(&state);
    if e.tenant(&vhost).is_none() || find_user(&state, &user).is_err() {
        return Err(ApiError::bad_request(format!(
            "no user '{user}' or no vhost '{vhost}'"
        )));
    }
    let existed = e.permissions().access(&user, &vhost).is_some();
    let w = e.set_permissions(PermissionDef {
        user,
        vhost,
        configure: b.configure,
        write: b.write,
        read: b.read,
        from_config: false,
    })?;
    durable(&state, Some(w)).await?;
    Ok(super::created(!existed))
}

async fn delete_permission(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    match engine(&state).clear_permissions(&user, &vhost)? {
        None => Err(ApiError::not_found()),
        Some(w) => {
            durable(&state, Some(w)).await?;
            Ok(StatusCode::NO_CONTENT)
        }
    }
}

async fn list_topic_permissions(
    State(state): State<crate::http::State>,
    caller: Caller,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    Ok(Json(Value::Array(
        engine(&state)
            .permissions()
            .list_topic()
            .iter()
            .map(topic_permission_json)
            .collect(),
    )))
}

async fn show_topic_permission(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let v: Vec<Value> = engine(&state)
        .permissions()
        .list_topic()
        .iter()
        .filter(|p| p.vhost == vhost && p.user == user)
        .map(topic_permission_json)
        .collect();
    if v.is_empty() {
        return Err(ApiError::not_found());
    }
    Ok(Json(Value::Array(v)))
}

#[derive(Deserialize)]
struct TopicBody {
    exchange: String,
    write: String,
    read: String,
}

async fn put_topic_permission(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    let b: TopicBody = parse_body(&body)?;
    let e = engine(&state);
    if e.tenant(&vhost).is_none() || find_user(&state, &user).is_err() {
        return Err(ApiError::bad_request(format!(
            "no user '{user}' or no vhost '{vhost}'"
        )));
    }
    let w = e.set_topic_permissions(TopicPermissionDef {
        user,
        vhost,
        exchange: b.exchange,
        write: b.write,
        read: b.read,
        from_config: false,
    })?;
    durable(&state, Some(w)).await?;
    Ok(StatusCode::CREATED)
}

#[derive(Deserialize, Default)]
struct TopicDeleteQuery {
    #[serde(default)]
    exchange: Option<String>,
}

async fn delete_topic_permission(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
    Query(q): Query<TopicDeleteQuery>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    match engine(&state).clear_topic_permissions(&user, &vhost, q.exchange.as_deref())? {
        None => Err(ApiError::not_found()),
        Some(w) => {
            durable(&state, Some(w)).await?;
            Ok(StatusCode::NO_CONTENT)
        }
    }
}
