//! Configuration in sections, loaded in layers: flags > environment
//! (`WEIR_…`) > TOML file (`--config`, `WEIR_CONFIG`) > defaults.
//!
//! The file is split by owner: `[amqp]`, `[mqtt]`, `[http]`, `[native]`,
//! `[store]` (with `[store.log]`), `[quota]`, `[auth]` (with
//! `[[auth.users]]`), plus the top-level `log`. Each section is its own type
//! ([`AmqpConfig`], [`StoreConfig`], …) with its defaults in its `Default`
//! impl; a new protocol adds its section type and one field of [`Config`].
//!
//! Flags and environment variables are declared once, in [`SETTINGS`]: each
//! row names a flag, a variable and the dotted path in the file it sets. The
//! loader writes flag and environment values into the parsed file at those
//! paths and then deserializes each section, so a setting has one type and
//! one default, wherever its value came from.
//!
//! Old flat keys (`amqp_listen`, `data_dir`, `heartbeat`, top-level
//! `[[users]]`, …) are still accepted: each is moved to its new place with a
//! deprecation warning naming the new key. Setting both the old and the new
//! key is an error.

use clap::{Arg, ArgAction, CommandFactory, FromArgMatches};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use toml::{Table, Value};
use weir_engine::auth::{Credential, UserSpec};

// ---------------------------------------------------------------------------
// settings reachable from flags and the environment

/// How a flag or environment string becomes a TOML value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Kept as a string (addresses, paths, sizes with units, passwords).
    Str,
    /// A non-negative integer.
    Uint,
    /// `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`).
    Bool,
}

/// One setting reachable from the command line and the environment.
#[derive(Debug)]
pub struct Setting {
    /// Dotted path in the TOML file, e.g. `amqp.listen`.
    pub path: &'static str,
    /// Long flag without the dashes, e.g. `amqp-listen`.
    pub flag: &'static str,
    /// Environment variable.
    pub env: &'static str,
    /// How the flag or variable's text is read.
    pub kind: Kind,
    /// The flat key this setting had before sections (accepted, deprecated).
    pub legacy: Option<&'static str>,
    /// `--help` text.
    pub help: &'static str,
}

macro_rules! settings {
    ($($path:literal, $flag:literal, $env:literal, $kind:ident, $legacy:expr, $help:literal;)*) => {
        /// Every setting reachable from a flag or an environment variable.
        pub const SETTINGS: &[Setting] = &[$(Setting {
            path: $path,
            flag: $flag,
            env: $env,
            kind: Kind::$kind,
            legacy: $legacy,
            help: $help,
        }),*];
    };
}

settings! {
    "log", "log", "WEIR_LOG", Str, None,
        "Log filter, tracing's EnvFilter syntax [default: info]";
    "log_format", "log-format", "WEIR_LOG_FORMAT", Str, None,
        "Log lines: text (colours only on a terminal) or json (one JSON object per line) \
         [default: text]";
    "amqp.listen", "amqp-listen", "WEIR_AMQP_LISTEN", Str, Some("amqp_listen"),
        "AMQP 0-9-1 listen address [default: 0.0.0.0:5672]";
    "amqp.frame_max", "frame-max", "WEIR_FRAME_MAX", Uint, Some("frame_max"),
        "Largest AMQP frame accepted, bytes [default: 131072]";
    "amqp.channel_max", "channel-max", "WEIR_CHANNEL_MAX", Uint, None,
        "Highest AMQP channel number offered [default: 2047]";
    "amqp.heartbeat", "heartbeat", "WEIR_HEARTBEAT", Uint, Some("heartbeat"),
        "Heartbeat interval offered to AMQP clients, seconds [default: 60]";
    "amqp.consumer_timeout", "consumer-timeout", "WEIR_CONSUMER_TIMEOUT", Uint, Some("consumer_timeout"),
        "Seconds a delivery may stay unacknowledged before its channel is closed (406) and its \
         messages return to the queue; 0 = never [default: 1800, as RabbitMQ]";
    "amqp.partial_content_timeout", "partial-content-timeout", "WEIR_PARTIAL_CONTENT_TIMEOUT", Uint, Some("partial_content_timeout"),
        "Seconds a connection may hold a partly received message without progress before it is \
         closed (0 = never) [default: 30]";
    "mqtt.listen", "mqtt-listen", "WEIR_MQTT_LISTEN", Str, None,
        "MQTT 3.1.1 and 5 listen address [default: 0.0.0.0:1883]";
    "mqtt.ws_listen", "mqtt-ws-listen", "WEIR_MQTT_WS_LISTEN", Str, None,
        "MQTT over WebSocket listen address (path /mqtt, subprotocol mqtt) [default: 0.0.0.0:8083]";
    "amqp.tls_listen", "amqps-listen", "WEIR_AMQPS_LISTEN", Str, None,
        "AMQP 0-9-1 over TLS listen address, served when [tls] is configured [default: 0.0.0.0:5671]";
    "mqtt.tls_listen", "mqtts-listen", "WEIR_MQTTS_LISTEN", Str, None,
        "MQTT over TLS listen address, served when [tls] is configured [default: 0.0.0.0:8883]";
    "mqtt.wss_listen", "mqtt-wss-listen", "WEIR_MQTT_WSS_LISTEN", Str, None,
        "MQTT over secure WebSocket (TLS, path /mqtt) listen address, served when [tls] is \
         configured [default: 0.0.0.0:8084]";
    "mqtt.ssl_cert_login", "mqtt-ssl-cert-login", "WEIR_MQTT_SSL_CERT_LOGIN", Bool, None,
        "MQTT over TLS: a verified client certificate's subject CN is the user, no password \
         needed [default: false]";
    "mqtt.allow_anonymous", "mqtt-allow-anonymous", "WEIR_MQTT_ALLOW_ANONYMOUS", Bool, None,
        "MQTT: a CONNECT without a username logs in as mqtt.default_user (with that user's \
         loopback-only rule); false refuses it (CONNACK 5 / 0x87) [default: true]";
    "mqtt.default_user", "mqtt-default-user", "WEIR_MQTT_DEFAULT_USER", Str, None,
        "MQTT: the user anonymous clients log in as [default: guest]";
    "tls.cert_file", "tls-cert-file", "WEIR_TLS_CERT_FILE", Str, None,
        "TLS: the server's certificate chain (PEM); setting it turns TLS on";
    "tls.key_file", "tls-key-file", "WEIR_TLS_KEY_FILE", Str, None,
        "TLS: the server's private key (PEM)";
    "tls.ca_file", "tls-ca-file", "WEIR_TLS_CA_FILE", Str, None,
        "TLS: CA certificates of clients (PEM); when set, client certificates are requested \
         and verified";
    "tls.fail_if_no_peer_cert", "tls-fail-if-no-peer-cert", "WEIR_TLS_FAIL_IF_NO_PEER_CERT", Bool, None,
        "TLS: refuse clients without a certificate (needs ca_file) [default: false]";
    "tls.reload_interval", "tls-reload-interval", "WEIR_TLS_RELOAD_INTERVAL", Uint, None,
        "TLS: seconds between checks of the files' modification times (0 = only on SIGHUP) \
         [default: 5]";
    "http.listen", "http-listen", "WEIR_HTTP_LISTEN", Str, None,
        "HTTP listen address: management API, /metrics, dashboard [default: 0.0.0.0:15672]";
    "http.metrics_per_queue", "http-metrics-per-queue", "WEIR_HTTP_METRICS_PER_QUEUE", Bool, None,
        "/metrics: one series per queue (false: queue series summed per tenant, for very large \
         installations) [default: true]";
    "http.metrics_auth", "http-metrics-auth", "WEIR_HTTP_METRICS_AUTH", Bool, None,
        "/metrics: the per-queue series need Basic auth of a `monitoring` or `administrator` \
         user; without credentials the answer sums queue series per tenant [default: true]";
    "http.max_connections", "http-max-connections", "WEIR_HTTP_MAX_CONNECTIONS", Uint, None,
        "Most HTTP connections at once (0 = no limit); more are answered 503 and closed \
         [default: 1024]";
    "http.header_timeout", "http-header-timeout", "WEIR_HTTP_HEADER_TIMEOUT", Uint, None,
        "Seconds a client has to send a request's headers, counted from when the connection \
         opens or its previous answer was sent (so also how long a keep-alive connection may \
         wait idle) [default: 15]";
    "http.idle_timeout", "http-idle-timeout", "WEIR_HTTP_IDLE_TIMEOUT", Uint, None,
        "Seconds an HTTP connection may move no byte either way (a client that does not read \
         its answer, a stalled request body) before it is closed [default: 60]";
    "native.listen", "native-listen", "WEIR_NATIVE_LISTEN", Str, None,
        "Native protocol listen address (reserved: not served yet)";
    "store.kind", "store", "WEIR_STORE", Str, None,
        "Store: log (embedded) or fdb (FoundationDB; needs a weir built with the `fdb` \
         feature) [default: log]";
    "store.fdb.cluster_file", "fdb-cluster-file", "WEIR_FDB_CLUSTER_FILE", Str, None,
        "FoundationDB store: the cluster file [default: FoundationDB's own default, \
         /etc/foundationdb/fdb.cluster]";
    "store.fdb.node_id", "node-id", "WEIR_NODE_ID", Str, None,
        "FoundationDB store: this gateway's name, unique among the gateways of one store \
         (ownership of partitions is held by name) [required with store = fdb]";
    "store.fdb.namespace", "fdb-namespace", "WEIR_FDB_NAMESPACE", Str, None,
        "FoundationDB store: the key prefix weir/<namespace>/ shared by the gateways of one \
         cluster [default: default]";
    "store.log.data_dir", "data-dir", "WEIR_DATA_DIR", Str, Some("data_dir"),
        "Directory of the embedded store [default: ./weir-data]";
    "store.log.segment_mb", "segment-mb", "WEIR_SEGMENT_MB", Uint, Some("segment_mb"),
        "Segment size of the embedded log in MiB [default: 64]";
    "store.log.fsync", "fsync", "WEIR_FSYNC", Bool, Some("fsync"),
        "Fsync the store before confirming [default: true]. Turning it off loses confirmed \
         messages on power failure; only for experiments";
    "quota.memory_limit", "memory-limit", "WEIR_MEMORY_LIMIT", Str, Some("memory_limit"),
        "Memory watermark: publishers are blocked while the broker's resident memory is above \
         it. Bytes with an optional suffix (512MB, 1GiB), or a fraction of physical RAM (0.4) \
         [default: 0.4, as RabbitMQ]";
    "quota.disk_free_limit", "disk-free-limit", "WEIR_DISK_FREE_LIMIT", Str, Some("disk_free_limit"),
        "Free-disk watermark on the data directory's filesystem: publishers are blocked while \
         less is free. Bytes with an optional suffix [default: 1GB or two segments, whichever \
         is larger]";
    "auth.default_pass", "default-pass", "WEIR_DEFAULT_PASS", Str, Some("default_pass"),
        "Password of the default user `guest` [default: guest]";
    "auth.guest_remote", "guest-remote", "WEIR_GUEST_REMOTE", Bool, Some("guest_remote"),
        "Allow the default user from non-loopback addresses [default: false]";
}

