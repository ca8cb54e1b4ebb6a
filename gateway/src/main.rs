//! The `weir` binary.

use clap::Parser;
use std::process::ExitCode;
use weir_gateway::config::{Cli, Config};
use weir_gateway::server::{shutdown_signal, Broker};

fn main() -> ExitCode {
    let cfg = match Config::load(Cli::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("weir: {e}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .init();
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
        broker.run(shutdown_signal()).await;
        tracing::info!("weir stopped");
        ExitCode::SUCCESS
    })
}
