//! Client side of the `tool_calls` extension (`docs/spec/tool-calls.md`): what a tool handler returns, and
//! [`CommandTool`], a handler that runs a local command per call.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncWriteExt;

/// What a tool handler answers: `Ok(result)` (any JSON) or `Err(message)`.
pub type ToolOutcome = Result<Value, String>;

/// A tool served by a local command: `sh -c COMMAND`, the call's `args` as JSON on stdin, and its stdout as the
/// result (parsed as JSON when it is JSON, else the text). A non-zero exit fails the call with its stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandTool {
    /// The tool's name.
    pub name: String,
    /// The shell command.
    pub command: String,
}

impl CommandTool {
    /// Parses `NAME=COMMAND` (the form of `sandboxctl --tool`).
    pub fn parse(spec: &str) -> Result<Self, String> {
        match spec.split_once('=') {
            Some((name, command)) if !name.is_empty() && !command.trim().is_empty() => {
                Ok(CommandTool {
                    name: name.to_owned(),
                    command: command.to_owned(),
                })
            }
            _ => Err(format!("--tool {spec:?}: expected NAME=COMMAND")),
        }
    }

    /// Runs the command for one call, killing it after `timeout` (the call's own `timeout_ms`).
    pub async fn run(&self, args: &Value, timeout: Option<Duration>) -> ToolOutcome {
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&self.command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot run {:?}: {e}", self.command))?;
        if let Some(mut stdin) = child.stdin.take() {
            // A command that does not read its input closes the pipe early; that is not an error.
            let _ = stdin.write_all(args.to_string().as_bytes()).await;
        }
        let output = child.wait_with_output();
        let output = match timeout {
            Some(t) => tokio::time::timeout(t, output)
                .await
                .map_err(|_| format!("{} did not finish within {t:?}", self.name))?,
            None => output.await,
        }
        .map_err(|e| format!("{} failed: {e}", self.name))?;
        if !output.status.success() {
            return Err(format!(
                "{} exited with {}: {}",
                self.name,
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse() {
        let t = CommandTool::parse("grep=grep -n x").unwrap();
        assert_eq!((t.name.as_str(), t.command.as_str()), ("grep", "grep -n x"));
        assert!(CommandTool::parse("grep").is_err());
        assert!(CommandTool::parse("=ls").is_err());
        assert!(CommandTool::parse("ls= ").is_err());
    }

    #[tokio::test]
    async fn runs_with_args_on_stdin() {
        let t = CommandTool::parse("echo=cat").unwrap();
        let out = t.run(&serde_json::json!({"a": 1}), None).await.unwrap();
        assert_eq!(out, serde_json::json!({"a": 1}));
        let t = CommandTool::parse("text=echo hello").unwrap();
        assert_eq!(t.run(&Value::Null, None).await.unwrap(), "hello\n");
        let t = CommandTool::parse("fail=echo bad >&2; exit 3").unwrap();
        assert!(t.run(&Value::Null, None).await.unwrap_err().contains("bad"));
        let t = CommandTool::parse("slow=sleep 5").unwrap();
        let e = t
            .run(&Value::Null, Some(Duration::from_millis(100)))
            .await
            .unwrap_err();
        assert!(e.contains("did not finish"), "{e}");
    }
}