/// Flat keys that were tables, moved the same way as [`Setting::legacy`].
const LEGACY_TABLES: &[(&str, &str)] = &[("users", "auth.users")];

/// The top-level keys of the file: the sections and `log`.
const SECTIONS: &[&str] = &[
    "log",
    "amqp",
    "mqtt",
    "http",
    "native",
    "store",
    "quota",
    "auth",
    "policies",
    "tenants",
    "tls",
    "log_format",
    "shovels",
];

// ---------------------------------------------------------------------------
// the command line

/// What clap parses itself; the settings of [`SETTINGS`] are added to it.
#[derive(clap::Parser, Debug)]
#[command(
    name = "weir",
    version = crate::VERSION,
    about = "Weir: a multi-protocol message broker (AMQP 0-9-1 today)"
)]
struct Args {
    /// TOML configuration file.
    #[arg(long, env = "WEIR_CONFIG")]
    config: Option<PathBuf>,
    /// Before opening the store, move damaged log ranges into
    /// `<data-dir>/quarantine/` and keep every valid record (as `weir
    /// repair`), reporting exactly what was lost. Without it, damage that is
    /// not a torn tail refuses to start.
    #[arg(long)]
    repair: bool,
    /// A subcommand instead of running the broker.
    #[command(subcommand)]
    command: Option<Command>,
}

/// The parsed command line.
#[derive(Debug, Default)]
pub struct Cli {
    /// TOML configuration file (`--config`, `WEIR_CONFIG`).
    pub config: Option<PathBuf>,
    /// `--repair`: quarantine damaged log ranges before opening the store.
    pub repair: bool,
    /// A subcommand instead of running the broker.
    pub command: Option<Command>,
    /// Settings given as flags, with their text.
    flags: Vec<(&'static Setting, String)>,
}

/// Subcommands of `weir`.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Quarantine damaged ranges of the store's log (copied into
    /// `<data-dir>/quarantine/`), keep every valid record before and after
    /// them, report what was lost, and exit. The broker must not be running.
    Repair {
        /// Directory of the embedded store [default: the broker's --data-dir].
        #[arg(long, env = "WEIR_DATA_DIR")]
        data_dir: Option<PathBuf>,
    },
    /// Read a password from stdin and print its argon2id hash (a PHC
    /// string) for `password_hash` in `[[auth.users]]`.
    HashPassword,
    /// Validate a configuration file (every key, value, policy, tenant
    /// limit and TLS file) without starting: exit 0 and a summary when it
    /// would start, 2 and the reason when it would not. The environment and
    /// flags are not applied: the file alone is checked.
    CheckConfig {
        /// The TOML file to check.
        file: PathBuf,
    },
    /// Print a shell completion script for `weir` (bash, zsh, fish,
    /// elvish, powershell) to stdout.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the `weir(1)` man page (roff) to stdout.
    Man,
}

impl Cli {
    /// The clap command with every flag, for completions and man pages.
    pub fn clap_command() -> clap::Command {
        Self::command()
    }

    /// The command line of `weir --config FILE` with no flags (what
    /// `weir check-config FILE` loads).
    pub fn for_file(file: PathBuf) -> Self {
        Cli {
            config: Some(file),
            ..Cli::default()
        }
    }

    /// The clap command: [`Args`] plus one flag per row of [`SETTINGS`].
    fn command() -> clap::Command {
        let mut cmd = Args::command();
        for s in SETTINGS {
            cmd = cmd.arg(
                Arg::new(s.path)
                    .long(s.flag)
                    .value_name(value_name(s))
                    .action(ArgAction::Set)
                    .help(format!("{} [env: {}] [file: {}]", s.help, s.env, s.path)),
            );
        }
        cmd
    }

    /// Parses the process's arguments; prints help or an error and exits
    /// as clap does.
    pub fn parse() -> Self {
        match Self::try_parse_from(std::env::args_os()) {
            Ok(cli) => cli,
            Err(e) => e.exit(),
        }
    }

    /// Parses `args` (the first is the program name).
    pub fn try_parse_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let m = Self::command().try_get_matches_from(args)?;
        let args = Args::from_arg_matches(&m)?;
        let flags = SETTINGS
            .iter()
            .filter_map(|s| m.get_one::<String>(s.path).map(|v| (s, v.clone())))
            .collect();
        Ok(Cli {
            config: args.config,
            repair: args.repair,
            command: args.command,
            flags,
        })
    }
}

/// The placeholder `--help` shows for a flag's value.
fn value_name(s: &Setting) -> &'static str {
    let last = s.path.rsplit('.').next().unwrap_or(s.path);
    match (s.kind, last) {
        (Kind::Uint, _) => "N",
        (Kind::Bool, _) => "BOOL",
        (_, "listen" | "tls_listen" | "wss_listen") => "ADDR",
        (_, "cert_file" | "key_file" | "ca_file") => "FILE",
        (_, "data_dir") => "DIR",
        (_, "memory_limit" | "disk_free_limit") => "SIZE",
        (_, "kind") => "KIND",
        (_, "default_pass") => "PASSWORD",
        (_, "log") => "FILTER",
        _ => "VALUE",
    }
}

// ---------------------------------------------------------------------------
// the sections

/// `[amqp]`: the AMQP 0-9-1 listener and its limits.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AmqpConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// Largest frame accepted and offered, bytes (at least 4096).
    pub frame_max: u32,
    /// Highest channel number offered (at least 1).
    pub channel_max: u16,
    /// Heartbeat offered, seconds (0 disables).
    pub heartbeat: u16,
    /// Seconds a delivery may stay unacknowledged; 0 = never.
    pub consumer_timeout: u64,
    /// Seconds a partly received message may make no progress; 0 = never.
    pub partial_content_timeout: u64,
    /// AMQP over TLS listen address (only with `[tls]`; default
    /// [`AMQPS_DEFAULT_LISTEN`]).
    pub tls_listen: Option<SocketAddr>,
}

impl Default for AmqpConfig {
    fn default() -> Self {
        AmqpConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 5672)),
            frame_max: 131_072,
            channel_max: 2047,
            heartbeat: 60,
            consumer_timeout: 1800,
            partial_content_timeout: 30,
            tls_listen: None,
        }
    }
}

/// `[mqtt]`: the MQTT 3.1.1 and 5 listener and its limits.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct MqttConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// MQTT over WebSocket listen address (path `/mqtt`).
    pub ws_listen: SocketAddr,
    /// Largest packet accepted from a client, bytes (MQTT 5: offered in
    /// CONNACK; larger packets: 0x95).
    pub max_packet_size: u32,
    /// QoS 1/2 publishes a client may have unacknowledged towards the
    /// broker (CONNACK receive maximum; more: 0x93).
    pub receive_maximum: u16,
    /// Most MQTT clients logged in at once (0 = no limit; more: CONNACK
    /// 0x97, 3.1.1 return code 3). Sockets still before their CONNACK
    /// count too: beyond this plus [`crate::mqtt::LOGIN_HEADROOM`] open
    /// MQTT sockets a new one is closed at once.
    pub max_connections: usize,
    /// Largest CONNECT accepted, bytes: what a client that has not logged
    /// in may make the broker buffer (larger: CONNACK 0x95 on MQTT 5, the
    /// connection closed on 3.1.1; over WebSocket, close 1009).
    pub max_connect_size: u32,
    /// Most messages queued for one session (0 = no limit); beyond it the
    /// oldest are dropped.
    pub max_queued_messages: u64,
    /// Most levels in a topic name or filter.
    pub max_topic_levels: usize,
    /// Longest session expiry granted, seconds (0 = as asked; MQTT 3.1.1
    /// persistent sessions never expire then).
    pub max_session_expiry: u32,
    /// Topic aliases a client may use towards the broker.
    pub topic_alias_maximum: u16,
    /// Keep-alive imposed on MQTT 5 clients asking for none or a longer
    /// one, seconds (0 = the client's own).
    pub server_keep_alive: u16,
    /// Retained messages kept per tenant (0 = no limit; more: 0x97).
    pub max_retained_per_tenant: usize,
    /// Bytes of retained messages kept in all (0 = no limit; more: 0x97).
    pub max_retained_bytes: u64,
    /// Bytes of retained messages kept per tenant, within
    /// `max_retained_bytes` (0 = no limit; more: 0x97).
    pub max_retained_bytes_per_tenant: u64,
    /// Most subscriptions of one session (0 = no limit; more: SUBACK 0x97,
    /// 3.1.1: 0x80).
    pub max_subscriptions: usize,
    /// MQTT over TLS listen address (only with `[tls]`; default
    /// [`MQTTS_DEFAULT_LISTEN`]).
    pub tls_listen: Option<SocketAddr>,
    /// MQTT over secure WebSocket listen address (only with `[tls]`;
    /// default [`MQTT_WSS_DEFAULT_LISTEN`]).
    pub wss_listen: Option<SocketAddr>,
    /// Over TLS, a verified client certificate's subject CN is the user
    /// and no password is needed (RabbitMQ's `mqtt.ssl_cert_login`).
    pub ssl_cert_login: bool,
    /// A CONNECT without a username logs in as [`Self::default_user`]
    /// (RabbitMQ's `mqtt.allow_anonymous`); `false` refuses it (CONNACK
    /// 0x87, 3.1.1: 5).
    pub allow_anonymous: bool,
    /// The user anonymous clients log in as, with its tenant access,
    /// permissions and loopback-only rule (RabbitMQ's `mqtt.default_user`).
    pub default_user: String,
}

