//! `fsp-conformance`: runs the FSP/1 conformance suite against an endpoint, or lists its cases.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use conformance::{cases, framework, progress_line, run_suite, RunConfig, Xfail};

/// Process exit codes.
#[repr(u8)]
enum Exit {
    /// No failure (SHOULD failures only count with `--strict`).
    Conforming = 0,
    /// A MUST failed (or a SHOULD with `--strict`).
    Failed = 1,
    /// Bad arguments or files.
    Usage = 2,
    /// No failure, but the suite could not carry out some cases (or could not reach the endpoint).
    Harness = 3,
}

#[derive(Parser)]
#[command(
    version,
    about = "Conformance suite for Fathom Sandbox Protocol v1 (FSP/1) implementations"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the suite against an endpoint.
    Run(RunArgs),
    /// List every case: id, level, spec section, title (and the requirement with --verbose).
    List {
        /// Only these cases (comma-separated globs, e.g. 'P.3.*,R.cleanup.*').
        #[arg(long)]
        cases: Option<String>,
        /// Also print the requirement each case checks.
        #[arg(long, short)]
        verbose: bool,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// The FSP WebSocket endpoint, e.g. ws://127.0.0.1:7070/ws.
    #[arg(long)]
    endpoint: String,
    /// A bearer token the endpoint accepts (or set FSP_TOKEN).
    #[arg(long, env = "FSP_TOKEN", hide_env_values = true)]
    token: String,
    /// Only these cases (comma-separated globs, e.g. 'P.3.*,R.cleanup.*'; a bare 'P.3' means 'P.3.*').
    #[arg(long)]
    cases: Option<String>,
    /// SHOULD failures fail the run.
    #[arg(long)]
    strict: bool,
    /// A file of cases expected to fail: one id or glob per line, then an optional reason; '#' comments.
    #[arg(long)]
    xfail: Option<PathBuf>,
    /// Multiply every deadline of the suite by this (not the spec's own bounds, such as pong within 1 s).
    #[arg(long, default_value_t = 1.0)]
    timeout_scale: f64,
    /// Write the JSON report to DIR/report.json.
    #[arg(long, value_name = "DIR")]
    json: Option<PathBuf>,
    /// Write a JUnit XML report to FILE.
    #[arg(long, value_name = "FILE")]
    junit: Option<PathBuf>,
    /// Print the cases that would run, without connecting.
    #[arg(long)]
    dry_run: bool,
    /// An allowlist entry the endpoint's operator allows (extension `network`, e.g. pypi.org:443); it must not
    /// cover denied.invalid. Without it the cases that need an accepted network request are skipped.
    #[arg(long, value_name = "ENTRY")]
    network_allow: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::List { cases, verbose } => list(cases.as_deref(), verbose),
        Command::Run(args) => run(args),
    };
    ExitCode::from(code as u8)
}

fn list(selection: Option<&str>, verbose: bool) -> Exit {
    let all = cases::all();
    let selected = framework::select(&all, selection);
    for c in &selected {
        println!(
            "{:<12} {:<6} §{:<18} {}",
            c.id,
            c.level.as_str(),
            c.section,
            c.title
        );
        if verbose {
            println!("{:<12} {}", "", c.requirement);
        }
    }
    let count = |l: conformance::Level| selected.iter().filter(|c| c.level == l).count();
    println!(
        "{} cases: {} MUST, {} SHOULD, {} MAY, {} INFO",
        selected.len(),
        count(conformance::Level::Must),
        count(conformance::Level::Should),
        count(conformance::Level::May),
        count(conformance::Level::Info)
    );
    Exit::Conforming
}

fn run(args: RunArgs) -> Exit {
    if !(args.timeout_scale > 0.0 && args.timeout_scale.is_finite()) {
        eprintln!("fsp-conformance: --timeout-scale must be a positive number");
        return Exit::Usage;
    }
    let xfail = match &args.xfail {
        None => Xfail::default(),
        Some(path) => match std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|t| Xfail::parse(&t))
        {
            Ok(x) => x,
            Err(e) => {
                eprintln!("fsp-conformance: --xfail {}: {e}", path.display());
                return Exit::Usage;
            }
        },
    };
    if args.dry_run {
        let all = cases::all();
        let selected = framework::select(&all, args.cases.as_deref());
        for c in &selected {
            let x = xfail
                .reason(c.id)
                .map_or(String::new(), |r| format!("  (expected to fail: {r})"));
            println!(
                "would run {:<12} {:<6} {}{x}",
                c.id,
                c.level.as_str(),
                c.title
            );
        }
        println!("{} cases against {}", selected.len(), args.endpoint);
        return Exit::Conforming;
    }
    let cfg = RunConfig {
        endpoint: args.endpoint.clone(),
        token: args.token.clone(),
        strict: args.strict,
        timeout_scale: args.timeout_scale,
        network_allow: args.network_allow.clone(),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fsp-conformance: cannot start the async runtime: {e}");
            return Exit::Harness;
        }
    };
    let report = runtime.block_on(run_suite(cfg, args.cases.as_deref(), &xfail, |r| {
        println!("{}", progress_line(r))
    }));
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fsp-conformance: {e}");
            return if e.starts_with("no case matches") {
                Exit::Usage
            } else {
                Exit::Harness
            };
        }
    };
    print!("{}", report.human());
    if let Some(dir) = &args.json {
        let path = dir.join("report.json");
        if let Err(e) =
            std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, report.to_json()))
        {
            eprintln!("fsp-conformance: cannot write {}: {e}", path.display());
            return Exit::Usage;
        }
        println!("JSON report: {}", path.display());
    }
    if let Some(path) = &args.junit {
        let written = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => std::fs::create_dir_all(p),
            _ => Ok(()),
        }
        .and_then(|()| std::fs::write(path, report.to_junit()));
        if let Err(e) = written {
            eprintln!("fsp-conformance: cannot write {}: {e}", path.display());
            return Exit::Usage;
        }
        println!("JUnit report: {}", path.display());
    }
    if !report.failures().is_empty() {
        Exit::Failed
    } else if !report.harness_errors().is_empty() {
        Exit::Harness
    } else {
        Exit::Conforming
    }
}
