//! Authentication, shared by every protocol: users with argon2id password
//! hashes (PHC strings, `$argon2id$v=19$m=…,t=…,p=…$salt$hash`), RabbitMQ-style
//! tags, and a cache of successful verifications.
//!
//! Properties a caller can rely on:
//!
//! * A wrong password and an unknown user are the same [`AuthFailure`], and
//!   take about the same time: an unknown user is verified against a dummy
//!   hash with the default parameters.
//! * Comparisons are constant time: the argon2 output compare is the
//!   `password-hash` crate's, and the cache compares with `subtle`.
//! * [`Authenticator::authenticate`] is slow on purpose (tens of
//!   milliseconds, ~19 MiB of memory): call it off the async runtime (the
//!   gateway uses `spawn_blocking`), holding a turn of
//!   [`crate::login::LoginGate`], which keeps one source's flood from
//!   delaying the others. [`Authenticator::check_cached`] is fast
//!   and answers for logins that already succeeded once, so a client opening
//!   many connections pays the slow hash once, and a known login never waits
//!   for a turn.
//!
//! Plain passwords given in a configuration ([`Credential::Plain`]) are
//! hashed when the authenticator is built; nothing keeps them.

use argon2::password_hash::phc::{Output, ParamsString, PasswordHash, Salt};
use argon2::password_hash::{PasswordHasher, PasswordVerifier};
use argon2::{Algorithm, Argon2, Params};
use blake2::digest::{KeyInit, Mac};
use blake2::Blake2sMac256;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// Most successful verifications remembered; the cache is emptied when full
/// (only correct passwords get in, so this bounds memory, not an attack).
const CACHE_MAX: usize = 1024;

/// Largest argon2 memory cost accepted from a configured hash, KiB (1 GiB):
/// a typo must not make every login allocate the machine's memory.
const MAX_M_COST_KIB: u32 = 1 << 20;
/// Largest argon2 time cost accepted from a configured hash.
const MAX_T_COST: u32 = 64;

/// The argon2id hash (default parameters) of RabbitMQ's well-known default
/// password `guest`. Its salt is fixed, which is harmless for a password
/// everyone knows, and it spares every start of a default configuration one
/// slow hash. [`Credential::Plain`]`("guest")` resolves to it.
pub const GUEST_PASSWORD_HASH: &str =
    "$argon2id$v=19$m=19456,t=2,p=1$tXbVMLDDj7B014zZzUc6rA$/IEKGG/7LAbkbzXCQTYC/ZebiCNej+jk7w6EIjUKemE";

/// How a configured user proves who they are.
#[derive(Clone)]
pub enum Credential {
    /// An argon2id PHC string, as printed by `weir hash-password`.
    Hash(String),
    /// A plain password, hashed when the [`Authenticator`] is built.
    Plain(String),
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print a password; a hash is not secret but is not useful in logs.
        match self {
            Credential::Hash(_) => f.write_str("Hash(..)"),
            Credential::Plain(_) => f.write_str("Plain(..)"),
        }
    }
}

/// A user as configured.
#[derive(Clone, Debug)]
pub struct UserSpec {
    /// Login name.
    pub name: String,
    /// Password hash or plain password.
    pub credential: Credential,
    /// RabbitMQ-style tags (`administrator`, `monitoring`, …), kept for the
    /// management API and permissions to come.
    pub tags: Vec<String>,
    /// Accepted from loopback addresses only (RabbitMQ's `loopback_users`,
    /// which holds `guest` by default).
    pub loopback_only: bool,
}

/// Who logged in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// Login name.
    pub name: String,
    /// The user's tags.
    pub tags: Vec<String>,
}

/// A refused login. Deliberately carries no reason: a client must not learn
/// whether the user exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("authentication failed")]
pub struct AuthFailure;

/// Errors building an [`Authenticator`] or hashing a password.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// A configured hash is not an argon2id PHC string with sane parameters.
    #[error("user {user}: password hash is not a valid argon2id PHC string ({reason})")]
    BadHash {
        /// User name.
        user: String,
        /// What is wrong.
        reason: String,
    },
    /// Two users with the same name.
    #[error("user {0} is defined twice")]
    Duplicate(String),
    /// A user with an empty name.
    #[error("a user has an empty name")]
    EmptyName,
    /// Hashing failed (no system randomness, or an argon2 error).
    #[error("hashing a password: {0}")]
    Hash(String),
}

/// One configured user, its hash parsed once.
struct User {
    hash: PasswordHash,
    tags: Vec<String>,
    loopback_only: bool,
}