impl Default for MqttConfig {
    fn default() -> Self {
        MqttConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 1883)),
            ws_listen: SocketAddr::from(([0, 0, 0, 0], 8083)),
            max_packet_size: 16 << 20,
            receive_maximum: 1024,
            max_connections: DEFAULT_MQTT_MAX_CONNECTIONS,
            max_connect_size: weir_protocols::mqtt::DEFAULT_MAXIMUM_CONNECT_SIZE,
            max_queued_messages: 1_000_000,
            max_topic_levels: 32,
            max_session_expiry: 0,
            topic_alias_maximum: 64,
            server_keep_alive: 0,
            max_retained_per_tenant: 100_000,
            max_retained_bytes: 64 << 20,
            max_retained_bytes_per_tenant: 16 << 20,
            max_subscriptions: 1000,
            tls_listen: None,
            wss_listen: None,
            ssl_cert_login: false,
            allow_anonymous: true,
            default_user: DEFAULT_USER.to_string(),
        }
    }
}

/// `[mqtt] max_connections` by default: an IoT fleet's worth, well under a
/// common file-descriptor limit (raise both together).
pub const DEFAULT_MQTT_MAX_CONNECTIONS: usize = 10_000;

/// Where AMQPS listens when `[tls]` is configured and `amqp.tls_listen` is not.
pub const AMQPS_DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 5671);
/// Where MQTTS listens when `[tls]` is configured and `mqtt.tls_listen` is not.
pub const MQTTS_DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 8883);

/// Where MQTT over secure WebSocket listens when `[tls]` is configured and
/// `mqtt.wss_listen` is not (EMQX's port; 8083 is its and Weir's `ws`).
pub const MQTT_WSS_DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 8084);

/// `[tls]`: TLS on the AMQPS and MQTTS listeners. Present = TLS is served;
/// absent = nothing TLS listens. The files are read at startup (a bad file
/// refuses to start) and again when they change or on SIGHUP (a bad file
/// then keeps the previous certificate); see `crate::tls`.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// The server's certificate chain, PEM (leaf first).
    pub cert_file: PathBuf,
    /// The server's private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// CA certificates that sign client certificates, PEM. When set,
    /// clients are asked for a certificate, and one that does not verify
    /// is refused in the handshake.
    pub ca_file: Option<PathBuf>,
    /// Refuse clients that present no certificate (RabbitMQ's name).
    pub fail_if_no_peer_cert: bool,
    /// Seconds between checks of the files' modification times; 0 = reload
    /// only on SIGHUP.
    pub reload_interval: u64,
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig {
            cert_file: PathBuf::new(),
            key_file: PathBuf::new(),
            ca_file: None,
            fail_if_no_peer_cert: false,
            reload_interval: 5,
        }
    }
}

/// `[http]`: the management API, `/metrics` and the dashboard.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Listen address (RabbitMQ's management port by default).
    pub listen: SocketAddr,
    /// `/metrics` writes one series per queue; false sums the queue series
    /// per tenant (RabbitMQ's aggregated mode), for very large installations.
    pub metrics_per_queue: bool,
    /// `/metrics` writes the per-queue series only for a `monitoring` or
    /// `administrator` user (Basic auth); without credentials it sums them
    /// per tenant, so queue names stay private.
    pub metrics_auth: bool,
    /// Most HTTP connections at once (0 = no limit); more get a 503.
    pub max_connections: usize,
    /// Seconds to receive a request's headers, from when the connection is
    /// ready for them (opened, or its previous answer sent): also the
    /// keep-alive idle time. 0 = no limit.
    pub header_timeout: u64,
    /// Seconds a connection may move no byte either way. 0 = no limit.
    pub idle_timeout: u64,
}

/// The HTTP listener's default address, as RabbitMQ's management plugin.
pub const HTTP_DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 15672);

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: HTTP_DEFAULT_LISTEN,
            metrics_per_queue: true,
            metrics_auth: true,
            max_connections: 1024,
            header_timeout: 15,
            idle_timeout: 60,
        }
    }
}

/// `[native]`: a listener reserved for the adapter to
/// come. Parsed and kept, **not served yet** (no socket is opened).
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ReservedListener {
    /// Listen address, if set.
    pub listen: Option<SocketAddr>,
}

/// Which store implementation holds the data.
#[derive(Deserialize, Debug, Clone, Copy, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// The embedded, group-committed log (`[store.log]`).
    #[default]
    Log,
    /// FoundationDB (`[store.fdb]`); refused at load by a `weir` built
    /// without the `fdb` feature.
    Fdb,
}

/// `[store]`: which store, and each store's own subsection.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// `kind = "log" | "fdb"`.
    pub kind: StoreKind,
    /// `[store.log]`.
    pub log: LogStoreConfig,
    /// `[store.fdb]`.
    pub fdb: FdbStoreSection,
}

/// `[store.fdb]`: the FoundationDB store.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct FdbStoreSection {
    /// The cluster file; `None`: FoundationDB's default.
    pub cluster_file: Option<PathBuf>,
    /// This gateway's name (required).
    pub node_id: String,
    /// Keys live under `weir/<namespace>/`.
    pub namespace: String,
}

impl Default for FdbStoreSection {
    fn default() -> Self {
        FdbStoreSection {
            cluster_file: None,
            node_id: String::new(),
            namespace: "default".into(),
        }
    }
}

/// `[store.log]`: the embedded log.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogStoreConfig {
    /// Data directory.
    pub data_dir: PathBuf,
    /// Segment size in MiB (1 to 4095).
    pub segment_mb: u64,
    /// Fsync before confirming.
    pub fsync: bool,
}

impl Default for LogStoreConfig {
    fn default() -> Self {
        LogStoreConfig {
            data_dir: PathBuf::from("./weir-data"),
            segment_mb: 64,
            fsync: true,
        }
    }
}

impl LogStoreConfig {
    /// Segment size in bytes.
    pub fn segment_bytes(&self) -> u64 {
        self.segment_mb << 20
    }
}

/// A size in the file: an integer (bytes), a float (a fraction, for the
/// memory limit) or a string with a unit (`"512MB"`).
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum SizeSetting {
    /// Bytes.
    Bytes(u64),
    /// A fraction of physical RAM.
    Fraction(f64),
    /// Text: bytes with a unit, or a fraction.
    Text(String),
}

/// `[quota]`: resource watermarks, as written.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct QuotaConfig {
    /// Memory watermark [default: 0.4 of RAM].
    pub memory_limit: Option<SizeSetting>,
    /// Free-disk watermark [default: 1 GiB or two segments].
    pub disk_free_limit: Option<SizeSetting>,
    /// `[[quota.users]]`: per-user limits, on top of the tenant's.
    pub users: Vec<UserQuotaConfig>,
    /// `[[quota.connections]]`: per-connection overrides.
    pub connections: Vec<ConnectionQuotaConfig>,
}

/// One `[[quota.users]]` entry: limits of one user's connections, checked
/// on top of its tenant's (`[[tenants]]`). Connections are counted over all
/// tenants; the rates are shared by all the user's connections.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct UserQuotaConfig {
    /// The user (login name).
    pub name: String,
    /// Open connections of the user.
    #[serde(default)]
    pub max_connections: Option<u32>,
    /// Channels open at once on one of its AMQP connections.
    #[serde(default)]
    pub max_channels_per_connection: Option<u32>,
    /// Largest message body it may publish.
    #[serde(default)]
    pub max_message_size: Option<ByteSize>,
    /// Messages per second, all its connections together.
    #[serde(default)]
    pub publish_rate: Option<u32>,
    /// Bytes per second, all its connections together.
    #[serde(default)]
    pub publish_bytes_rate: Option<ByteSize>,
}

impl UserQuotaConfig {
    /// The user's limits, sizes resolved to bytes.
    pub fn limits(&self) -> Result<weir_quota::Limits, ConfigError> {
        let as_tenant = TenantConfig {
            max_connections: self.max_connections,
            max_channels_per_connection: self.max_channels_per_connection,
            max_message_size: self.max_message_size.clone(),
            publish_rate: self.publish_rate,
            publish_bytes_rate: self.publish_bytes_rate.clone(),
            ..TenantConfig::named(&self.name)
        };
        as_tenant.limits()
    }
}

/// One `[[quota.connections]]` entry: overrides for the connections whose
/// login name matches `user` and whose own name (AMQP `connection_name`
/// client property, MQTT client id) matches `name`; both are regular
/// expressions matched against the whole name, both optional. The first
/// matching entry applies (see `weir_quota::connections`).
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ConnectionQuotaConfig {
    /// Login names covered (regex, whole name).
    #[serde(default)]
    pub user: Option<String>,
    /// Connection names / MQTT client ids covered (regex, whole name).
    #[serde(default)]
    pub name: Option<String>,
    /// Messages per second of each matching connection, on top of its
    /// tenant's and user's rates.
    #[serde(default)]
    pub publish_rate: Option<u32>,
    /// Bytes per second of each matching connection. Bytes or a size with
    /// a unit.
    #[serde(default)]
    pub publish_bytes_rate: Option<ByteSize>,
    /// Channels open at once on a matching AMQP connection: replaces the
    /// tenant's and user's limit.
    #[serde(default)]
    pub max_channels_per_connection: Option<u32>,
}

impl ConnectionQuotaConfig {
    /// The rule, patterns compiled and sizes resolved.
    pub fn rule(&self) -> Result<weir_quota::ConnectionRule, ConfigError> {
        let what = || {
            format!(
                "quota.connections (user {:?}, name {:?})",
                self.user.as_deref().unwrap_or("*"),
                self.name.as_deref().unwrap_or("*")
            )
        };
        let as_tenant = TenantConfig {
            publish_bytes_rate: self.publish_bytes_rate.clone(),
            ..TenantConfig::named(&what())
        };
        let bytes_rate = as_tenant.limits()?.publish_bytes_rate;
        weir_quota::ConnectionRule::new(
            self.user.as_deref(),
            self.name.as_deref(),
            self.publish_rate,
            bytes_rate,
            self.max_channels_per_connection,
        )
        .map_err(|e| ConfigError::Invalid(format!("{}: {e}", what())))
    }
}

