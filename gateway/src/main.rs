//! The `weir` binary.

use std::process::ExitCode;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use weir_gateway::config::{Cli, Command, Config};
use weir_gateway::server::{shutdown_signal, Broker};

fn main() -> ExitCode {
    weir_gateway::server::pin_mmap_threshold();
    let mut cli = Cli::parse();
    let command = cli.command.take();
    if let Some(Command::HashPassword) = command {
        // Needs no configuration: a fresh machine can prepare its file.
        return hash_password();
    }
    match command {
        Some(Command::CheckConfig { file }) => return check_config(file),
        Some(Command::Completions { shell }) => {
            let mut cmd = Cli::clap_command();
            // Into a buffer first: clap_complete panics on a write error
            // (a closed pipe), a plain write just fails.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "weir", &mut script);
            use std::io::Write as _;
            if std::io::stdout().write_all(&script).is_err() {
                return ExitCode::FAILURE;
            }
            return ExitCode::SUCCESS;
        }
        Some(Command::Man) => return man_page(),
        _ => {}
    }
    let cfg = match Config::load(cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("weir: {e}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(weir_gateway::log_format::layer(cfg.log_format));
    // With the `otel` feature and an OTLP endpoint, spans are exported too;
    // the guard flushes them when main returns.
    #[cfg(feature = "otel")]
    let _otel = match weir_gateway::otel::layer() {
        Ok(Some((layer, guard))) => {
            registry.with(layer).init();
            Some(guard)
        }
        Ok(None) => {
            registry.init();
            None
        }
        Err(e) => {
            registry.init();
            tracing::warn!(error = %e, "OpenTelemetry export not started");
            None
        }
    };
    #[cfg(not(feature = "otel"))]
    registry.init();
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
    if let Some(Command::Repair { data_dir }) = command {
        return repair(&data_dir.unwrap_or(cfg.store.log.data_dir));
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("weir: starting runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        let broker = match Broker::start(&cfg).await {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "weir failed to start");
                return ExitCode::FAILURE;
            }
        };
        // SIGTERM's handler is installed before READY=1: a stop that comes
        // right after readiness (systemd, a test) must be a graceful one,
        // not the default action (shutdown_signal installs its own only
        // when first polled, inside run).
        let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        // systemd's Type=notify: started once every listener is bound.
        if let Err(e) = weir_gateway::readiness::ready() {
            tracing::warn!(error = %e, "readiness not reported");
        }
        broker
            .run(async move {
                match term {
                    Some(mut term) => tokio::select! {
                        _ = term.recv() => {}
                        _ = shutdown_signal() => {}
                    },
                    None => shutdown_signal().await,
                }
                let _ = weir_gateway::readiness::stopping();
            })
            .await;
        tracing::info!("weir stopped");
        ExitCode::SUCCESS
    })
}

/// `weir repair`: quarantines damaged log ranges and reports what was lost.
fn repair(dir: &std::path::Path) -> ExitCode {
    match weir_backend::log::repair(dir) {
        Ok(report) if report.damages.is_empty() => {
            println!("weir repair: no damage found in {}", dir.display());
            ExitCode::SUCCESS
        }
        Ok(report) => {
            for (d, q) in report.damages.iter().zip(&report.quarantined) {
                let lost: Vec<String> = d.lost.iter().map(|l| l.to_string()).collect();
                println!(
                    "weir repair: quarantined {} bytes at offset {} of {} ({}) into {}; lost: {}",
                    d.len,
                    d.offset,
                    d.file.display(),
                    d.reason,
                    q.display(),
                    lost.join(", ")
                );
            }
            let ids = report.lost_message_ids();
            println!(
                "weir repair: {} damaged range(s); lost message ids: {:?}; every other record kept",
                report.damages.len(),
                ids
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weir repair: {}: {e}", dir.display());
            ExitCode::FAILURE
        }
    }
}

/// `weir hash-password`: reads one password from stdin (a trailing newline
/// is not part of it) and prints its argon2id PHC string.
fn hash_password() -> ExitCode {
    use std::io::Read;
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().take(64 * 1024).read_to_end(&mut input) {
        eprintln!("weir hash-password: reading stdin: {e}");
        return ExitCode::FAILURE;
    }
    let mut pass = input.as_slice();
    if let Some(p) = pass.strip_suffix(b"\n") {
        pass = p.strip_suffix(b"\r").unwrap_or(p);
    }
    if pass.is_empty() {
        eprintln!("weir hash-password: empty password (give it on stdin)");
        return ExitCode::from(2);
    }
    match weir_engine::auth::hash_password(pass) {
        Ok(phc) => {
            println!("{phc}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weir hash-password: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `weir check-config FILE`: loads FILE as a start would (keys, values,
/// policies, limits) and its TLS files, without opening the store or a port.
fn check_config(file: std::path::PathBuf) -> ExitCode {
    let cfg = match Config::load_with_env(Cli::for_file(file.clone()), |_| None) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("weir check-config: {}: {e}", file.display());
            return ExitCode::from(2);
        }
    };
    if let Some(tls) = &cfg.tls {
        if let Err(e) = weir_gateway::tls::Tls::load(tls) {
            eprintln!("weir check-config: {}: [tls]: {e}", file.display());
            return ExitCode::from(2);
        }
    }
    for w in &cfg.warnings {
        println!("warning: {w}");
    }
    println!(
        "weir check-config: {} is valid: AMQP {}, MQTT {}, HTTP {}, data in {}, {} user(s), {} tenant(s), {} policies",
        file.display(),
        cfg.amqp.listen,
        cfg.mqtt.listen,
        cfg.http.listen,
        cfg.store.log.data_dir.display(),
        cfg.auth.users.len(),
        cfg.tenants.len(),
        cfg.policies.len()
    );
    ExitCode::SUCCESS
}

/// `weir man`: the man page of `weir` and its flags, in roff.
fn man_page() -> ExitCode {
    let man = clap_mangen::Man::new(Cli::clap_command());
    match man.render(&mut std::io::stdout()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weir man: {e}");
            ExitCode::FAILURE
        }
    }
}
