//! `exec`: one program run on a daemon or a fleet, its output streamed, its tool calls served by local commands,
//! and its exit code made ours.

mod args;
mod outcome;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use client::{
    ClientError, CommandTool, ConnectOptions, Connection, ExecOptions, Execute, Fleet,
    ServerMessage,
};
use tokio::io::AsyncWrite;

use self::args::build_request;
pub(crate) use self::args::ExecArgs;
use self::outcome::{network_summary, outcome};
use crate::exit::{fail, Exit};
use crate::output::{say, write_flush};

/// Where `exec` runs: one daemon, or a fleet.
pub(crate) enum Target {
    One(ConnectOptions),
    Fleet(Fleet),
}

pub(crate) async fn exec(target: Target, args: ExecArgs) -> anyhow::Result<ExitCode> {
    let request = build_request(&args).await?;
    let timeout_ms = request.limits.timeout_ms;
    let conn = match &target {
        Target::One(options) => match Connection::connect(options.clone()).await {
            Ok(c) => Some(c),
            Err(e) => return Ok(fail(&e).await),
        },
        Target::Fleet(_) => None,
    };
    let exec_options = match args.deadline_ms {
        Some(ms) => ExecOptions::new().deadline(Duration::from_millis(ms)),
        None => ExecOptions::new(),
    };
    let tools: Vec<CommandTool> = args
        .tools
        .iter()
        .map(|t| CommandTool::parse(t))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    let mut calls = futures_util::stream::FuturesUnordered::<ToolRun>::new();
    let started = match (&conn, &target) {
        (_, Target::Fleet(fleet)) => fleet.execute_stream_with(request, exec_options).await,
        (Some(conn), Target::One(_)) => conn.execute_stream_with(request, exec_options).await,
        (None, Target::One(_)) => return Ok(Exit::Local.into()),
    };
    let mut execution = match started {
        Ok(e) => e,
        Err(e) => return Ok(fail(&e).await),
    };
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    let mut interrupted = false;
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    let result = loop {
        let item = tokio::select! {
            item = execution.next() => item,
            Some((call_id, outcome)) = futures_util::StreamExt::next(&mut calls), if !calls.is_empty() => {
                if let Err(e) = execution.answer(&call_id, outcome).await {
                    return Ok(fail(&e).await);
                }
                continue;
            }
            _ = &mut ctrl_c, if !interrupted => {
                interrupted = true;
                say(format!("interrupted; cancelling {}", execution.id())).await;
                if let Err(e) = execution.cancel().await {
                    return Ok(fail(&e).await);
                }
                continue;
            }
        };
        let envelope = match item {
            None => {
                say("the execution ended without a result".to_owned()).await;
                return Ok(Exit::Protocol.into());
            }
            Some(Err(e)) => {
                if args.json {
                    write_server_error(&mut stdout, &e).await?;
                }
                return Ok(fail(&e).await);
            }
            Some(Ok(envelope)) => envelope,
        };
        if args.json {
            let line = protocol::encode_with_ts(&envelope.message, &envelope.ts);
            write_flush(&mut stdout, format!("{line}\n").as_bytes()).await?;
        }
        match envelope.message {
            ServerMessage::Stdout(chunk) if !args.json => {
                let bytes = chunk.decode().context("undecodable stdout chunk")?;
                write_flush(&mut stdout, &bytes).await?;
            }
            ServerMessage::Stderr(chunk) if !args.json => {
                let bytes = chunk.decode().context("undecodable stderr chunk")?;
                write_flush(&mut stderr, &bytes).await?;
            }
            ServerMessage::ToolCall(call) => calls.push(run_tool(&tools, call)),
            ServerMessage::Result(result) => break result,
            _ => {}
        }
    };
    if let (Some(value), false) = (&result.return_value, args.json) {
        write_flush(&mut stdout, format!("{value}\n").as_bytes()).await?;
    }
    if let (Some(usage), false) = (&result.network, args.json) {
        say(network_summary(usage)).await;
    }
    if let Some(conn) = conn {
        conn.close();
    }
    Ok(outcome(&result, timeout_ms).await)
}

/// A tool call being served by a local command: the call's id and its outcome.
type ToolRun = std::pin::Pin<Box<dyn std::future::Future<Output = (String, client::ToolOutcome)>>>;

/// Serves a `tool_call` with the local command of that name (`--tool`), or refuses it.
fn run_tool(tools: &[CommandTool], call: protocol::ToolCall) -> ToolRun {
    let tool = tools.iter().find(|t| t.name == call.name).cloned();
    Box::pin(async move {
        let outcome = match tool {
            Some(t) => {
                t.run(&call.args, call.timeout_ms.map(Duration::from_millis))
                    .await
            }
            None => Err(format!("sandboxctl has no tool {:?}", call.name)),
        };
        (call.call_id, outcome)
    })
}

/// With `--json`, the server's `error` that ended the execution, as a line like the other messages.
async fn write_server_error<W: AsyncWrite + Unpin>(
    out: &mut W,
    e: &ClientError,
) -> std::io::Result<()> {
    if let ClientError::Server { id, code, message } = e {
        let m = ServerMessage::Error(protocol::ErrorMessage::new(
            id.clone(),
            *code,
            message.clone(),
        ));
        write_flush(out, format!("{}\n", protocol::encode(&m)).as_bytes()).await?;
    }
    Ok(())
}