/// The watermarks in bytes, after defaults and units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Memory watermark in bytes of resident memory.
    pub memory_limit: u64,
    /// Free-disk watermark in bytes.
    pub disk_free_limit: u64,
}

/// A secret string: deserialized as a plain string, never printed.
#[derive(Deserialize, Clone, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"…\"")
    }
}

/// `[auth]`: the default user and the configured users.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Password of the default user `guest`, plain (hashed at startup).
    /// Ignored when `[[auth.users]]` defines `guest` itself.
    pub default_pass: Secret,
    /// Accept `guest` from non-loopback addresses.
    pub guest_remote: bool,
    /// `[[auth.users]]`.
    pub users: Vec<UserConfig>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            default_pass: Secret("guest".into()),
            guest_remote: false,
            users: Vec::new(),
        }
    }
}

/// One `[[auth.users]]` entry: `password_hash` (from `weir hash-password`)
/// or, discouraged, a plain `password` hashed at startup.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// Login name.
    pub name: String,
    /// argon2id PHC string.
    #[serde(default)]
    pub password_hash: Option<String>,
    /// Plain password (hashed at startup, with a warning).
    #[serde(default)]
    pub password: Option<Secret>,
    /// RabbitMQ-style tags, kept for later use.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Permissions per tenant (RabbitMQ definitions' `permissions`). Absent:
    /// every permission on `/` only (compatibility with files written before
    /// permissions existed); `[]`: none.
    #[serde(default)]
    pub permissions: Option<Vec<PermissionConfig>>,
    /// Topic permissions per tenant and exchange (RabbitMQ definitions'
    /// `topic_permissions`).
    #[serde(default)]
    pub topic_permissions: Vec<TopicPermissionConfig>,
}

/// One entry of a user's `permissions`: regular expressions over queue and
/// exchange names of `vhost` (`""` = nothing; not anchored, as in RabbitMQ).
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PermissionConfig {
    /// The tenant (default `/`).
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// Names the user may declare and delete.
    pub configure: String,
    /// Names the user may publish to and bind to.
    pub write: String,
    /// Names the user may consume from, purge and bind from.
    pub read: String,
}

/// One entry of a user's `topic_permissions`: regular expressions over the
/// routing keys of a topic exchange (`{username}`, `{vhost}`, `{client_id}`
/// are filled in).
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TopicPermissionConfig {
    /// The tenant (default `/`).
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// The exchange (default `amq.topic`, where MQTT publishes).
    #[serde(default = "default_topic_exchange")]
    pub exchange: String,
    /// Routing keys the user may publish with.
    pub write: String,
    /// Binding keys the user may bind (MQTT: subscribe) with.
    pub read: String,
}

fn default_topic_exchange() -> String {
    "amq.topic".to_string()
}

/// One `[[tenants]]` entry: a tenant (AMQP vhost) created at every start
/// if missing (durably; removing it from the file does not delete it).
/// The default tenant `/` always exists.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TenantConfig {
    /// The tenant's name (AMQP vhost, MQTT `tenant:` username prefix).
    pub name: String,
    /// Open connections (RabbitMQ's vhost limit `max-connections`).
    #[serde(default)]
    pub max_connections: Option<u32>,
    /// Channels open at once on one AMQP connection.
    #[serde(default)]
    pub max_channels_per_connection: Option<u32>,
    /// Queues (RabbitMQ's vhost limit `max-queues`).
    #[serde(default)]
    pub max_queues: Option<u32>,
    /// Exchanges declared by clients.
    #[serde(default)]
    pub max_exchanges: Option<u32>,
    /// Consumers (AMQP consumers, MQTT subscriptions' session queues).
    #[serde(default)]
    pub max_consumers: Option<u32>,
    /// Ready messages in the tenant's queues: at it, its publishers block.
    #[serde(default)]
    pub max_queued_messages: Option<u64>,
    /// Bytes of ready messages in the tenant's queues: at it, its
    /// publishers block. Bytes or a size with a unit (`"64MB"`).
    #[serde(default)]
    pub max_queued_bytes: Option<ByteSize>,
    /// Largest message body accepted. Bytes or a size with a unit.
    #[serde(default)]
    pub max_message_size: Option<ByteSize>,
    /// Bytes of ready messages the tenant's queues hold in memory (not
    /// paged out): at it, its publishers block, before the global memory
    /// watermark. Bytes or a size with a unit.
    #[serde(default)]
    pub max_memory: Option<ByteSize>,
    /// Messages per second, all the tenant's publishers together.
    #[serde(default)]
    pub publish_rate: Option<u32>,
    /// Bytes per second, all the tenant's publishers together. Bytes or a
    /// size with a unit.
    #[serde(default)]
    pub publish_bytes_rate: Option<ByteSize>,
}

/// A byte count in the file: an integer or a string with a unit (`"64MB"`).
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum ByteSize {
    /// Bytes.
    Bytes(u64),
    /// Bytes with a unit (see [`parse_bytes`]).
    Text(String),
}

impl ByteSize {
    fn bytes(&self, key: &str, tenant: &str) -> Result<u64, ConfigError> {
        match self {
            ByteSize::Bytes(n) => Ok(*n),
            ByteSize::Text(t) => parse_bytes(t).ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "tenants: {key} of tenant '{tenant}': cannot parse '{t}' as bytes"
                ))
            }),
        }
    }
}

impl TenantConfig {
    /// A tenant without limits.
    pub fn named(name: &str) -> Self {
        TenantConfig {
            name: name.into(),
            max_connections: None,
            max_channels_per_connection: None,
            max_queues: None,
            max_exchanges: None,
            max_consumers: None,
            max_queued_messages: None,
            max_queued_bytes: None,
            max_message_size: None,
            max_memory: None,
            publish_rate: None,
            publish_bytes_rate: None,
        }
    }

    /// The tenant's limits, sizes resolved to bytes.
    pub fn limits(&self) -> Result<weir_quota::Limits, ConfigError> {
        let bytes = |v: &Option<ByteSize>, key: &str| {
            v.as_ref().map(|b| b.bytes(key, &self.name)).transpose()
        };
        let rate = bytes(&self.publish_bytes_rate, "publish-bytes-rate")?
            .map(|b| {
                u32::try_from(b).map_err(|_| {
                    ConfigError::Invalid(format!(
                        "tenants: publish-bytes-rate of tenant '{}' is over 4 GiB/s",
                        self.name
                    ))
                })
            })
            .transpose()?;
        Ok(weir_quota::Limits {
            max_connections: self.max_connections,
            max_channels_per_connection: self.max_channels_per_connection,
            max_queues: self.max_queues,
            max_exchanges: self.max_exchanges,
            max_consumers: self.max_consumers,
            max_queued_messages: self.max_queued_messages,
            max_queued_bytes: bytes(&self.max_queued_bytes, "max-queued-bytes")?,
            max_message_size: bytes(&self.max_message_size, "max-message-size")?,
            max_memory: bytes(&self.max_memory, "max-memory")?,
            publish_rate: self.publish_rate,
            publish_bytes_rate: rate,
        })
    }
}

/// One `[[policies]]` entry: a RabbitMQ-style policy of a tenant
/// (`vhost`, default `/`), set at every start (stored durably, so removing
/// it from the file does not delete it: that is an explicit operation).
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PolicyConfig {
    /// The tenant (AMQP vhost).
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// Name, unique in its tenant.
    pub name: String,
    /// Regular expression over queue names.
    pub pattern: String,
    /// `queues`, `exchanges` or `all` (default).
    #[serde(default)]
    pub apply_to: weir_engine::policy::ApplyTo,
    /// Higher wins when several match.
    #[serde(default)]
    pub priority: i32,
    /// Keys as in RabbitMQ (`message-ttl`, `max-length`, `dead-letter-exchange`, …).
    pub definition: serde_json::Map<String, serde_json::Value>,
}

fn default_vhost() -> String {
    weir_engine::DEFAULT_TENANT.to_string()
}

impl PolicyConfig {
    /// The engine's definition.
    pub fn to_def(&self) -> weir_engine::policy::PolicyDef {
        weir_engine::policy::PolicyDef {
            name: self.name.clone(),
            pattern: self.pattern.clone(),
            apply_to: self.apply_to,
            priority: self.priority,
            definition: self.definition.clone(),
        }
    }
}

/// One `[[shovels]]` entry (issue 27): a shovel defined as RabbitMQ's
/// dynamic shovels are (`value` holds the same keys as the parameter's
/// value: `src-uri`, `src-queue`, `dest-uri`, …), acting as `user` on this
/// broker. Started at every start; not written to the data directory.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ShovelConfig {
    /// The vhost it belongs to (default `/`).
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// Its name, unique in its vhost.
    pub name: String,
    /// The user its local ends act as (default `guest`).
    #[serde(default = "default_shovel_user")]
    pub user: String,
    /// The definition, RabbitMQ's keys.
    pub value: serde_json::Map<String, serde_json::Value>,
}

fn default_shovel_user() -> String {
    DEFAULT_USER.to_string()
}

/// The name of the default user.
pub const DEFAULT_USER: &str = "guest";

impl AuthConfig {
    /// The users for [`weir_engine::auth::Authenticator`]: the configured
    /// ones, plus `guest` with [`Self::default_pass`] unless configured.
    /// `guest` is loopback-only unless [`Self::guest_remote`].
    pub fn user_specs(&self) -> Vec<UserSpec> {
        let mut specs: Vec<UserSpec> = self
            .users
            .iter()
            .map(|u| UserSpec {
                name: u.name.clone(),
                credential: match (&u.password_hash, &u.password) {
                    (Some(h), _) => Credential::Hash(h.clone()),
                    (None, Some(p)) => Credential::Plain(p.0.clone()),
                    // Refused by Config::load; an empty hash fails to parse.
                    (None, None) => Credential::Hash(String::new()),
                },
                tags: u.tags.clone(),
                loopback_only: false,
            })
            .collect();
        if !specs.iter().any(|s| s.name == DEFAULT_USER) {
            specs.push(UserSpec {
                name: DEFAULT_USER.into(),
                credential: Credential::Plain(self.default_pass.0.clone()),
                tags: vec!["administrator".into()],
                loopback_only: false,
            });
        }
        for s in &mut specs {
            s.loopback_only = s.name == DEFAULT_USER && !self.guest_remote;
        }
        specs
    }