/// Verifies logins for every protocol. Its user table can change at
/// runtime ([`Self::put`], [`Self::remove`]: the engine's durable user
/// definitions); a changed or removed user's cached logins are forgotten.
pub struct Authenticator {
    users: RwLock<HashMap<String, Arc<User>>>,
    /// Verified against for unknown users, so they cost what a wrong
    /// password costs.
    dummy: PasswordHash,
    /// Random per process: cache entries are MACs of (user, password) under
    /// it, so the cache never holds a password, and its contents are
    /// useless outside this process.
    cache_key: [u8; 32],
    cache: Mutex<HashMap<String, Vec<[u8; 32]>>>,
    /// Slow verifications run (argon2 hashes), for tests and metrics.
    verifications: AtomicU64,
}

impl fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authenticator")
            .field("users", &self.len())
            .finish_non_exhaustive()
    }
}

/// Hashes `password` with argon2id and the recommended default parameters
/// (19 MiB, 2 passes, 1 lane) and a random salt; returns the PHC string.
pub fn hash_password(password: &[u8]) -> Result<String, AuthError> {
    Argon2::default()
        .hash_password(password)
        .map(|h| h.to_string())
        .map_err(|e| AuthError::Hash(e.to_string()))
}

/// Parses a configured PHC string and checks it is argon2id with parameters
/// a login can afford.
/// Whether `phc` is a hash [`Authenticator::put`] accepts for `user`
/// (checked before a definitions import changes anything).
pub(crate) fn check_hash(user: &str, phc: &str) -> Result<(), AuthError> {
    parse_hash(user, phc).map(|_| ())
}

fn parse_hash(user: &str, phc: &str) -> Result<PasswordHash, AuthError> {
    let bad = |reason: String| AuthError::BadHash {
        user: user.to_string(),
        reason,
    };
    let hash = PasswordHash::new(phc.trim()).map_err(|e| bad(e.to_string()))?;
    if hash.algorithm.as_str() != Algorithm::Argon2id.ident().as_str() {
        return Err(bad(format!(
            "algorithm {} (only argon2id is accepted)",
            hash.algorithm
        )));
    }
    let params = Params::try_from(&hash).map_err(|e| bad(e.to_string()))?;
    if params.m_cost() > MAX_M_COST_KIB || params.t_cost() > MAX_T_COST {
        return Err(bad(format!(
            "parameters m={} t={} exceed the limits m={MAX_M_COST_KIB} t={MAX_T_COST}",
            params.m_cost(),
            params.t_cost()
        )));
    }
    if hash.salt.is_none() || hash.hash.is_none() {
        return Err(bad("missing salt or hash".into()));
    }
    Ok(hash)
}

/// A hash with the default parameters, a random salt and a random output:
/// verifying against it costs what a real verification costs, and no
/// password matches it (that would take finding an argon2 preimage). Built
/// without hashing, so it costs nothing at startup.
fn dummy_hash() -> Result<PasswordHash, AuthError> {
    let err = |e: &dyn fmt::Display| AuthError::Hash(e.to_string());
    let mut salt = [0u8; 16];
    let mut output = [0u8; Params::DEFAULT_OUTPUT_LEN];
    getrandom::fill(&mut salt).map_err(|e| err(&e))?;
    getrandom::fill(&mut output).map_err(|e| err(&e))?;
    let params = Params::default();
    Ok(PasswordHash {
        algorithm: Algorithm::Argon2id.ident(),
        version: Some(argon2::Version::default().into()),
        params: ParamsString::try_from(&params).map_err(|e| err(&e))?,
        salt: Some(Salt::new(&salt).map_err(|e| err(&e))?),
        hash: Some(Output::new(&output).map_err(|e| err(&e))?),
    })
}

/// The PHC string of a configured credential: a hash as given, a plain
/// password hashed (slow; `guest` resolves to [`GUEST_PASSWORD_HASH`]).
pub fn resolve_credential(spec: &UserSpec) -> Result<String, AuthError> {
    if spec.name.is_empty() {
        return Err(AuthError::EmptyName);
    }
    match &spec.credential {
        Credential::Hash(phc) => {
            parse_hash(&spec.name, phc)?;
            Ok(phc.trim().to_string())
        }
        Credential::Plain(pass) if pass == "guest" => Ok(GUEST_PASSWORD_HASH.to_string()),
        Credential::Plain(pass) => hash_password(pass.as_bytes()),
    }
}

