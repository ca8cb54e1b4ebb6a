//! Configuration: every setting can come from a flag, an environment variable
//! (`WEIR_…`) or a TOML file (`--config`, `WEIR_CONFIG`), in that order of
//! precedence, falling back to a default.

use clap::Parser;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Command line (each flag also reads its environment variable).
#[derive(Parser, Debug, Default)]
#[command(
    name = "weir",
    version,
    about = "Weir: a multi-protocol message broker (AMQP 0-9-1 today)"
)]
pub struct Cli {
    /// TOML configuration file.
    #[arg(long, env = "WEIR_CONFIG")]
    pub config: Option<PathBuf>,
    /// Directory of the embedded store [default: ./weir-data].
    #[arg(long, env = "WEIR_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// AMQP 0-9-1 listen address [default: 0.0.0.0:5672].
    #[arg(long, env = "WEIR_AMQP_LISTEN")]
    pub amqp_listen: Option<SocketAddr>,
    /// Log filter, tracing's EnvFilter syntax [default: info].
    #[arg(long, env = "WEIR_LOG")]
    pub log: Option<String>,
    /// Fsync the store before confirming [default: true]. Turning it off
    /// loses confirmed messages on power failure; only for experiments.
    #[arg(long, env = "WEIR_FSYNC")]
    pub fsync: Option<bool>,
    /// Segment size of the embedded log in MiB [default: 64].
    #[arg(long, env = "WEIR_SEGMENT_MB")]
    pub segment_mb: Option<u64>,
    /// Heartbeat interval offered to AMQP clients, seconds [default: 60].
    #[arg(long, env = "WEIR_HEARTBEAT")]
    pub heartbeat: Option<u16>,
    /// Largest AMQP frame accepted, bytes [default: 131072].
    #[arg(long, env = "WEIR_FRAME_MAX")]
    pub frame_max: Option<u32>,
    /// Password of the default user `guest` [default: guest].
    #[arg(long, env = "WEIR_DEFAULT_PASS")]
    pub default_pass: Option<String>,
    /// Allow the default user from non-loopback addresses [default: false].
    #[arg(long, env = "WEIR_GUEST_REMOTE")]
    pub guest_remote: Option<bool>,
    /// Seconds a delivery may stay unacknowledged before its channel is
    /// closed (406) and its messages return to the queue; 0 = never
    /// [default: 1800, as RabbitMQ's consumer_timeout].
    #[arg(long, env = "WEIR_CONSUMER_TIMEOUT")]
    pub consumer_timeout: Option<u64>,
    // --- flow control and resource limits (memory, disk, partial content, logins) ---
    /// Memory watermark: publishers are blocked while the broker's resident
    /// memory is above it. Bytes with an optional suffix (`512MB`, `1GiB`),
    /// or a fraction of physical RAM (`0.4`) [default: 0.4, as RabbitMQ].
    #[arg(long, env = "WEIR_MEMORY_LIMIT")]
    pub memory_limit: Option<String>,
    /// Free-disk watermark on the data directory's filesystem: publishers are
    /// blocked while less is free. Bytes with an optional suffix
    /// [default: 1GB or two segments, whichever is larger].
    #[arg(long, env = "WEIR_DISK_FREE_LIMIT")]
    pub disk_free_limit: Option<String>,
    /// Seconds a connection may hold a partly received message without
    /// progress before it is closed (0 = never) [default: 30].
    #[arg(long, env = "WEIR_PARTIAL_CONTENT_TIMEOUT")]
    pub partial_content_timeout: Option<u64>,
    // --- data safety ---
    /// Before opening the store, move damaged log ranges into
    /// `<data-dir>/quarantine/` and keep every valid record (as `weir
    /// repair`), reporting exactly what was lost. Without it, damage that is
    /// not a torn tail refuses to start.
    #[arg(long)]
    pub repair: bool,
    /// A subcommand instead of running the broker.
    #[command(subcommand)]
    pub command: Option<Command>,
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
}

/// The TOML file: the same settings, all optional.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    data_dir: Option<PathBuf>,
    amqp_listen: Option<SocketAddr>,
    log: Option<String>,
    fsync: Option<bool>,
    segment_mb: Option<u64>,
    heartbeat: Option<u16>,
    frame_max: Option<u32>,
    default_pass: Option<String>,
    guest_remote: Option<bool>,
    consumer_timeout: Option<u64>,
    // --- flow control and resource limits ---
    memory_limit: Option<String>,
    disk_free_limit: Option<String>,
    partial_content_timeout: Option<u64>,
    #[serde(default)]
    users: Vec<UserConfig>,
}

/// An additional user from the configuration file.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// Name.
    pub name: String,
    /// Password.
    pub password: String,
}