    /// The permissions and topic permissions of every user of
    /// [`Self::user_specs`], and the users that got the compatibility
    /// default (every permission on `/`: no `permissions` key, or the
    /// default `guest`).
    pub fn permission_defs(
        &self,
    ) -> (
        Vec<weir_engine::permissions::PermissionDef>,
        Vec<weir_engine::permissions::TopicPermissionDef>,
        Vec<String>,
    ) {
        use weir_engine::permissions::{PermissionDef, TopicPermissionDef};
        let mut perms = Vec::new();
        let mut topics = Vec::new();
        let mut defaulted = Vec::new();
        let full = |user: &str| PermissionDef {
            from_config: true,
            ..PermissionDef::full(user, weir_engine::DEFAULT_TENANT)
        };
        for u in &self.users {
            match &u.permissions {
                None => {
                    defaulted.push(u.name.clone());
                    perms.push(full(&u.name));
                }
                Some(list) => perms.extend(list.iter().map(|p| PermissionDef {
                    user: u.name.clone(),
                    vhost: p.vhost.clone(),
                    configure: p.configure.clone(),
                    write: p.write.clone(),
                    read: p.read.clone(),
                    from_config: true,
                })),
            }
            topics.extend(u.topic_permissions.iter().map(|t| TopicPermissionDef {
                user: u.name.clone(),
                vhost: t.vhost.clone(),
                exchange: t.exchange.clone(),
                write: t.write.clone(),
                read: t.read.clone(),
                from_config: true,
            }));
        }
        if !self.users.iter().any(|u| u.name == DEFAULT_USER) {
            perms.push(full(DEFAULT_USER));
        }
        (perms, topics, defaulted)
    }
}

// ---------------------------------------------------------------------------
// the effective configuration

/// The effective configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Log filter.
    pub log: String,
    /// `log_format`: text or JSON lines.
    pub log_format: crate::log_format::LogFormat,
    /// `[amqp]`.
    pub amqp: AmqpConfig,
    /// `[mqtt]`.
    pub mqtt: MqttConfig,
    /// `[http]`.
    pub http: HttpConfig,
    /// `[native]` (not served yet).
    pub native: ReservedListener,
    /// `[store]`.
    pub store: StoreConfig,
    /// `[quota]`, resolved to bytes.
    pub quota: Quota,
    /// `[auth]`.
    pub auth: AuthConfig,
    /// `[[policies]]`.
    pub policies: Vec<PolicyConfig>,
    /// `[[tenants]]`.
    pub tenants: Vec<TenantConfig>,
    /// `[[shovels]]`.
    pub shovels: Vec<ShovelConfig>,
    /// `[[quota.users]]`.
    pub quota_users: Vec<UserQuotaConfig>,
    /// `[[quota.connections]]`.
    pub quota_connections: Vec<ConnectionQuotaConfig>,
    /// `[tls]`, if configured (then `amqp.tls_listen` and `mqtt.tls_listen`
    /// are set, to their defaults if not given).
    pub tls: Option<TlsConfig>,
    /// Quarantine damaged log ranges before opening the store (`--repair`).
    pub repair: bool,
    /// Deprecations and other remarks, logged once logging is set up.
    pub warnings: Vec<String>,
}

/// Configuration errors, reported at startup.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading config file {path}: {source}")]
    Read {
        /// Path.
        path: PathBuf,
        /// Error.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("parsing config file {path}: {source}")]
    Parse {
        /// Path.
        path: PathBuf,
        /// Error (boxed: it is large, and errors are rare).
        source: Box<toml::de::Error>,
    },
    /// A key the file may not hold.
    #[error("config file {path}: {message}")]
    Key {
        /// Path.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A section does not fit its type.
    #[error("invalid [{section}] settings{from}: {source}")]
    Section {
        /// Section name.
        section: &'static str,
        /// Where its values came from (the file, flags, variables).
        from: String,
        /// Error (boxed: it is large, and errors are rare).
        source: Box<toml::de::Error>,
    },
    /// A flag or environment value could not be read.
    #[error("{source_name}: {message}")]
    Value {
        /// `--flag` or `WEIR_…`.
        source_name: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of range or not supported.
    #[error("invalid setting: {0}")]
    Invalid(String),
}

/// Where a value came from, for error messages.
struct Origin {
    path: &'static str,
    name: String,
}

impl Config {
    /// Loads the configuration: flags over the process environment over the
    /// file over defaults.
    pub fn load(cli: Cli) -> Result<Self, ConfigError> {
        Self::load_with_env(cli, |k| std::env::var(k).ok())
    }

    /// [`Self::load`] with `env` standing for the environment.
    pub fn load_with_env(
        cli: Cli,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let mut warnings = Vec::new();
        let file_path = cli.config.clone().unwrap_or_default();
        let mut table = match &cli.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                let mut t = text.parse::<Table>().map_err(|source| ConfigError::Parse {
                    path: path.clone(),
                    source: Box::new(source),
                })?;
                migrate_legacy(&mut t, &mut warnings).map_err(|message| ConfigError::Key {
                    path: path.clone(),
                    message,
                })?;
                if let Some(k) = t.keys().find(|k| !SECTIONS.contains(&k.as_str())) {
                    return Err(ConfigError::Key {
                        path: path.clone(),
                        message: format!(
                            "unknown key `{k}` (expected a section: {})",
                            SECTIONS.join(", ")
                        ),
                    });
                }
                t
            }
            None => Table::new(),
        };

        // Each setting: its flag if given, else its variable; either
        // replaces what the file says.
        let mut origins = Vec::new();
        for s in SETTINGS {
            let from_flag = cli
                .flags
                .iter()
                .find(|(f, _)| std::ptr::eq(*f, s))
                .map(|(_, v)| (format!("--{}", s.flag), v.clone()));
            let from_env = || {
                env(s.env)
                    .filter(|v| !v.is_empty())
                    .map(|v| (s.env.to_string(), v))
            };
            let Some((name, text)) = from_flag.or_else(from_env) else {
                continue;
            };
            let value = to_value(s.kind, &text).map_err(|message| ConfigError::Value {
                source_name: name.clone(),
                message,
            })?;
            set_path(&mut table, s.path, value).map_err(|message| ConfigError::Key {
                path: file_path.clone(),
                message,
            })?;
            origins.push(Origin { path: s.path, name });
        }

        let log = match table.remove("log") {
            None => "info".to_string(),
            Some(Value::String(s)) => s,
            Some(other) => {
                return Err(ConfigError::Invalid(format!(
                    "log must be a string, not {}",
                    other.type_str()
                )))
            }
        };
        let log_format = match table.remove("log_format") {
            None => crate::log_format::LogFormat::default(),
            Some(Value::String(s)) => s.parse().map_err(ConfigError::Invalid)?,
            Some(other) => {
                return Err(ConfigError::Invalid(format!(
                    "log_format must be a string, not {}",
                    other.type_str()
                )))
            }
        };
        let describe = |section: &'static str| {
            let mut from: Vec<String> = origins
                .iter()
                .filter(|o| o.path.split('.').next() == Some(section))
                .map(|o| o.name.clone())
                .collect();
            if cli.config.is_some() {
                from.push(file_path.display().to_string());
            }
            if from.is_empty() {
                String::new()
            } else {
                format!(" (from {})", from.join(", "))
            }
        };
        let mut section = |name: &'static str| {
            table
                .remove(name)
                .unwrap_or_else(|| Value::Table(Table::new()))
        };
        let amqp: AmqpConfig = typed("amqp", section("amqp"), &describe)?;
        let mqtt: MqttConfig = typed("mqtt", section("mqtt"), &describe)?;
        let http: HttpConfig = typed("http", section("http"), &describe)?;
        let native: ReservedListener = typed("native", section("native"), &describe)?;
        let store: StoreConfig = typed("store", section("store"), &describe)?;
        let quota: QuotaConfig = typed("quota", section("quota"), &describe)?;
        let auth: AuthConfig = typed("auth", section("auth"), &describe)?;
        let tls: Option<TlsConfig> = match table.remove("tls") {
            Some(v) => Some(typed("tls", v, &describe)?),
            None => None,
        };
        let policies: Vec<PolicyConfig> = typed(
            "policies",
            table
                .remove("policies")
                .unwrap_or_else(|| Value::Array(Vec::new())),
            &describe,
        )?;
        let tenants: Vec<TenantConfig> = typed(
            "tenants",
            table
                .remove("tenants")
                .unwrap_or_else(|| Value::Array(Vec::new())),
            &describe,
        )?;
        if let Some(t) = tenants.iter().find(|t| t.name.is_empty()) {
            return Err(ConfigError::Invalid(format!(
                "tenants: a tenant needs a name ({t:?})"
            )));
        }
        for t in &tenants {
            t.limits()?;
        }
        for u in &quota.users {
            u.limits()?;
        }
        for c in &quota.connections {
            c.rule()?;
        }
        for p in &policies {
            weir_engine::policy::Policy::new(p.to_def())
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        let shovels: Vec<ShovelConfig> = typed(
            "shovels",
            table
                .remove("shovels")
                .unwrap_or_else(|| Value::Array(Vec::new())),
            &describe,
        )?;
        for s in &shovels {
            crate::shovel::ShovelDef::parse(&serde_json::Value::Object(s.value.clone()), &s.vhost)
                .map_err(|e| ConfigError::Invalid(format!("shovels: '{}': {e}", s.name)))?;
        }
        debug_assert!(table.is_empty(), "unhandled sections: {table:?}");

        validate(&amqp, &store, &auth)?;
        let (mut amqp, mut mqtt) = (amqp, mqtt);
        validate_tls(tls.as_ref(), &mut amqp, &mut mqtt)?;
        if let Some(addr) = native.listen {
            warnings.push(format!(
                "native.listen = {addr} is reserved: the native adapter is not served yet, nothing listens there"
            ));
        }
        for u in &auth.users {
            if u.password.is_some() {
                warnings.push(format!(
                    "user {}: plain password in the configuration, hashed at startup; \
                     store `password_hash` from `weir hash-password` instead",
                    u.name
                ));
            }
        }
        let quota_users = quota.users.clone();
        let quota_connections = quota.connections.clone();
        let quota = resolve_quota(&quota, store.log.segment_bytes())?;
        Ok(Config {
            log,
            log_format,
            amqp,
            mqtt,
            http,
            native,
            store,
            quota,
            auth,
            policies,
            tenants,
            shovels,
            quota_users,
            quota_connections,
            tls,
            repair: cli.repair,
            warnings,
        })
    }
}