impl Authenticator {
    /// Builds the user table. Plain passwords are hashed here (slow: one
    /// argon2 hash each).
    pub fn new(specs: impl IntoIterator<Item = UserSpec>) -> Result<Self, AuthError> {
        let mut users = HashMap::new();
        for spec in specs {
            let phc = resolve_credential(&spec)?;
            let user = User {
                hash: parse_hash(&spec.name, &phc)?,
                tags: spec.tags,
                loopback_only: spec.loopback_only,
            };
            if users.insert(spec.name.clone(), Arc::new(user)).is_some() {
                return Err(AuthError::Duplicate(spec.name));
            }
        }
        let dummy = dummy_hash()?;
        let mut cache_key = [0u8; 32];
        getrandom::fill(&mut cache_key).map_err(|e| AuthError::Hash(e.to_string()))?;
        Ok(Authenticator {
            users: RwLock::new(users),
            dummy,
            cache_key,
            cache: Mutex::new(HashMap::new()),
            verifications: AtomicU64::new(0),
        })
    }

    /// Adds or replaces user `name` (its hash checked as at load); its
    /// cached logins are forgotten, so an old password stops working at once.
    pub fn put(
        &self,
        name: &str,
        phc: &str,
        tags: Vec<String>,
        loopback_only: bool,
    ) -> Result<(), AuthError> {
        if name.is_empty() {
            return Err(AuthError::EmptyName);
        }
        let user = User {
            hash: parse_hash(name, phc)?,
            tags,
            loopback_only,
        };
        self.users.write().insert(name.to_string(), Arc::new(user));
        self.cache.lock().remove(name);
        Ok(())
    }

    /// Removes user `name` and its cached logins; whether it existed.
    pub fn remove(&self, name: &str) -> bool {
        let had = self.users.write().remove(name).is_some();
        self.cache.lock().remove(name);
        had
    }

    /// Number of configured users.
    pub fn len(&self) -> usize {
        self.users.read().len()
    }

    /// Slow verifications run so far ([`Self::authenticate`] calls, each one
    /// argon2 hash): what a login flood cost.
    pub fn verifications(&self) -> u64 {
        self.verifications.load(Ordering::Relaxed)
    }

    /// Whether no user is configured (every login fails).
    pub fn is_empty(&self) -> bool {
        self.users.read().is_empty()
    }

    /// The fast path: `Some(result)` when this user logged in with this
    /// password before (from `peer`, the loopback rule is applied again),
    /// `None` when only [`Self::authenticate`] can tell.
    pub fn check_cached(
        &self,
        user: &str,
        password: &[u8],
        peer: IpAddr,
    ) -> Option<Result<Principal, AuthFailure>> {
        let mac = self.mac(user, password);
        let hit = {
            let cache = self.cache.lock();
            let entries = cache.get(user)?;
            // Constant time per entry; the number of entries per user is not secret.
            entries
                .iter()
                .fold(subtle::Choice::from(0), |acc, e| acc | e.ct_eq(&mac))
        };
        if !bool::from(hit) {
            return None;
        }
        let u = self.users.read().get(user).cloned()?;
        Some(self.admit(user, &u, peer))
    }

    /// Verifies a login: slow (one argon2 hash), call it off the async
    /// runtime. Unknown users and wrong passwords fail alike.
    pub fn authenticate(
        &self,
        user: &str,
        password: &[u8],
        peer: IpAddr,
    ) -> Result<Principal, AuthFailure> {
        let argon = Argon2::default();
        self.verifications.fetch_add(1, Ordering::Relaxed);
        let Some(u) = self.users.read().get(user).cloned() else {
            // Same work as a wrong password; the result is always a failure.
            let _ = argon.verify_password(password, &self.dummy);
            return Err(AuthFailure);
        };
        argon
            .verify_password(password, &u.hash)
            .map_err(|_| AuthFailure)?;
        self.remember(user, password, &u);
        self.admit(user, &u, peer)
    }

    /// A login vouched for by the transport (a verified TLS client
    /// certificate naming `user`): no password, but the user must exist
    /// and the other checks of a login apply.
    pub fn known_user(&self, user: &str, peer: IpAddr) -> Result<Principal, AuthFailure> {
        let u = self.users.read().get(user).cloned().ok_or(AuthFailure)?;
        self.admit(user, &u, peer)
    }

    /// The checks after a correct password.
    fn admit(&self, name: &str, u: &User, peer: IpAddr) -> Result<Principal, AuthFailure> {
        if u.loopback_only && !is_loopback(peer) {
            return Err(AuthFailure);
        }
        Ok(Principal {
            name: name.to_string(),
            tags: u.tags.clone(),
        })
    }