/// The effective configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Store directory.
    pub data_dir: PathBuf,
    /// AMQP listen address.
    pub amqp_listen: SocketAddr,
    /// Log filter.
    pub log: String,
    /// Fsync before confirm.
    pub fsync: bool,
    /// Segment size in bytes.
    pub segment_bytes: u64,
    /// Heartbeat offered.
    pub heartbeat: u16,
    /// frame_max offered.
    pub frame_max: u32,
    /// Password of `guest`.
    pub default_pass: String,
    /// `guest` allowed from anywhere.
    pub guest_remote: bool,
    /// Lease (visibility) timeout in seconds; 0 disables it.
    pub consumer_timeout_secs: u64,
    // --- flow control and resource limits ---
    /// Memory watermark in bytes of resident memory.
    pub memory_limit: u64,
    /// Free-disk watermark in bytes.
    pub disk_free_limit: u64,
    /// Partial-content stall timeout in seconds; 0 disables it.
    pub partial_content_timeout_secs: u64,
    /// Other users.
    pub users: Vec<UserConfig>,
    /// Quarantine damaged log ranges before opening the store.
    pub repair: bool,
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
    /// The file is not valid TOML for these settings.
    #[error("parsing config file {path}: {source}")]
    Parse {
        /// Path.
        path: PathBuf,
        /// Error.
        source: toml::de::Error,
    },
    /// A value is out of range.
    #[error("invalid setting: {0}")]
    Invalid(String),
}

impl Config {
    /// Merges flags/env over the file over defaults.
    pub fn load(cli: Cli) -> Result<Self, ConfigError> {
        let file = match &cli.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                toml::from_str::<FileConfig>(&text).map_err(|source| ConfigError::Parse {
                    path: path.clone(),
                    source,
                })?
            }
            None => FileConfig::default(),
        };
        let segment_bytes = cli.segment_mb.or(file.segment_mb).unwrap_or(64) << 20;
        let memory_limit = match cli.memory_limit.or(file.memory_limit) {
            Some(v) => parse_memory_limit(&v, physical_memory())?,
            None => (physical_memory() as f64 * DEFAULT_MEMORY_FRACTION) as u64,
        };
        let disk_free_limit = match cli.disk_free_limit.or(file.disk_free_limit) {
            Some(v) => parse_bytes(&v).ok_or_else(|| {
                ConfigError::Invalid(format!("disk_free_limit: cannot parse '{v}' as bytes"))
            })?,
            // Room for the segments a writer is about to fill, at least 1 GB.
            None => (1u64 << 30).max(2 * segment_bytes),
        };
        let cfg = Config {
            data_dir: cli
                .data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from("./weir-data")),
            amqp_listen: cli
                .amqp_listen
                .or(file.amqp_listen)
                .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 5672))),
            log: cli.log.or(file.log).unwrap_or_else(|| "info".into()),
            fsync: cli.fsync.or(file.fsync).unwrap_or(true),
            segment_bytes,
            heartbeat: cli.heartbeat.or(file.heartbeat).unwrap_or(60),
            frame_max: cli.frame_max.or(file.frame_max).unwrap_or(131_072),
            default_pass: cli
                .default_pass
                .or(file.default_pass)
                .unwrap_or_else(|| "guest".into()),
            guest_remote: cli.guest_remote.or(file.guest_remote).unwrap_or(false),
            consumer_timeout_secs: cli
                .consumer_timeout
                .or(file.consumer_timeout)
                .unwrap_or(1800),
            memory_limit,
            disk_free_limit,
            partial_content_timeout_secs: cli
                .partial_content_timeout
                .or(file.partial_content_timeout)
                .unwrap_or(30),
            users: file.users,
            repair: cli.repair,
        };
        if cfg.frame_max < 4096 {
            return Err(ConfigError::Invalid(format!(
                "frame_max {} is below the AMQP minimum 4096",
                cfg.frame_max
            )));
        }
        if cfg.segment_bytes == 0 || cfg.segment_bytes > u32::MAX as u64 {
            return Err(ConfigError::Invalid(
                "segment_mb must be between 1 and 4095".into(),
            ));
        }
        Ok(cfg)
    }
}

// --- flow control and resource limits ---

/// Share of physical RAM used as the memory watermark by default (RabbitMQ's
/// `vm_memory_high_watermark`).
const DEFAULT_MEMORY_FRACTION: f64 = 0.4;

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
                    "memory_limit fraction {v} must be between 0 and 1"
                )));
            }
            return Ok((ram as f64 * f) as u64);
        }
    }
    match parse_bytes(v) {
        Some(0) | None => Err(ConfigError::Invalid(format!(
            "memory_limit: cannot parse '{v}' as bytes or a fraction of RAM"
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

    use super::*;

    #[test]
    fn flags_override_file_which_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("weir-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("weir.toml");
        std::fs::write(
            &path,
            "data_dir = \"/from/file\"\nheartbeat = 5\n[[users]]\nname = \"a\"\npassword = \"b\"\n",
        )
        .expect("write config");
        let cli = Cli {
            config: Some(path),
            heartbeat: Some(7),
            ..Cli::default()
        };
        let cfg = Config::load(cli).expect("valid config");
        assert_eq!(cfg.data_dir, PathBuf::from("/from/file"));
        assert_eq!(cfg.heartbeat, 7);
        assert_eq!(cfg.amqp_listen.port(), 5672);
        assert_eq!(cfg.users.len(), 1);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let dir = std::env::temp_dir().join(format!("weir-config-test2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("weir.toml");
        std::fs::write(&path, "data_dirr = \"x\"\n").expect("write config");
        let err = Config::load(Cli {
            config: Some(path),
            ..Cli::default()
        })
        .unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }));
    }
}
