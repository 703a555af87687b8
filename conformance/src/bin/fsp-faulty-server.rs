//! `fsp-faulty-server`: the conformance suite's test fixture as a program, an FSP/1 server with switchable faults
//! (see `conformance::fixture`). It runs programs as plain host processes with no isolation: use it only to see
//! the suite catch a fault, e.g.
//! `fsp-faulty-server --fault ignores-cancel & fsp-conformance run --endpoint ws://127.0.0.1:7099/ws --token T`.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use conformance::fixture::{self, Fault, FixtureConfig};

#[derive(Parser)]
#[command(
    version,
    about = "An FSP/1 server with switchable faults, for testing conformance suites (no isolation)"
)]
struct Cli {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7099")]
    listen: String,
    /// The bearer token to accept.
    #[arg(long, default_value = "fixture-token-0123456789")]
    token: String,
    /// Switch a fault on (repeatable); `--fault list` prints them.
    #[arg(long = "fault")]
    faults: Vec<String>,
    /// Executions run at once.
    #[arg(long, default_value_t = 3)]
    max_concurrent: usize,
    /// Executions waiting beyond those.
    #[arg(long, default_value_t = 2)]
    max_queue: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.faults.iter().any(|f| f == "list") {
        for f in Fault::ALL {
            println!("{f}");
        }
        return ExitCode::SUCCESS;
    }
    let mut config = FixtureConfig {
        token: cli.token,
        max_concurrent: cli.max_concurrent,
        max_queue: cli.max_queue,
        ..FixtureConfig::default()
    };
    for f in &cli.faults {
        match f.parse::<Fault>() {
            Ok(f) => {
                config.faults.insert(f);
            }
            Err(e) => {
                eprintln!("fsp-faulty-server: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fsp-faulty-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        match fixture::start(config.clone(), &cli.listen).await {
            Ok(f) => {
                let names: Vec<&str> = config.faults.iter().map(|f| f.name()).collect();
                println!(
                    "fsp-faulty-server listening on {} (faults: {names:?})",
                    f.endpoint()
                );
                let _ = tokio::signal::ctrl_c().await;
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fsp-faulty-server: cannot listen on {}: {e}", cli.listen);
                ExitCode::FAILURE
            }
        }
    })
}
