//! [`Execute`]: the ways to run an [`ExecuteRequest`], written once for everything that can send one. A
//! [`Connection`](crate::Connection) sends it on its own link (multiplexed with other executions); a
//! [`Pool`](crate::Pool) checks a connection out for it and holds that connection until the execution ends.
//! Each implements only [`Execute::execute_stream_with`]; the collecting and tool-answering forms are provided here,
//! so both behave the same by construction, and code that runs requests can take either (`impl Execute`).

use std::future::Future;

use protocol::{ExecuteRequest, ToolCall};

use crate::config::ExecOptions;
use crate::error::ClientError;
use crate::execution::{Execution, ExecutionResult};
use crate::tools::ToolOutcome;

/// Something that runs [`ExecuteRequest`]s: a [`Connection`](crate::Connection) or a [`Pool`](crate::Pool).
///
/// Bring it into scope (`use client::Execute;`) to call these methods.
///
/// ```no_run
/// use client::{Execute, ExecuteRequest, ExecutionResult};
///
/// // Runs on a pool, a single connection, or a connection checked out of a pool.
/// async fn run(on: &impl Execute, request: ExecuteRequest) -> Result<ExecutionResult, client::ClientError> {
///     on.execute(request).await
/// }
/// ```
pub trait Execute: Sync {
    /// Sends `request` and returns its events as they arrive (an [`Execution`] stream), with `options` (client
    /// deadline). The request is validated first ([`ClientError::InvalidRequest`]); a pool's connection stays
    /// checked out until the stream ends.
    fn execute_stream_with(
        &self,
        request: ExecuteRequest,
        options: ExecOptions,
    ) -> impl Future<Output = Result<Execution, ClientError>> + Send;

    /// [`execute_stream_with`](Self::execute_stream_with) with the default options.
    fn execute_stream(
        &self,
        request: ExecuteRequest,
    ) -> impl Future<Output = Result<Execution, ClientError>> + Send {
        self.execute_stream_with(request, ExecOptions::default())
    }

    /// Runs `request` and collects its output and result (see [`Execution::result`]).
    fn execute(
        &self,
        request: ExecuteRequest,
    ) -> impl Future<Output = Result<ExecutionResult, ClientError>> + Send {
        self.execute_with(request, ExecOptions::default())
    }

    /// [`execute`](Self::execute) with options (client deadline).
    fn execute_with(
        &self,
        request: ExecuteRequest,
        options: ExecOptions,
    ) -> impl Future<Output = Result<ExecutionResult, ClientError>> + Send {
        async move {
            self.execute_stream_with(request, options)
                .await?
                .result()
                .await
        }
    }

    /// Runs `request` (which lists `tools`) and answers its tool calls with `handler` (see
    /// [`Execution::result_with_tools`]). The returned future is `Send` when `handler` and its futures are.
    ///
    /// ```no_run
    /// # use client::Execute;
    /// # async fn run(conn: client::Connection, request: client::ExecuteRequest) -> Result<(), client::ClientError> {
    /// let result = conn
    ///     .execute_with_tools(request, |call| async move {
    ///         match call.name.as_str() {
    ///             "add" => Ok(serde_json::json!(call.args["a"].as_i64().unwrap_or(0) + 1)),
    ///             other => Err(format!("no tool {other}")),
    ///         }
    ///     })
    ///     .await?;
    /// println!("{:?}", result.return_value);
    /// # Ok(())
    /// # }
    /// ```
    fn execute_with_tools<H, F>(
        &self,
        request: ExecuteRequest,
        handler: H,
    ) -> impl Future<Output = Result<ExecutionResult, ClientError>>
    where
        H: FnMut(ToolCall) -> F,
        F: Future<Output = ToolOutcome>,
    {
        async move {
            self.execute_stream(request)
                .await?
                .result_with_tools(handler)
                .await
        }
    }
}

/// Checked when the crate compiles: the futures of both implementations can be spawned on a multi-threaded
/// runtime, the tool-answering one when its handler can.
const _: fn(&crate::Pool, &crate::Connection, &crate::Fleet, ExecuteRequest) =
    |pool, conn, fleet, request| {
        fn send<T: Send>(_: T) {}
        send(fleet.execute(request.clone()));
        let answer = |_: ToolCall| async { Ok(serde_json::Value::Null) };
        send(pool.execute(request.clone()));
        send(pool.execute_stream(request.clone()));
        send(pool.execute_with_tools(request.clone(), answer));
        send(conn.execute_with(request.clone(), ExecOptions::default()));
        send(conn.execute_with_tools(request, answer));
    };