    /// Caches a verified login, unless the user changed since `verified`
    /// was read ([`Self::put`] replaces the user before it empties the
    /// cache, and this checks under the cache's lock: an old password is
    /// never cached after the change).
    fn remember(&self, user: &str, password: &[u8], verified: &Arc<User>) {
        let mac = self.mac(user, password);
        let mut cache = self.cache.lock();
        let current = self.users.read().get(user).cloned();
        if !current.is_some_and(|c| Arc::ptr_eq(&c, verified)) {
            return;
        }
        let total: usize = cache.values().map(Vec::len).sum();
        if total >= CACHE_MAX {
            cache.clear();
        }
        let entries = cache.entry(user.to_string()).or_default();
        if !entries.iter().any(|e| bool::from(e.ct_eq(&mac))) {
            entries.push(mac);
        }
        debug_assert!(cache.values().map(Vec::len).sum::<usize>() <= CACHE_MAX);
    }

    /// Keyed MAC of (user, password); the length prefix keeps ("ab","c")
    /// and ("a","bc") apart.
    fn mac(&self, user: &str, password: &[u8]) -> [u8; 32] {
        let mut m = <Blake2sMac256 as KeyInit>::new_from_slice(&self.cache_key)
            .expect("a 32-byte key is valid for Blake2s");
        m.update(&(user.len() as u64).to_le_bytes());
        m.update(user.as_bytes());
        m.update(password);
        m.finalize().into_bytes().into()
    }
}

