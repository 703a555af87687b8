//! `exec`'s flags and the `ExecuteRequest` they make.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use base64::Engine as _;
use clap::{ArgGroup, Args};
use client::{
    new_execution_id, CommandTool, ExecuteRequest, Language, NetworkRequest, RequestedLimits,
    ToolSpec,
};
use protocol::{ArtifactsRequest, FileEncoding, FileSpec};
use tokio::io::AsyncReadExt;

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("source").required(true).args(["code", "file", "dash"])))]
pub(crate) struct ExecArgs {
    /// Language: python, javascript, shell or elixir.
    #[arg(long, short)]
    pub(super) language: Language,
    /// The program text.
    #[arg(long)]
    pub(super) code: Option<String>,
    /// Read the program from this file.
    #[arg(long)]
    pub(super) file: Option<PathBuf>,
    /// `-`: read the program from stdin.
    #[arg(value_name = "-", value_parser = clap::builder::PossibleValuesParser::new(["-"]))]
    pub(super) dash: Option<String>,
    /// Wall-clock limit in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub(super) timeout_ms: u64,
    /// Memory limit in MiB.
    #[arg(long, default_value_t = 256)]
    pub(super) memory_mb: u64,
    /// CPU weight (server default 512).
    #[arg(long)]
    pub(super) cpu_shares: Option<u64>,
    /// Hard CPU limit in cores, e.g. 0.5 (server default: its maximum).
    #[arg(long, value_parser = parse_cores)]
    pub(super) cpu_cores: Option<protocol::CpuCores>,
    /// stdout + stderr limit in bytes (server default 1 MiB).
    #[arg(long)]
    pub(super) max_output_bytes: Option<u64>,
    /// Process limit (server default 64).
    #[arg(long)]
    pub(super) pids_max: Option<u64>,
    /// Scratch space in MiB (server default 64).
    #[arg(long)]
    pub(super) disk_mb: Option<u64>,
    /// File whose content is the program's stdin (`-`: our stdin; must be UTF-8).
    #[arg(long)]
    pub(super) stdin: Option<PathBuf>,
    /// Environment variable for the program (repeatable).
    #[arg(long = "env", value_name = "K=V")]
    pub(super) env: Vec<String>,
    /// Put local file LOCAL at PATH in the working directory (repeatable).
    #[arg(long = "file-in", value_name = "PATH=LOCAL")]
    pub(super) files: Vec<String>,
    /// Collect files matching GLOB after the run (repeatable; the manifest is in the `--json` result).
    #[arg(long = "artifact", value_name = "GLOB")]
    pub(super) artifacts: Vec<String>,
    /// Client deadline in milliseconds (default: timeout_ms + 10 s); when it passes, the run is cancelled.
    #[arg(long)]
    pub(super) deadline_ms: Option<u64>,
    /// Print the protocol events as JSON lines instead of the program's output.
    #[arg(long)]
    pub(super) json: bool,
    /// Offer the tool NAME to the code (python, javascript; repeatable): each call runs `sh -c COMMAND` here with
    /// the call's arguments as JSON on stdin, and its stdout (JSON, else text) is the result. The code's return
    /// value, if any, is printed as one JSON line on stdout after its output.
    #[arg(long = "tool", value_name = "NAME=COMMAND")]
    pub(super) tools: Vec<String>,
    /// How long one tool call may take, in milliseconds (server default 30 s).
    #[arg(long)]
    pub(super) tool_timeout_ms: Option<u64>,
    /// Let the program reach HOST (port PORT; without one, 443 and 80) through the server's egress proxy
    /// (extension `network`; repeatable; `*.example.com` covers subdomains). The server refuses entries its
    /// operator did not allow, and IP addresses.
    #[arg(long = "allow", value_name = "HOST[:PORT]")]
    pub(super) allow: Vec<String>,
    /// Bytes the program may exchange with the outside, both directions together (server default and maximum).
    #[arg(long, value_name = "N", requires = "allow")]
    pub(super) egress_bytes: Option<u64>,
    /// Mount volume VOLUME (`sandboxctl volume create`) at /workspace/PATH, read-only with `:ro` (extension
    /// `volumes`; repeatable).
    #[arg(long = "mount", value_name = "VOLUME=PATH[:ro]")]
    pub(super) mounts: Vec<String>,
}

/// `--cpu-cores`: a number of cores the protocol accepts.
fn parse_cores(s: &str) -> Result<protocol::CpuCores, String> {
    let cores: f64 = s.parse().map_err(|e| format!("{e}"))?;
    protocol::CpuCores::try_from(cores)
}

/// Reads a whole file, `-` being stdin.
async fn read_input(path: &Path) -> anyhow::Result<Vec<u8>> {
    if path == Path::new("-") {
        let mut buf = Vec::new();
        tokio::io::stdin()
            .read_to_end(&mut buf)
            .await
            .context("cannot read stdin")?;
        Ok(buf)
    } else {
        tokio::fs::read(path)
            .await
            .with_context(|| format!("cannot read {}", path.display()))
    }
}

