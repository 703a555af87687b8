//! `sandboxctl` without a daemon: usage, local errors and an endpoint where nothing listens, each with its exit
//! code. The tests against a real daemon live with the client's daemon harness (`client/tests/suite/sandboxctl.rs`),
//! which finds this binary next to its own (this crate's integration tests make `cargo test --workspace` build it).
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

const SANDBOXCTL: &str = env!("CARGO_BIN_EXE_sandboxctl");

fn run(args: &[&str]) -> Output {
    Command::new(SANDBOXCTL)
        .args(args)
        .env_remove("SANDBOXD_URL")
        .env_remove("SANDBOXD_TOKEN")
        .env("SANDBOXCTL_LOG", "off")
        .output()
        .expect("spawn sandboxctl")
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A port nothing listens on: bound, then released.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[test]
fn help_lists_every_command() {
    let o = run(&["--help"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for command in ["exec", "ping", "health", "sandbox"] {
        assert!(out.contains(command), "{command} missing:\n{out}");
    }
}

#[test]
fn a_usage_error_is_clap_s_exit_code_2() {
    // `exec` needs a language.
    let o = run(&["exec", "--code", "true"]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
}

#[test]
fn local_problems_exit_1_before_connecting() {
    let o = run(&[
        "exec",
        "-l",
        "shell",
        "--file",
        "/nonexistent/sandboxctl-test.sh",
        "--url",
        "ws://127.0.0.1:9/ws",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("sandboxctl-test.sh"),
        "{}",
        show(&o)
    );
}

#[test]
fn nothing_listening_is_unavailable_69() {
    let url = format!("ws://127.0.0.1:{}/ws", free_port());
    let o = run(&["ping", "--url", &url, "--token", "t"]);
    assert_eq!(o.status.code(), Some(69), "{}", show(&o));
    let o = run(&["health", "--url", &url]);
    assert_eq!(o.status.code(), Some(69), "{}", show(&o));
}