/// Deserializes one section, naming it (and where its values came from) on error.
fn typed<T: DeserializeOwned>(
    name: &'static str,
    value: Value,
    describe: &impl Fn(&'static str) -> String,
) -> Result<T, ConfigError> {
    T::deserialize(value).map_err(|source| ConfigError::Section {
        section: name,
        from: describe(name),
        source: Box::new(source),
    })
}

/// Range checks that types cannot express.
fn validate(amqp: &AmqpConfig, store: &StoreConfig, auth: &AuthConfig) -> Result<(), ConfigError> {
    if amqp.frame_max < 4096 {
        return Err(ConfigError::Invalid(format!(
            "amqp.frame_max {} is below the AMQP minimum 4096",
            amqp.frame_max
        )));
    }
    if amqp.channel_max == 0 {
        return Err(ConfigError::Invalid(
            "amqp.channel_max must be at least 1".into(),
        ));
    }
    if store.kind == StoreKind::Fdb && !cfg!(feature = "fdb") {
        return Err(ConfigError::Invalid(
            "store.kind = \"fdb\": this weir was not built with the fdb feature (cargo build --features fdb)".into(),
        ));
    }
    if store.kind == StoreKind::Fdb && store.fdb.node_id.is_empty() {
        return Err(ConfigError::Invalid(
            "store.kind = \"fdb\" needs store.fdb.node_id (--node-id, WEIR_NODE_ID): a name unique among the gateways".into(),
        ));
    }
    if store.log.segment_mb == 0 || store.log.segment_bytes() > u32::MAX as u64 {
        return Err(ConfigError::Invalid(
            "store.log.segment_mb must be between 1 and 4095".into(),
        ));
    }
    for u in &auth.users {
        match (&u.password_hash, &u.password) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::Invalid(format!(
                    "user {}: give password_hash or password, not both",
                    u.name
                )))
            }
            (None, None) => {
                return Err(ConfigError::Invalid(format!(
                    "user {}: password_hash (from `weir hash-password`) is missing",
                    u.name
                )))
            }
            _ => {}
        }
        let mut vhosts = std::collections::HashSet::new();
        for p in u.permissions.iter().flatten() {
            if !vhosts.insert(p.vhost.as_str()) {
                return Err(ConfigError::Invalid(format!(
                    "user {}: permissions for vhost '{}' are given twice",
                    u.name, p.vhost
                )));
            }
        }
    }
    let (perms, topics, _) = auth.permission_defs();
    for p in &perms {
        p.validate()
            .map_err(|e| ConfigError::Invalid(format!("user {}: {e}", p.user)))?;
    }
    for t in &topics {
        t.validate().map_err(|e| {
            ConfigError::Invalid(format!("user {}: topic_permissions: {e}", t.user))
        })?;
    }
    Ok(())
}

/// `[tls]` needs its two files; the TLS listen addresses need `[tls]` and
/// get their defaults with it.
fn validate_tls(
    tls: Option<&TlsConfig>,
    amqp: &mut AmqpConfig,
    mqtt: &mut MqttConfig,
) -> Result<(), ConfigError> {
    let Some(tls) = tls else {
        for (key, set) in [
            ("amqp.tls_listen", amqp.tls_listen.is_some()),
            ("mqtt.tls_listen", mqtt.tls_listen.is_some()),
            ("mqtt.wss_listen", mqtt.wss_listen.is_some()),
            ("mqtt.ssl_cert_login", mqtt.ssl_cert_login),
        ] {
            if set {
                return Err(ConfigError::Invalid(format!(
                    "{key} needs [tls] (tls.cert_file and tls.key_file)"
                )));
            }
        }
        return Ok(());
    };
    for (key, path) in [
        ("tls.cert_file", &tls.cert_file),
        ("tls.key_file", &tls.key_file),
    ] {
        if path.as_os_str().is_empty() {
            return Err(ConfigError::Invalid(format!("[tls] needs {key}")));
        }
    }
    if tls.fail_if_no_peer_cert && tls.ca_file.is_none() {
        return Err(ConfigError::Invalid(
            "tls.fail_if_no_peer_cert needs tls.ca_file (the CA that signs client certificates)"
                .into(),
        ));
    }
    amqp.tls_listen.get_or_insert(AMQPS_DEFAULT_LISTEN);
    mqtt.tls_listen.get_or_insert(MQTTS_DEFAULT_LISTEN);
    mqtt.wss_listen.get_or_insert(MQTT_WSS_DEFAULT_LISTEN);
    Ok(())
}

/// Moves the flat keys of older files to their sections, with a warning each.
fn migrate_legacy(t: &mut Table, warnings: &mut Vec<String>) -> Result<(), String> {
    let moves = SETTINGS
        .iter()
        .filter_map(|s| s.legacy.map(|old| (old, s.path)))
        .chain(LEGACY_TABLES.iter().copied());
    for (old, new) in moves {
        debug_assert_ne!(old, new, "a legacy key must differ from its new path");
        let Some(v) = t.remove(old) else { continue };
        if get_path(t, new).is_some() {
            return Err(format!(
                "both `{old}` (deprecated) and `{new}` are set; keep `{new}`"
            ));
        }
        set_path(t, new, v)?;
        let (section, key) = new.rsplit_once('.').unwrap_or(("", new));
        warnings.push(format!(
            "config key `{old}` is deprecated: write `{key}` in [{section}] instead"
        ));
    }
    Ok(())
}

/// The value at a dotted path, if any.
fn get_path<'a>(t: &'a Table, path: &str) -> Option<&'a Value> {
    let mut parts = path.split('.');
    let mut v = t.get(parts.next()?)?;
    for p in parts {
        v = v.as_table()?.get(p)?;
    }
    Some(v)
}

/// Sets a dotted path, creating the tables on the way.
fn set_path(t: &mut Table, path: &str, value: Value) -> Result<(), String> {
    let (parents, key) = match path.rsplit_once('.') {
        Some((p, k)) => (Some(p), k),
        None => (None, path),
    };
    let mut cur = t;
    for p in parents.into_iter().flat_map(|p| p.split('.')) {
        let entry = cur
            .entry(p.to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        cur = match entry {
            Value::Table(inner) => inner,
            other => {
                return Err(format!(
                    "`{p}` must be a section (a table), not a {}",
                    other.type_str()
                ))
            }
        };
    }
    cur.insert(key.to_string(), value);
    Ok(())
}

/// A flag or environment value as a TOML value of its kind.
fn to_value(kind: Kind, text: &str) -> Result<Value, String> {
    let t = text.trim();
    match kind {
        Kind::Str => Ok(Value::String(text.to_string())),
        Kind::Uint => t
            .parse::<u64>()
            .ok()
            .and_then(|n| i64::try_from(n).ok())
            .map(Value::Integer)
            .ok_or_else(|| format!("expected a non-negative integer, got '{text}'")),
        Kind::Bool => match t.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(Value::Boolean(true)),
            "false" | "0" | "no" | "off" => Ok(Value::Boolean(false)),
            _ => Err(format!("expected true or false, got '{text}'")),
        },
    }
}

// --- flow control and resource limits ---

/// Share of physical RAM used as the memory watermark by default (RabbitMQ's
/// `vm_memory_high_watermark`).
const DEFAULT_MEMORY_FRACTION: f64 = 0.4;

/// The watermarks in bytes.
fn resolve_quota(q: &QuotaConfig, segment_bytes: u64) -> Result<Quota, ConfigError> {
    let ram = physical_memory();
    let memory_limit = match &q.memory_limit {
        None => (ram as f64 * DEFAULT_MEMORY_FRACTION) as u64,
        Some(SizeSetting::Bytes(n)) => parse_memory_limit(&n.to_string(), ram)?,
        Some(SizeSetting::Fraction(f)) => parse_memory_limit(&format!("{f:?}"), ram)?,
        Some(SizeSetting::Text(s)) => parse_memory_limit(s, ram)?,
    };
    let disk_free_limit = match &q.disk_free_limit {
        // Room for the segments a writer is about to fill, at least 1 GB.
        None => (1u64 << 30).max(2 * segment_bytes),
        Some(SizeSetting::Bytes(n)) => *n,
        Some(SizeSetting::Fraction(f)) => {
            return Err(ConfigError::Invalid(format!(
                "quota.disk_free_limit: {f} is not a size in bytes"
            )))
        }
        Some(SizeSetting::Text(v)) => parse_bytes(v).ok_or_else(|| {
            ConfigError::Invalid(format!(
                "quota.disk_free_limit: cannot parse '{v}' as bytes"
            ))
        })?,
    };
    Ok(Quota {
        memory_limit,
        disk_free_limit,
    })
}

/// Physical RAM in bytes (`sysconf`), or 4 GiB if it cannot be read.
fn physical_memory() -> u64 {
    // SAFETY: sysconf has no preconditions; it returns -1 on error.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages > 0 && page > 0 {
        pages as u64 * page as u64
    } else {
        4 << 30
    }
}

/// A memory limit: a fraction of RAM (`0.4`, below 1) or bytes (`512MB`).
fn parse_memory_limit(v: &str, ram: u64) -> Result<u64, ConfigError> {
    let v = v.trim();
    if let Ok(f) = v.parse::<f64>() {
        if v.contains('.') {
            if !(f > 0.0 && f < 1.0) {
                return Err(ConfigError::Invalid(format!(
                    "quota.memory_limit fraction {v} must be between 0 and 1"
                )));
            }
            return Ok((ram as f64 * f) as u64);
        }
    }
    match parse_bytes(v) {
        Some(0) | None => Err(ConfigError::Invalid(format!(
            "quota.memory_limit: cannot parse '{v}' as bytes or a fraction of RAM"
        ))),
        Some(n) => Ok(n),
    }
}