pub(super) async fn build_request(args: &ExecArgs) -> anyhow::Result<ExecuteRequest> {
    let code = match (&args.code, &args.file) {
        (Some(code), _) => code.clone(),
        (None, Some(file)) => String::from_utf8(read_input(file).await?)
            .with_context(|| format!("{} is not UTF-8", file.display()))?,
        (None, None) => String::from_utf8(read_input(Path::new("-")).await?)
            .context("the program on stdin is not UTF-8")?,
    };
    let mut limits = RequestedLimits::new(args.timeout_ms, args.memory_mb);
    limits.cpu_shares = args.cpu_shares;
    limits.cpu_cores = args.cpu_cores;
    limits.max_output_bytes = args.max_output_bytes;
    limits.pids_max = args.pids_max;
    limits.disk_mb = args.disk_mb;
    let mut request = ExecuteRequest::new(new_execution_id(), args.language, code, limits);
    if let Some(path) = &args.stdin {
        if path == Path::new("-") && args.dash.is_some() {
            bail!("--stdin - and the program from stdin (-) cannot both read stdin");
        }
        request.stdin = Some(
            String::from_utf8(read_input(path).await?)
                .with_context(|| format!("--stdin {}: not UTF-8", path.display()))?,
        );
    }
    for kv in &args.env {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--env {kv:?}: expected K=V"))?;
        request.env.insert(k.to_owned(), v.to_owned());
    }
    for spec in &args.mounts {
        let (volume, place) = spec
            .split_once('=')
            .with_context(|| format!("--mount {spec:?}: expected VOLUME=PATH[:ro]"))?;
        let (path, read_only) = match place.strip_suffix(":ro") {
            Some(path) => (path, true),
            None => (place, false),
        };
        request.mounts.push(protocol::MountRequest {
            volume: volume.to_owned(),
            path: format!("/workspace/{}", path.trim_start_matches('/')),
            read_only,
        });
    }
    for spec in &args.files {
        let (path, local) = spec
            .split_once('=')
            .with_context(|| format!("--file-in {spec:?}: expected PATH=LOCAL"))?;
        let bytes = read_input(Path::new(local)).await?;
        let (content, encoding) = match String::from_utf8(bytes) {
            Ok(text) => (text, FileEncoding::Utf8),
            Err(e) => (
                base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
                FileEncoding::Base64,
            ),
        };
        request.files.push(FileSpec {
            path: path.to_owned(),
            content,
            encoding,
        });
    }
    for spec in &args.tools {
        let tool = CommandTool::parse(spec).map_err(anyhow::Error::msg)?;
        request.tools.push(ToolSpec::new(tool.name));
    }
    request.tool_timeout_ms = args.tool_timeout_ms;
    if !args.allow.is_empty() {
        request.network = Some(NetworkRequest {
            allow: args.allow.clone(),
            egress_bytes: args.egress_bytes,
        });
    }
    if !args.artifacts.is_empty() {
        request.artifacts = Some(ArtifactsRequest {
            paths: args.artifacts.clone(),
            types: None,
        });
    }
    Ok(request)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{Cli, Command};

    fn exec_args(extra: &[&str]) -> Result<ExecArgs, clap::Error> {
        let base = ["sandboxctl", "exec", "-l", "shell", "--code", "true"];
        let cli = <Cli as Parser>::try_parse_from(base.iter().chain(extra))?;
        match cli.command {
            Command::Exec(args) => Ok(*args),
            other => panic!("parsed as {other:?}"),
        }
    }

    fn request_of(args: &ExecArgs) -> ExecuteRequest {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(build_request(args)).unwrap()
    }

    #[test]
    fn allow_and_egress_bytes_become_the_network_request() {
        let args = exec_args(&[
            "--allow",
            "pypi.org:443",
            "--allow",
            "*.pythonhosted.org:443",
            "--egress-bytes",
            "1048576",
        ])
        .unwrap();
        assert_eq!(
            request_of(&args).network,
            Some(NetworkRequest {
                allow: vec!["pypi.org:443".into(), "*.pythonhosted.org:443".into()],
                egress_bytes: Some(1 << 20),
            })
        );
        let args = exec_args(&["--allow", "api.example.com"]).unwrap();
        assert_eq!(
            request_of(&args).network,
            Some(NetworkRequest::allow(["api.example.com"]))
        );
        // No --allow, no network; --egress-bytes needs --allow.
        assert_eq!(request_of(&exec_args(&[]).unwrap()).network, None);
        let err = exec_args(&["--egress-bytes", "5"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
    }

    #[test]
    fn mounts_become_the_request_s_mounts() {
        let args = exec_args(&["--mount", "vol-a=data", "--mount", "vol-b=ref/x:ro"]).unwrap();
        let req = request_of(&args);
        let got: Vec<(&str, &str, bool)> = req
            .mounts
            .iter()
            .map(|m| (m.volume.as_str(), m.path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            got,
            [
                ("vol-a", "/workspace/data", false),
                ("vol-b", "/workspace/ref/x", true)
            ]
        );
    }
}