/// Loopback, counting IPv4-mapped IPv6 loopback (`::ffff:127.0.0.1`).
fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v| v.is_loopback()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    const REMOTE: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 7));

    fn user(name: &str, credential: Credential) -> UserSpec {
        UserSpec {
            name: name.into(),
            credential,
            tags: vec!["administrator".into()],
            loopback_only: false,
        }
    }

    #[test]
    fn hashed_and_plain_users_log_in_and_wrong_passwords_fail() {
        let phc = hash_password(b"s3cret").expect("hash");
        assert!(phc.starts_with("$argon2id$v=19$"), "{phc}");
        let auth = Authenticator::new([
            user("alice", Credential::Hash(phc)),
            user("bob", Credential::Plain("hunter2".into())),
        ])
        .expect("valid users");
        let p = auth
            .authenticate("alice", b"s3cret", REMOTE)
            .expect("alice");
        assert_eq!(p.name, "alice");
        assert_eq!(p.tags, vec!["administrator".to_string()]);
        assert!(auth.authenticate("bob", b"hunter2", REMOTE).is_ok());
        assert_eq!(
            auth.authenticate("alice", b"s3creT", REMOTE),
            Err(AuthFailure)
        );
        assert_eq!(auth.authenticate("alice", b"", REMOTE), Err(AuthFailure));
        assert_eq!(
            auth.authenticate("bob", b"s3cret", REMOTE),
            Err(AuthFailure)
        );
        // An unknown user fails exactly like a wrong password.
        assert_eq!(
            auth.authenticate("carol", b"s3cret", REMOTE),
            Err(AuthFailure)
        );
    }

    #[test]
    fn known_user_needs_an_existing_user_and_keeps_the_loopback_rule() {
        let mut guest = user("guest", Credential::Plain("guest".into()));
        guest.loopback_only = true;
        let auth = Authenticator::new([user("alice", Credential::Plain("guest".into())), guest])
            .expect("valid users");
        assert_eq!(
            auth.known_user("alice", REMOTE).map(|p| p.name),
            Ok("alice".into())
        );
        assert_eq!(auth.known_user("carol", LOCAL), Err(AuthFailure));
        assert!(auth.known_user("guest", LOCAL).is_ok());
        assert_eq!(auth.known_user("guest", REMOTE), Err(AuthFailure));
    }

    #[test]
    fn the_cache_answers_only_for_passwords_that_succeeded() {
        let auth = Authenticator::new([user("alice", Credential::Plain("pw".into()))])
            .expect("valid users");
        assert_eq!(auth.check_cached("alice", b"pw", REMOTE), None);
        assert_eq!(
            auth.authenticate("alice", b"nope", REMOTE),
            Err(AuthFailure)
        );
        assert_eq!(
            auth.check_cached("alice", b"nope", REMOTE),
            None,
            "failures are not cached"
        );
        assert!(auth.authenticate("alice", b"pw", REMOTE).is_ok());
        assert!(matches!(
            auth.check_cached("alice", b"pw", REMOTE),
            Some(Ok(_))
        ));
        assert_eq!(auth.check_cached("alice", b"pw2", REMOTE), None);
        assert_eq!(auth.check_cached("alicf", b"pw", REMOTE), None);
    }

    #[test]
    fn a_changed_or_removed_user_is_not_accepted_from_the_cache() {
        let auth = Authenticator::new([user("alice", Credential::Plain("pw".into()))])
            .expect("valid users");
        assert!(auth.authenticate("alice", b"pw", REMOTE).is_ok());
        assert!(matches!(
            auth.check_cached("alice", b"pw", REMOTE),
            Some(Ok(_))
        ));
        let phc = hash_password(b"new").expect("hash");
        auth.put("alice", &phc, vec![], false).expect("put");
        assert_eq!(auth.check_cached("alice", b"pw", REMOTE), None);
        assert_eq!(auth.authenticate("alice", b"pw", REMOTE), Err(AuthFailure));
        assert!(auth.authenticate("alice", b"new", REMOTE).is_ok());
        assert!(matches!(
            auth.check_cached("alice", b"new", REMOTE),
            Some(Ok(_))
        ));
        assert!(auth.remove("alice"));
        assert_eq!(auth.check_cached("alice", b"new", REMOTE), None);
        assert_eq!(auth.authenticate("alice", b"new", REMOTE), Err(AuthFailure));
        // Added at runtime: accepted.
        auth.put("bob", &phc, vec!["monitoring".into()], false)
            .expect("put");
        let p = auth.authenticate("bob", b"new", REMOTE).expect("bob");
        assert_eq!(p.tags, vec!["monitoring".to_string()]);
    }

    #[test]
    fn the_cache_is_bounded() {
        let auth = Authenticator::new([user("a", Credential::Plain("x".into()))]).expect("users");
        let u = auth.users.read().get("a").cloned().expect("user a");
        for i in 0..(CACHE_MAX + 10) {
            auth.remember("a", format!("{i}").as_bytes(), &u);
        }
        let total: usize = auth.cache.lock().values().map(Vec::len).sum();
        assert!(total <= CACHE_MAX, "{total}");
    }

    #[test]
    fn loopback_only_users_are_refused_from_elsewhere_even_when_cached() {
        let mut guest = user("guest", Credential::Plain("guest".into()));
        guest.loopback_only = true;
        let auth = Authenticator::new([guest]).expect("users");
        assert!(auth.authenticate("guest", b"guest", LOCAL).is_ok());
        assert_eq!(
            auth.authenticate("guest", b"guest", REMOTE),
            Err(AuthFailure)
        );
        assert_eq!(
            auth.check_cached("guest", b"guest", REMOTE),
            Some(Err(AuthFailure))
        );
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().expect("ip");
        assert!(auth.authenticate("guest", b"guest", mapped).is_ok());
        assert!(auth
            .authenticate("guest", b"guest", "::1".parse().expect("ip"))
            .is_ok());
    }

    #[test]
    fn bad_hashes_and_duplicates_are_refused_at_load() {
        for bad in [
            "plain-text",
            "$argon2i$v=19$m=19456,t=2,p=1$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA",
            "$argon2id$v=19$m=4194304,t=2,p=1$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA",
        ] {
            let err = Authenticator::new([user("x", Credential::Hash(bad.into()))]).unwrap_err();
            assert!(
                matches!(err, AuthError::BadHash { ref user, .. } if user == "x"),
                "{err}"
            );
        }
        let err = Authenticator::new([
            user("x", Credential::Plain("a".into())),
            user("x", Credential::Plain("b".into())),
        ])
        .unwrap_err();
        assert!(matches!(err, AuthError::Duplicate(ref n) if n == "x"));
    }

    #[test]
    fn the_builtin_guest_hash_is_guest_and_the_dummy_matches_nothing() {
        let argon = Argon2::default();
        let guest = PasswordHash::new(GUEST_PASSWORD_HASH).expect("valid PHC");
        assert!(argon.verify_password(b"guest", &guest).is_ok());
        assert!(argon.verify_password(b"guesT", &guest).is_err());
        let dummy = dummy_hash().expect("dummy");
        // Same shape (algorithm, parameters) as a real default hash.
        let real = PasswordHash::new(&hash_password(b"x").expect("hash")).expect("PHC");
        assert_eq!(dummy.algorithm, real.algorithm);
        assert_eq!(dummy.params, real.params);
        assert_eq!(dummy.version, real.version);
        assert!(parse_hash("d", &dummy.to_string()).is_ok());
        assert!(argon.verify_password(b"", &dummy).is_err());
        assert!(argon.verify_password(b"x", &dummy).is_err());
    }

    #[test]
    fn credentials_never_print() {
        let c = Credential::Plain("hunter2".into());
        assert!(!format!("{c:?}").contains("hunter2"));
        let u = user("a", c);
        assert!(!format!("{u:?}").contains("hunter2"));
    }
}
