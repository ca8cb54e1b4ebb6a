//! The `weir` binary.

use clap::Parser;
use std::process::ExitCode;
use weir_gateway::config::{Cli, Command, Config};
use weir_gateway::server::{shutdown_signal, Broker};

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    let command = cli.command.take();
    let cfg = match Config::load(cli) {
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
    if let Some(Command::Repair { data_dir }) = command {
        return repair(&data_dir.unwrap_or(cfg.data_dir));
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
        broker.run(shutdown_signal()).await;
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