/// Bytes with an optional unit: `1048576`, `64kB`, `512MB`, `1GiB`, `2TB`,
/// `1PB`. Decimal and binary units are both taken as powers of 1024, as
/// RabbitMQ does for `MB`/`GB`.
pub fn parse_bytes(v: &str) -> Option<u64> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: u64 = num.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn byte_sizes_and_fractions() {
        assert_eq!(parse_bytes("512MB"), Some(512 << 20));
        assert_eq!(parse_bytes("1GiB"), Some(1 << 30));
        assert_eq!(parse_bytes("1PB"), Some(1 << 50));
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("12 xb"), None);
        assert_eq!(parse_memory_limit("0.5", 1000).ok(), Some(500));
        assert_eq!(parse_memory_limit("64MB", 1000).ok(), Some(64 << 20));
        assert!(parse_memory_limit("1.5", 1000).is_err());
        assert!(parse_memory_limit("0", 1000).is_err());
    }

    /// A config file in a fresh temporary directory.
    fn file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "weir-config-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("weir.toml");
        std::fs::write(&path, text).expect("write config");
        path
    }

    fn load(args: &[&str], env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let cli = Cli::try_parse_from(std::iter::once("weir").chain(args.iter().copied()))
            .expect("valid command line");
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::load_with_env(cli, |k| env.get(k).cloned())
    }

    #[test]
    fn defaults_without_anything() {
        let cfg = load(&[], &[]).expect("defaults are valid");
        assert_eq!(cfg.amqp, AmqpConfig::default());
        assert_eq!(cfg.amqp.listen.port(), 5672);
        assert_eq!(cfg.store.kind, StoreKind::Log);
        assert_eq!(cfg.store.log.data_dir, PathBuf::from("./weir-data"));
        assert!(cfg.store.log.fsync);
        assert_eq!(cfg.log, "info");
        assert_eq!(cfg.quota.disk_free_limit, 1 << 30);
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
        let specs = cfg.auth.user_specs();
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].name, "guest");
        assert!(specs[0].loopback_only);
    }

    #[test]
    fn flags_over_env_over_file_over_defaults() {
        let path = file(
            "layers",
            "log = \"debug\"\n\
             [amqp]\nheartbeat = 5\nframe_max = 8192\nconsumer_timeout = 9\n\
             [store.log]\ndata_dir = \"/from/file\"\nsegment_mb = 2\n\
             [quota]\nmemory_limit = \"512MB\"\ndisk_free_limit = 1024\n",
        );
        let p = path.to_str().expect("utf-8 path");
        let cfg = load(
            &["--config", p, "--heartbeat", "7"],
            &[
                ("WEIR_HEARTBEAT", "6"),
                ("WEIR_FRAME_MAX", "16384"),
                ("WEIR_FSYNC", "false"),
            ],
        )
        .expect("valid config");
        assert_eq!(cfg.amqp.heartbeat, 7, "flag over env and file");
        assert_eq!(cfg.amqp.frame_max, 16384, "env over file");
        assert_eq!(cfg.amqp.consumer_timeout, 9, "file over default");
        assert_eq!(cfg.amqp.partial_content_timeout, 30, "default");
        assert!(!cfg.store.log.fsync, "env over default");
        assert_eq!(cfg.store.log.data_dir, PathBuf::from("/from/file"));
        assert_eq!(cfg.store.log.segment_bytes(), 2 << 20);
        assert_eq!(cfg.quota.memory_limit, 512 << 20);
        assert_eq!(cfg.quota.disk_free_limit, 1024);
        assert_eq!(cfg.log, "debug");
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
    }

    #[test]
    fn every_setting_has_a_flag_and_variable_that_reach_its_path() {
        let mut seen_flags = std::collections::HashSet::new();
        for s in SETTINGS {
            assert!(seen_flags.insert(s.flag), "flag --{} twice", s.flag);
            assert!(s.env.starts_with("WEIR_"), "{}", s.env);
            assert!(SECTIONS.contains(&s.path.split('.').next().unwrap_or("")));
        }
        // The names scripts and tests use keep working.
        for (flag, env, path) in [
            ("data-dir", "WEIR_DATA_DIR", "store.log.data_dir"),
            ("amqp-listen", "WEIR_AMQP_LISTEN", "amqp.listen"),
            ("segment-mb", "WEIR_SEGMENT_MB", "store.log.segment_mb"),
            ("default-pass", "WEIR_DEFAULT_PASS", "auth.default_pass"),
            ("guest-remote", "WEIR_GUEST_REMOTE", "auth.guest_remote"),
            ("memory-limit", "WEIR_MEMORY_LIMIT", "quota.memory_limit"),
            (
                "disk-free-limit",
                "WEIR_DISK_FREE_LIMIT",
                "quota.disk_free_limit",
            ),
            (
                "consumer-timeout",
                "WEIR_CONSUMER_TIMEOUT",
                "amqp.consumer_timeout",
            ),
        ] {
            let s = SETTINGS
                .iter()
                .find(|s| s.flag == flag)
                .unwrap_or_else(|| panic!("--{flag} is gone"));
            assert_eq!((s.env, s.path), (env, path));
        }
        let cfg = load(
            &["--amqp-listen", "127.0.0.1:1", "--guest-remote", "true"],
            &[
                ("WEIR_DATA_DIR", "/d"),
                ("WEIR_DEFAULT_PASS", "pw"),
                ("WEIR_MQTT_LISTEN", "127.0.0.1:1883"),
                ("WEIR_HTTP_LISTEN", "127.0.0.1:15673"),
                ("WEIR_NATIVE_LISTEN", "127.0.0.1:5555"),
                ("WEIR_PARTIAL_CONTENT_TIMEOUT", "0"),
                ("WEIR_DISK_FREE_LIMIT", "50MB"),
            ],
        )
        .expect("valid");
        assert_eq!(cfg.amqp.listen, "127.0.0.1:1".parse().expect("addr"));
        assert!(cfg.auth.guest_remote);
        assert_eq!(cfg.auth.default_pass.0, "pw");
        assert_eq!(cfg.store.log.data_dir, PathBuf::from("/d"));
        assert_eq!(cfg.amqp.partial_content_timeout, 0);
        assert_eq!(cfg.quota.disk_free_limit, 50 << 20);
        assert_eq!(cfg.mqtt.listen, "127.0.0.1:1883".parse().expect("addr"));
        assert_eq!(cfg.http.listen, "127.0.0.1:15673".parse().expect("addr"));
        assert!(cfg.warnings.iter().any(|w| w.contains("not served yet")));
        assert!(!cfg.auth.user_specs()[0].loopback_only);
    }

    #[test]
    fn flat_keys_of_older_files_move_with_a_warning() {
        let path = file(
            "legacy",
            "data_dir = \"/old\"\nheartbeat = 5\namqp_listen = \"127.0.0.1:5673\"\n\
             default_pass = \"s3cret\"\nmemory_limit = 0.5\n\
             [[users]]\nname = \"a\"\npassword = \"b\"\n",
        );
        let cfg = load(&["--config", path.to_str().expect("utf-8")], &[]).expect("accepted");
        assert_eq!(cfg.store.log.data_dir, PathBuf::from("/old"));
        assert_eq!(cfg.amqp.heartbeat, 5);
        assert_eq!(cfg.amqp.listen.port(), 5673);
        assert_eq!(cfg.auth.default_pass.0, "s3cret");
        assert_eq!(cfg.auth.users.len(), 1);
        for key in [
            "data_dir",
            "heartbeat",
            "amqp_listen",
            "default_pass",
            "users",
        ] {
            assert!(
                cfg.warnings
                    .iter()
                    .any(|w| w.contains(&format!("`{key}` is deprecated"))),
                "no deprecation warning for {key}: {:?}",
                cfg.warnings
            );
        }
        assert!(cfg.warnings.iter().any(|w| w.contains("plain password")));
        // A flag still wins over a legacy key.
        let cfg = load(
            &[
                "--config",
                path.to_str().expect("utf-8"),
                "--heartbeat",
                "9",
            ],
            &[],
        )
        .expect("accepted");
        assert_eq!(cfg.amqp.heartbeat, 9);
    }

    #[test]
    fn old_and_new_key_together_are_refused() {
        let path = file("both", "heartbeat = 5\n[amqp]\nheartbeat = 6\n");
        let err = load(&["--config", path.to_str().expect("utf-8")], &[]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("`heartbeat`") && msg.contains("amqp.heartbeat"),
            "{msg}"
        );
    }

    #[test]
    fn unknown_keys_are_rejected_and_named() {
        let path = file("unknown-top", "data_dirr = \"x\"\n");
        let msg = load(&["--config", path.to_str().expect("utf-8")], &[])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("data_dirr") && msg.contains("weir.toml"),
            "{msg}"
        );
        let path = file("unknown-section", "[amqp]\nheartbeat_secs = 5\n");
        let msg = load(&["--config", path.to_str().expect("utf-8")], &[])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("heartbeat_secs") && msg.contains("[amqp]"),
            "{msg}"
        );
    }

    #[test]
    fn policies_are_read_and_checked() {
        let path = file(
            "policies",
            "[[policies]]\nname = \"ttl\"\npattern = \"^jobs\\\\.\"\napply-to = \"queues\"\n\
             priority = 2\ndefinition = { message-ttl = 1000, dead-letter-exchange = \"dlx\" }\n",
        );
        let cfg = load(&["--config", path.to_str().expect("utf-8")], &[]).expect("valid");
        assert_eq!(cfg.policies.len(), 1);
        let p = &cfg.policies[0];
        assert_eq!((p.vhost.as_str(), p.priority), ("/", 2));
        assert_eq!(
            p.definition.get("message-ttl"),
            Some(&serde_json::json!(1000))
        );
        let path = file(
            "policies-bad",
            "[[policies]]\nname = \"p\"\npattern = \".*\"\ndefinition = { max-priority = 5 }\n",
        );
        let msg = load(&["--config", path.to_str().expect("utf-8")], &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("max-priority"), "{msg}");
    }

    #[test]
    fn tenant_and_user_limits_are_read_with_units_and_checked() {
        let path = file(
            "tenant-limits",
            "[[tenants]]\nname = \"a\"\nmax-queues = 3\nmax-queued-bytes = \"64MB\"\n\
             max-message-size = 1024\npublish-rate = 500\nmax-memory = \"1MB\"\n\n\
             [[quota.users]]\nname = \"u\"\nmax-connections = 2\npublish-bytes-rate = \"1MB\"\n\n\
             [[quota.connections]]\nname = \"s-.*\"\npublish-bytes-rate = \"2kB\"\n",
        );
        let cfg = load(&["--config", path.to_str().expect("utf-8")], &[]).expect("valid");
        let l = cfg.tenants[0].limits().expect("limits");
        assert_eq!(l.max_memory, Some(1 << 20));
        let rule = cfg.quota_connections[0].rule().expect("rule");
        assert_eq!(rule.publish_bytes_rate, Some(2048));
        assert!(rule.matches("anyone", Some("s-1")));
        assert_eq!(l.max_queues, Some(3));
        assert_eq!(l.max_queued_bytes, Some(64 << 20));
        assert_eq!(l.max_message_size, Some(1024));
        assert_eq!(l.publish_rate, Some(500));
        assert_eq!(l.max_connections, None);
        let u = cfg.quota_users[0].limits().expect("limits");
        assert_eq!(
            (u.max_connections, u.publish_bytes_rate),
            (Some(2), Some(1 << 20))
        );
        for (name, text, needle) in [
            (
                "tenant-typo",
                "[[tenants]]\nname = \"a\"\nmax-queue = 3\n",
                "max-queue",
            ),
            (
                "tenant-unit",
                "[[tenants]]\nname = \"a\"\nmax-queued-bytes = \"9 parsecs\"\n",
                "max-queued-bytes",
            ),
            // Queued limits are per tenant, not per user.
            (
                "user-queued",
                "[[quota.users]]\nname = \"u\"\nmax-queued-bytes = 5\n",
                "max-queued-bytes",
            ),
            (
                "connection-pattern",
                "[[quota.connections]]\nname = \"(sensor\"\npublish-rate = 1\n",
                "invalid pattern '(sensor'",
            ),
            (
                "connection-memory",
                "[[quota.connections]]\nname = \"x\"\nmax-memory = 5\n",
                "max-memory",
            ),
        ] {
            let path = file(name, text);
            let msg = load(&["--config", path.to_str().expect("utf-8")], &[])
                .unwrap_err()
                .to_string();
            assert!(msg.contains(needle), "{name}: {msg}");
        }
    }

    #[test]
    fn bad_values_name_their_source() {
        let msg = load(&[], &[("WEIR_HEARTBEAT", "soon")])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("WEIR_HEARTBEAT"), "{msg}");
        let msg = load(&["--fsync", "maybe"], &[]).unwrap_err().to_string();
        assert!(msg.contains("--fsync"), "{msg}");
        let msg = load(&["--heartbeat", "70000"], &[])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("[amqp]") && msg.contains("--heartbeat"),
            "{msg}"
        );
        let msg = load(&[], &[("WEIR_AMQP_LISTEN", "nowhere")])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("WEIR_AMQP_LISTEN"), "{msg}");
        assert!(load(&["--frame-max", "100"], &[]).is_err());
        assert!(load(&["--segment-mb", "0"], &[]).is_err());
    }

    #[test]
    fn fdb_store_is_refused_clearly() {
        let msg = load(&["--store", "fdb"], &[]).unwrap_err().to_string();
        if cfg!(feature = "fdb") {
            // Built with the store: a node name is still required.
            assert!(msg.contains("node_id"), "{msg}");
            let cfg = load(&["--store", "fdb", "--node-id", "gw-1"], &[]).expect("fdb config");
            assert_eq!(cfg.store.fdb.node_id, "gw-1");
            assert_eq!(cfg.store.fdb.namespace, "default");
        } else {
            assert!(msg.contains("fdb feature"), "{msg}");
        }
        let path = file("store-kind", "[store]\nkind = \"tape\"\n");
        assert!(load(&["--config", path.to_str().expect("utf-8")], &[]).is_err());
    }

    #[test]
    fn users_need_exactly_one_credential_and_guest_can_be_redefined() {
        let path = file("users-none", "[[auth.users]]\nname = \"a\"\n");
        let msg = load(&["--config", path.to_str().expect("utf-8")], &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("password_hash"), "{msg}");
        let path = file(
            "users-guest",
            "[auth]\nguest_remote = false\n\
             [[auth.users]]\nname = \"guest\"\npassword_hash = \"$argon2id$x\"\ntags = [\"monitoring\"]\n",
        );
        let cfg = load(&["--config", path.to_str().expect("utf-8")], &[]).expect("valid");
        let specs = cfg.auth.user_specs();
        assert_eq!(specs.len(), 1, "the configured guest replaces the default");
        assert_eq!(specs[0].tags, vec!["monitoring".to_string()]);
        assert!(specs[0].loopback_only);
        assert!(matches!(specs[0].credential, Credential::Hash(_)));
    }

    #[test]
    fn permissions_default_to_full_access_on_the_default_vhost_only_when_absent() {
        let path = file(
            "users-perms",
            "[[auth.users]]\nname = \"old\"\npassword = \"x\"\n\
             [[auth.users]]\nname = \"none\"\npassword = \"x\"\npermissions = []\n\
             [[auth.users]]\nname = \"app\"\npassword = \"x\"\n\
             permissions = [{ vhost = \"a\", configure = \"\", write = \"^in$\", read = \"^out$\" }]\n\
             topic_permissions = [{ vhost = \"a\", write = \"^{username}\\\\.\", read = \".*\" }]\n",
        );
        let cfg = load(&["--config", path.to_str().expect("utf-8")], &[]).expect("valid");
        let (perms, topics, defaulted) = cfg.auth.permission_defs();
        assert_eq!(defaulted, vec!["old".to_string()]);
        let of = |u: &str| perms.iter().filter(|p| p.user == u).collect::<Vec<_>>();
        assert_eq!(of("old").len(), 1);
        assert_eq!(
            (of("old")[0].vhost.as_str(), of("old")[0].read.as_str()),
            ("/", ".*")
        );
        assert!(
            of("none").is_empty(),
            "an explicit empty list grants nothing"
        );
        assert_eq!(of("app")[0].vhost, "a");
        assert_eq!(of("guest")[0].vhost, "/", "the default guest keeps `/`");
        assert!(perms.iter().all(|p| p.from_config));
        assert_eq!(topics.len(), 1);
        assert_eq!(topics[0].exchange, "amq.topic");
        assert_eq!(topics[0].write, "^{username}\\.");

        let path = file(
            "users-bad-perms",
            "[[auth.users]]\nname = \"app\"\npassword = \"x\"\n\
             permissions = [{ vhost = \"a\", configure = \"(\", write = \"\", read = \"\" }]\n",
        );
        let msg = load(&["--config", path.to_str().expect("utf-8")], &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("configure pattern"), "{msg}");
    }

    #[test]
    fn tls_listeners_only_with_a_tls_section() {
        let cfg = load(&[], &[]).expect("defaults");
        assert_eq!(cfg.tls, None);
        assert_eq!((cfg.amqp.tls_listen, cfg.mqtt.tls_listen), (None, None));
        let msg = load(&["--amqps-listen", "127.0.0.1:5671"], &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("amqp.tls_listen needs [tls]"), "{msg}");

        let cfg = load(
            &["--tls-cert-file", "/c.pem", "--tls-key-file", "/k.pem"],
            &[("WEIR_MQTTS_LISTEN", "127.0.0.1:9883")],
        )
        .expect("TLS from flags and environment");
        let tls = cfg.tls.expect("[tls]");
        assert_eq!(tls.cert_file, PathBuf::from("/c.pem"));
        assert_eq!(tls.reload_interval, 5);
        assert_eq!(cfg.amqp.tls_listen, Some(AMQPS_DEFAULT_LISTEN));
        assert_eq!(cfg.mqtt.tls_listen, Some("127.0.0.1:9883".parse().unwrap()));
        assert_eq!(cfg.mqtt.wss_listen, Some(MQTT_WSS_DEFAULT_LISTEN));

        let path = file("tls-no-key", "[tls]\ncert_file = \"/c.pem\"\n");
        let msg = load(&["--config", path.to_str().expect("utf-8")], &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("tls.key_file"), "{msg}");
        let path = file(
            "tls-peer-cert",
            "[tls]\ncert_file = \"/c.pem\"\nkey_file = \"/k.pem\"\nfail_if_no_peer_cert = true\n",
        );
        let msg = load(&["--config", path.to_str().expect("utf-8")], &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("needs tls.ca_file"), "{msg}");
    }

    #[test]
    fn the_example_file_loads_without_warnings() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/weir.toml");
        let cfg = load(&["--config", path], &[]).expect("deploy/weir.toml is valid");
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
        assert_eq!(cfg.store.log.data_dir, PathBuf::from("/var/lib/weir"));
        assert_eq!(cfg.auth.users.len(), 1);
        let auth = weir_engine::auth::Authenticator::new(cfg.auth.user_specs())
            .expect("the example's users are valid");
        let local = std::net::IpAddr::from([127, 0, 0, 1]);
        assert!(auth.authenticate("app", b"change-me", local).is_ok());
        assert!(auth.authenticate("guest", b"guest", local).is_ok());
    }

    #[test]
    fn secrets_do_not_print() {
        let cfg = load(&["--default-pass", "hunter2"], &[]).expect("valid");
        assert!(!format!("{cfg:?}").contains("hunter2"));
    }

    #[test]
    fn help_lists_the_flags_with_their_variables() {
        let help = Cli::command().render_long_help().to_string();
        for s in SETTINGS {
            assert!(
                help.contains(&format!("--{}", s.flag)),
                "--{} missing",
                s.flag
            );
            assert!(help.contains(s.env), "{} missing", s.env);
        }
        assert!(Cli::try_parse_from(["weir", "hash-password"]).is_ok());
        assert!(Cli::try_parse_from(["weir", "repair", "--data-dir", "/x"]).is_ok());
    }

    #[test]
    fn mqtt_connections_and_connect_size_are_bounded_by_default() {
        let cfg = load(&[], &[]).expect("defaults");
        assert_eq!(cfg.mqtt.max_connections, DEFAULT_MQTT_MAX_CONNECTIONS);
        assert!(cfg.mqtt.max_connections > 0, "a limit, not 0 = none");
        assert_eq!(cfg.mqtt.max_connect_size, 8 * 1024);
        let path = file(
            "mqtt-door",
            "[mqtt]\nmax_connections = 0\nmax_connect_size = 65536\n",
        );
        let cfg = load(&["--config", path.to_str().expect("utf-8")], &[]).expect("accepted");
        assert_eq!(
            (cfg.mqtt.max_connections, cfg.mqtt.max_connect_size),
            (0, 65536)
        );
    }
}
