//! The sandbox plane: envd's API, routed by the `E2b-Sandbox-Id` header.
//!
//! - `GET /health` → 204.
//! - `process.Process` Connect RPCs: `Start` and `Connect` (server streams of process events), `List`,
//!   `SendSignal`, `SendInput`, `CloseStdin` (unary); PTYs, `Update` and `StreamInput` are `unimplemented`.
//! - `filesystem.Filesystem` Connect RPCs: `Stat`, `ListDir`, `MakeDir`, `Move`, `Remove`; watching is
//!   `unimplemented`.
//! - `GET /files` (streamed bytes) and `POST /files` (multipart, or an octet-stream body optionally gzipped,
//!   written to disk as it arrives).
//!
//! An unknown (or paused) sandbox is 502 `{"code":502,"message":"The sandbox <id> was not found"}`, which the SDK
//! reads as "not running". Every call must carry the sandbox's `X-Access-Token` (compared in constant time), except
//! a `/files` request with a valid signature (`download_url`/`upload_url`).

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{
    DefaultBodyLimit, FromRequest, FromRequestParts, Multipart, Path, RawQuery, Request, State,
};
use axum::http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use base64::Engine as _;
use bytes::Bytes;
use futures_util::StreamExt;
use nix::sys::signal::Signal;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio::time::{sleep_until, Instant};
use tokio_util::io::ReaderStream;

use crate::api::{error_response, json_response, rfc3339};
use crate::connect::{
    self, bool_field, bytes_field, enum_field, field, header_str, int_field, message_field,
    string_field, string_list_field, string_map_field, Code, ConnectError, StreamWriter,
};
use crate::engine::{
    Attached, EngineError, LiveSandbox, ProcessEnd, ProcessEvent, ProcessSpec, SandboxInfo,
    SandboxState,
};
use crate::files::{Entry, EntryKind, FileError, Root};
use crate::Facade;

pub use crate::SANDBOX_ID_HEADER;

/// The header that carries the sandbox's access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";

/// How often an idle process stream sends a keepalive event when the client asks for keepalives but names no valid
/// interval.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(50);

/// The read size of `GET /files`.
const DOWNLOAD_CHUNK: usize = 64 * 1024;

/// How many body chunks an upload buffers between the connection and the disk writer.
const UPLOAD_BUFFER: usize = 8;

/// Why a sandbox-plane call failed, outside the Connect protocol (routing, auth, `/files`).
#[derive(Debug, thiserror::Error)]
pub enum EnvdError {
    /// No `E2b-Sandbox-Id` header.
    #[error("Missing E2b-Sandbox-Id header")]
    MissingSandboxId,
    /// No such sandbox.
    #[error("The sandbox {0} was not found")]
    SandboxNotFound(String),
    /// The sandbox is paused: it serves nothing until it is resumed.
    #[error("The sandbox {0} was not found: it is paused")]
    SandboxPaused(String),
    /// No `X-Access-Token` (and no signature).
    #[error("Missing X-Access-Token header")]
    MissingToken,
    /// A wrong `X-Access-Token`.
    #[error("Invalid access token")]
    BadToken,
    /// A `/files` signature that does not match.
    #[error("Invalid signature")]
    BadSignature,
    /// A `/files` signature past its expiration.
    #[error("signature is already expired")]
    SignatureExpired,
    /// The request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// An upload past the facade's limit.
    #[error("The upload is larger than {0} bytes")]
    TooLarge(u64),
    /// The sandbox's disk (or quota) is full.
    #[error("Not enough space on the sandbox's disk")]
    NoSpace,
    /// A file call failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The host failed otherwise.
    #[error("{0}")]
    Internal(String),
}

impl EnvdError {
    /// Its HTTP status (envd's, as the SDK reads them: 400, 401, 404, 413, 502, 507).
    pub fn status(&self) -> StatusCode {
        match self {
            EnvdError::MissingSandboxId | EnvdError::BadRequest(_) => StatusCode::BAD_REQUEST,
            EnvdError::SandboxNotFound(_) | EnvdError::SandboxPaused(_) => StatusCode::BAD_GATEWAY,
            EnvdError::MissingToken
            | EnvdError::BadToken
            | EnvdError::BadSignature
            | EnvdError::SignatureExpired => StatusCode::UNAUTHORIZED,
            EnvdError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            EnvdError::NoSpace | EnvdError::File(FileError::NoSpace) => {
                StatusCode::INSUFFICIENT_STORAGE
            }
            EnvdError::File(err) => match err {
                FileError::NotFound(_) => StatusCode::NOT_FOUND,
                FileError::AlreadyExists(_) => StatusCode::CONFLICT,
                FileError::NotADirectory(_)
                | FileError::IsADirectory(_)
                | FileError::Invalid(_) => StatusCode::BAD_REQUEST,
                FileError::NoSpace => StatusCode::INSUFFICIENT_STORAGE,
                FileError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
            },
            EnvdError::Engine(err) => match err {
                EngineError::SandboxNotFound(_) => StatusCode::BAD_GATEWAY,
                EngineError::ProcessNotFound(_) => StatusCode::NOT_FOUND,
                EngineError::Invalid(_) => StatusCode::BAD_REQUEST,
                EngineError::Paused(_) => StatusCode::BAD_GATEWAY,
                EngineError::Full(_) => StatusCode::TOO_MANY_REQUESTS,
                EngineError::Start(_) | EngineError::Internal(_) => {
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            },
            EnvdError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The same failure as a Connect error, for the RPCs.
    pub fn to_connect(&self) -> ConnectError {
        let code = match self {
            EnvdError::File(err) => file_code(err),
            EnvdError::Engine(err) => engine_code(err),
            EnvdError::MissingToken
            | EnvdError::BadToken
            | EnvdError::BadSignature
            | EnvdError::SignatureExpired => Code::Unauthenticated,
            EnvdError::MissingSandboxId | EnvdError::BadRequest(_) => Code::InvalidArgument,
            EnvdError::SandboxNotFound(_) | EnvdError::SandboxPaused(_) => Code::Unavailable,
            EnvdError::TooLarge(_) | EnvdError::NoSpace => Code::ResourceExhausted,
            EnvdError::Internal(_) => Code::Internal,
        };
        ConnectError::new(code, self.to_string())
    }
}

/// `{"code":<status>,"message":...}` with `Should-Retry: false`.
impl IntoResponse for EnvdError {
    fn into_response(self) -> Response {
        error_response(self.status(), &self.to_string())
    }
}

/// The Connect code of a file error.
fn file_code(err: &FileError) -> Code {
    match err {
        FileError::NotFound(_) => Code::NotFound,
        FileError::AlreadyExists(_) => Code::AlreadyExists,
        FileError::NotADirectory(_) | FileError::IsADirectory(_) | FileError::Invalid(_) => {
            Code::InvalidArgument
        }
        FileError::NoSpace => Code::ResourceExhausted,
        FileError::Io(_) => Code::Internal,
    }
}

/// The Connect code of an engine error.
fn engine_code(err: &EngineError) -> Code {
    match err {
        EngineError::SandboxNotFound(_) | EngineError::ProcessNotFound(_) => Code::NotFound,
        EngineError::Invalid(_) => Code::InvalidArgument,
        EngineError::Paused(_) => Code::Unavailable,
        EngineError::Full(_) => Code::ResourceExhausted,
        EngineError::Start(_) | EngineError::Internal(_) => Code::Internal,
    }
}

/// An engine error as a Connect error.
fn engine_error(err: EngineError) -> ConnectError {
    ConnectError::new(engine_code(&err), err.to_string())
}

/// A file error as a Connect error.
fn file_error(err: FileError) -> ConnectError {
    ConnectError::new(file_code(&err), err.to_string())
}

/// The sandbox plane's routes.
pub fn routes() -> Router<Facade> {
    Router::new()
        .route("/health", get(health))
        .route("/files", get(download).post(upload))
        .route("/process.Process/{method}", post(process_rpc))
        .route("/filesystem.Filesystem/{method}", post(filesystem_rpc))
        // Uploads are bounded by `Facade::max_upload_bytes` and RPC bodies by `connect::MAX_REQUEST_BYTES`.
        .layer(DefaultBodyLimit::disable())
}

/// The sandbox a request is for, running.
struct Target {
    sandbox: Arc<dyn LiveSandbox>,
    info: SandboxInfo,
}

/// The sandbox named by `E2b-Sandbox-Id`: 502 when there is none or it is paused.
fn target(facade: &Facade, headers: &HeaderMap) -> Result<Target, EnvdError> {
    let id = header_str(headers, SANDBOX_ID_HEADER).ok_or(EnvdError::MissingSandboxId)?;
    let sandbox = facade
        .engine
        .get(id)
        .ok_or_else(|| EnvdError::SandboxNotFound(id.to_owned()))?;
    let info = sandbox.info();
    if info.state == SandboxState::Paused {
        return Err(EnvdError::SandboxPaused(id.to_owned()));
    }
    Ok(Target { sandbox, info })
}

/// Checks `X-Access-Token` against the sandbox's token, in constant time.
fn check_token(info: &SandboxInfo, headers: &HeaderMap) -> Result<(), EnvdError> {
    let token = header_str(headers, ACCESS_TOKEN_HEADER).ok_or(EnvdError::MissingToken)?;
    if constant_time_eq::constant_time_eq(token.as_bytes(), info.access_token.as_bytes()) {
        Ok(())
    } else {
        Err(EnvdError::BadToken)
    }
}

/// The sandbox of a request, with its token checked.
fn authorized(facade: &Facade, headers: &HeaderMap) -> Result<Target, EnvdError> {
    let target = target(facade, headers)?;
    check_token(&target.info, headers)?;
    Ok(target)
}

/// A handler's argument: the sandbox the request names, running, with the request's access token checked (502 or
/// 401 otherwise, before the handler runs).
impl FromRequestParts<Facade> for Target {
    type Rejection = EnvdError;

    async fn from_request_parts(parts: &mut Parts, facade: &Facade) -> Result<Self, EnvdError> {
        authorized(facade, &parts.headers)
    }
}

/// Runs a file call on the sandbox's root, on the blocking pool.
async fn with_root<T, F>(sandbox: Arc<dyn LiveSandbox>, call: F) -> Result<T, EnvdError>
where
    T: Send + 'static,
    F: FnOnce(&Root) -> Result<T, FileError> + Send + 'static,
{
    tokio::task::spawn_blocking(move || {
        let root = Root::new(sandbox.root()?, sandbox.owner());
        call(&root).map_err(EnvdError::from)
    })
    .await
    .map_err(|err| EnvdError::Internal(format!("A file call failed: {err}")))?
}

/// `GET /health` → 204.
async fn health(_: Target) -> StatusCode {
    StatusCode::NO_CONTENT
}

// ---------------------------------------------------------------------------------------------------------------
// /files

/// The query of `/files`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FilesQuery {
    /// The file (relative to the home).
    pub path: Option<String>,
    /// The user the SDK names (`user` or `root`); used only in the signature.
    pub username: Option<String>,
    /// `v1_<base64>` of a signed URL.
    pub signature: Option<String>,
    /// Unix seconds after which the signature is refused.
    pub signature_expiration: Option<String>,
}

impl FilesQuery {
    /// Reads the query string (unknown parameters ignored; the last of a repeated one wins).
    pub fn parse(query: &str) -> Self {
        let mut out = Self::default();
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            let value = Some(value.into_owned());
            match key.as_ref() {
                "path" => out.path = value,
                "username" => out.username = value,
                "signature" => out.signature = value,
                "signature_expiration" => out.signature_expiration = value,
                _ => {}
            }
        }
        out
    }
}

/// What a signed URL lets its holder do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOperation {
    /// `GET /files`.
    Read,
    /// `POST /files`.
    Write,
}

impl FileOperation {
    fn as_str(self) -> &'static str {
        match self {
            FileOperation::Read => "read",
            FileOperation::Write => "write",
        }
    }
}

/// The signature of a `/files` URL as the SDK computes it: `v1_` and the unpadded standard base64 of
/// `sha256("<path>:<read|write>:<username>:<access token>[:<expiration>]")`.
pub fn file_signature(
    path: &str,
    operation: FileOperation,
    username: &str,
    access_token: &str,
    expiration: Option<&str>,
) -> String {
    let mut raw = format!("{path}:{}:{username}:{access_token}", operation.as_str());
    if let Some(expiration) = expiration {
        raw.push(':');
        raw.push_str(expiration);
    }
    format!(
        "v1_{}",
        STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes()))
    )
}

/// The sandbox of a `/files` request. A signed URL (`download_url`/`upload_url`) is fetched by plain HTTP clients
/// that send no `E2b-Sandbox-Id`: without the header, the sandbox is the one whose token the signature was made
/// with (checked against each, in constant time; a signature only its own sandbox's token makes).
fn files_target(
    facade: &Facade,
    headers: &HeaderMap,
    query: &FilesQuery,
    operation: FileOperation,
) -> Result<Target, EnvdError> {
    if header_str(headers, SANDBOX_ID_HEADER).is_some() {
        return target(facade, headers);
    }
    let Some(signature) = &query.signature else {
        return Err(EnvdError::MissingSandboxId);
    };
    for sandbox in facade.engine.list() {
        let info = sandbox.info();
        let expected = file_signature(
            query.path.as_deref().unwrap_or(""),
            operation,
            query.username.as_deref().unwrap_or(""),
            &info.access_token,
            query.signature_expiration.as_deref(),
        );
        if constant_time_eq::constant_time_eq(signature.as_bytes(), expected.as_bytes()) {
            if info.state == SandboxState::Paused {
                return Err(EnvdError::SandboxPaused(info.id));
            }
            return Ok(Target { sandbox, info });
        }
    }
    Err(EnvdError::BadSignature)
}

/// Authorizes a `/files` request: a valid `X-Access-Token`, or else a valid, unexpired signature.
fn authorize_files(
    info: &SandboxInfo,
    headers: &HeaderMap,
    query: &FilesQuery,
    operation: FileOperation,
) -> Result<(), EnvdError> {
    let token_result = check_token(info, headers);
    let Some(signature) = &query.signature else {
        return token_result;
    };
    if token_result.is_ok() {
        return Ok(());
    }
    let expiration = query.signature_expiration.as_deref();
    let expected = file_signature(
        query.path.as_deref().unwrap_or(""),
        operation,
        query.username.as_deref().unwrap_or(""),
        &info.access_token,
        expiration,
    );
    if !constant_time_eq::constant_time_eq(signature.as_bytes(), expected.as_bytes()) {
        return Err(EnvdError::BadSignature);
    }
    if let Some(expiration) = expiration {
        let at: u64 = expiration.trim().parse().map_err(|_| {
            EnvdError::BadRequest("signature_expiration must be unix seconds".into())
        })?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        if at < now {
            return Err(EnvdError::SignatureExpired);
        }
    }
    Ok(())
}

/// `GET /files?path=` → 200 with the file's bytes, streamed.
async fn download(
    State(facade): State<Facade>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, EnvdError> {
    let query = FilesQuery::parse(query.as_deref().unwrap_or(""));
    let target = files_target(&facade, &headers, &query, FileOperation::Read)?;
    authorize_files(&target.info, &headers, &query, FileOperation::Read)?;
    let path = query
        .path
        .ok_or_else(|| EnvdError::BadRequest("The path parameter is required".into()))?;
    let file = with_root(target.sandbox, move |root| root.open_read(&path)).await?;
    let stream = ReaderStream::with_capacity(tokio::fs::File::from_std(file), DOWNLOAD_CHUNK);
    let mut response = Response::new(Body::from_stream(stream));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    Ok(response)
}

/// Marks the error a [`Counted`] writer returns past its limit.
#[derive(Debug, thiserror::Error)]
#[error("The upload limit was exceeded")]
struct LimitExceeded;

/// A writer that refuses bytes past a limit.
struct Counted {
    inner: std::fs::File,
    written: u64,
    limit: u64,
    exceeded: Arc<AtomicBool>,
}

impl Write for Counted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.written.saturating_add(buf.len() as u64) > self.limit {
            self.exceeded.store(true, Ordering::SeqCst);
            return Err(io::Error::other(LimitExceeded));
        }
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A file being written from chunks, on the blocking pool.
struct Sink {
    tx: mpsc::Sender<Bytes>,
    task: tokio::task::JoinHandle<Result<u64, EnvdError>>,
}

/// The upload error of a failed write.
fn write_error(err: &io::Error, exceeded: bool, limit: u64, gzip: bool) -> EnvdError {
    if exceeded {
        return EnvdError::TooLarge(limit);
    }
    match err.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => EnvdError::NoSpace,
        Some(_) => EnvdError::Internal(format!("Writing the file failed: {err}")),
        None if gzip => EnvdError::BadRequest(format!("The gzip body is invalid: {err}")),
        None => EnvdError::Internal(format!("Writing the file failed: {err}")),
    }
}

impl Sink {
    /// Starts writing `file`, gunzipping when `gzip`, refusing more than `limit` bytes of content.
    fn spawn(file: std::fs::File, gzip: bool, limit: u64) -> Self {
        let (tx, mut rx) = mpsc::channel::<Bytes>(UPLOAD_BUFFER);
        let task = tokio::task::spawn_blocking(move || {
            let exceeded = Arc::new(AtomicBool::new(false));
            let counted = Counted {
                inner: file,
                written: 0,
                limit,
                exceeded: exceeded.clone(),
            };
            let fail =
                |err: io::Error| write_error(&err, exceeded.load(Ordering::SeqCst), limit, gzip);
            let counted = if gzip {
                let mut decoder = flate2::write::MultiGzDecoder::new(counted);
                while let Some(chunk) = rx.blocking_recv() {
                    decoder.write_all(&chunk).map_err(fail)?;
                }
                decoder.try_finish().map_err(fail)?;
                decoder.finish().map_err(fail)?
            } else {
                let mut counted = counted;
                while let Some(chunk) = rx.blocking_recv() {
                    counted.write_all(&chunk).map_err(fail)?;
                }
                counted
            };
            let mut counted = counted;
            counted.flush().map_err(fail)?;
            Ok(counted.written)
        });
        Self { tx, task }
    }

    /// Hands over one chunk; `false` when the writer has stopped (its error comes from [`Self::finish`]).
    async fn send(&self, chunk: Bytes) -> bool {
        self.tx.send(chunk).await.is_ok()
    }

    /// Ends the file: the bytes written, or why writing failed.
    async fn finish(self) -> Result<u64, EnvdError> {
        drop(self.tx);
        self.task
            .await
            .map_err(|err| EnvdError::Internal(format!("The file writer failed: {err}")))?
    }
}

/// One file of an upload: creates `path`, writes `chunks` to it (gunzipped when `gzip`), at most `limit` bytes.
/// A partly written file is removed when the upload fails.
async fn write_file<S, E>(
    sandbox: &Arc<dyn LiveSandbox>,
    path: &str,
    mut chunks: S,
    gzip: bool,
    limit: u64,
) -> Result<u64, EnvdError>
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let create_path = path.to_owned();
    let file = with_root(sandbox.clone(), move |root| root.create_write(&create_path)).await?;
    let sink = Sink::spawn(file, gzip, limit);
    let mut read_error = None;
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(chunk) => {
                if !sink.send(chunk).await {
                    break;
                }
            }
            Err(err) => {
                read_error = Some(EnvdError::BadRequest(format!(
                    "Reading the upload failed: {err}"
                )));
                break;
            }
        }
    }
    let result = match (sink.finish().await, read_error) {
        (Err(err), _) | (Ok(_), Some(err)) => Err(err),
        (Ok(written), None) => Ok(written),
    };
    if result.is_err() {
        let remove_path = path.to_owned();
        if let Err(err) = with_root(sandbox.clone(), move |root| root.remove(&remove_path)).await {
            tracing::debug!(path, %err, "removing a failed upload");
        }
    }
    result
}

/// The answer entry of one written file.
fn written_entry(path: &str) -> Value {
    let name = path.rsplit('/').next().unwrap_or(path);
    json!({ "name": name, "type": "file", "path": path })
}

/// `POST /files`: multipart (`file` parts whose filename is the path; `?path=` overrides it) or an
/// `application/octet-stream` body at `?path=` (optionally `Content-Encoding: gzip`). Written to disk as it
/// arrives; 200 `[{"name","type":"file","path"}]`.
async fn upload(
    State(facade): State<Facade>,
    RawQuery(query): RawQuery,
    request: Request,
) -> Result<Response, EnvdError> {
    let headers = request.headers();
    let query = FilesQuery::parse(query.as_deref().unwrap_or(""));
    let target = files_target(&facade, headers, &query, FileOperation::Write)?;
    authorize_files(&target.info, headers, &query, FileOperation::Write)?;
    let limit = facade.max_upload_bytes;
    let content_type = header_str(headers, CONTENT_TYPE.as_str())
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let gzip = match header_str(headers, CONTENT_ENCODING.as_str())
        .map(|s| s.trim().to_ascii_lowercase())
    {
        None => false,
        Some(encoding) if encoding == "identity" || encoding.is_empty() => false,
        Some(encoding) if encoding == "gzip" || encoding == "x-gzip" => true,
        Some(encoding) => {
            return Err(EnvdError::BadRequest(format!(
                "Unsupported Content-Encoding {encoding}"
            )))
        }
    };
    let declared =
        header_str(headers, CONTENT_LENGTH.as_str()).and_then(|v| v.trim().parse::<u64>().ok());

    let written = if content_type.starts_with("multipart/form-data") {
        if gzip {
            return Err(EnvdError::BadRequest(
                "A multipart upload cannot be gzip-encoded".into(),
            ));
        }
        upload_multipart(&target.sandbox, request, query.path, limit).await?
    } else if content_type.starts_with("application/octet-stream") {
        let path = query
            .path
            .ok_or_else(|| EnvdError::BadRequest("The path parameter is required".into()))?;
        if !gzip && declared.is_some_and(|len| len > limit) {
            return Err(EnvdError::TooLarge(limit));
        }
        let absolute = Root::absolute(&path)?;
        let body = request.into_body().into_data_stream();
        write_file(&target.sandbox, &absolute, body, gzip, limit).await?;
        vec![written_entry(&absolute)]
    } else {
        return Err(EnvdError::BadRequest(format!(
            "Unsupported Content-Type {content_type:?}: multipart/form-data or application/octet-stream"
        )));
    };
    Ok(json_response(StatusCode::OK, &Value::Array(written)))
}

/// The files of a multipart upload, each written as its part arrives.
async fn upload_multipart(
    sandbox: &Arc<dyn LiveSandbox>,
    request: Request,
    path: Option<String>,
    limit: u64,
) -> Result<Vec<Value>, EnvdError> {
    let mut multipart = Multipart::from_request(request, &())
        .await
        .map_err(|err| EnvdError::BadRequest(err.body_text()))?;
    let mut written: Vec<Value> = Vec::new();
    let mut paths: Vec<String> = Vec::new();
    let mut remaining = limit;
    loop {
        let field = multipart.next_field().await.map_err(|err| {
            EnvdError::BadRequest(format!("Invalid multipart body: {}", err.body_text()))
        })?;
        let Some(field) = field else { break };
        if field.name() != Some("file") {
            continue;
        }
        let target = match (&path, field.file_name()) {
            (Some(path), _) => path.clone(),
            (None, Some(name)) if !name.is_empty() => name.to_owned(),
            (None, _) => {
                return Err(EnvdError::BadRequest(
                    "A file part has no filename and no path is given".into(),
                ))
            }
        };
        let absolute = Root::absolute(&target)?;
        if paths.contains(&absolute) {
            return Err(EnvdError::BadRequest(format!(
                "Cannot upload several files to {absolute}"
            )));
        }
        let chunks = futures_util::stream::unfold(field, |mut field| async move {
            match field.chunk().await {
                Ok(Some(chunk)) => Some((Ok(chunk), field)),
                Ok(None) => None,
                Err(err) => Some((Err(err.body_text()), field)),
            }
        });
        let n = write_file(sandbox, &absolute, Box::pin(chunks), false, remaining).await?;
        remaining = remaining.saturating_sub(n);
        written.push(written_entry(&absolute));
        paths.push(absolute);
    }
    if written.is_empty() {
        return Err(EnvdError::BadRequest(
            "The multipart body has no part named file".into(),
        ));
    }
    Ok(written)
}

// ---------------------------------------------------------------------------------------------------------------
// Connect RPCs

/// Answers a unary RPC.
fn unary(result: Result<Value, ConnectError>) -> Response {
    match result {
        Ok(message) => connect::unary_ok(&message),
        Err(err) => err.into_response(),
    }
}

/// Answers a streaming RPC whose stream did not start.
fn stream(result: Result<Response, ConnectError>) -> Response {
    result.unwrap_or_else(ConnectError::into_stream_response)
}

/// An RPC this facade does not serve, in the form of the call (stream or unary).
fn unimplemented_rpc(headers: &HeaderMap, what: &str) -> Response {
    let err = ConnectError::unimplemented(format!("{what} is not supported by sandboxd"));
    if connect::is_stream_request(headers) {
        err.into_stream_response()
    } else {
        err.into_response()
    }
}

/// `POST /process.Process/{method}`.
async fn process_rpc(
    Target { sandbox, .. }: Target,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match method.as_str() {
        "Start" => stream(start(sandbox, &headers, body).await),
        "Connect" => stream(connect_process(sandbox, &headers, body).await),
        "List" => unary(list_processes(sandbox.as_ref(), &headers, body).await),
        "SendSignal" => unary(send_signal(sandbox.as_ref(), &headers, body).await),
        "SendInput" => unary(send_input(sandbox.as_ref(), &headers, body).await),
        "CloseStdin" => unary(close_stdin(sandbox.as_ref(), &headers, body).await),
        "Update" => unimplemented_rpc(&headers, "PTY resizing (process.Process/Update)"),
        "StreamInput" => unimplemented_rpc(&headers, "process.Process/StreamInput"),
        other => unimplemented_rpc(&headers, &format!("process.Process/{other}")),
    }
}

/// The `connect-timeout-ms` deadline of a call, if any.
fn deadline(headers: &HeaderMap) -> Option<Instant> {
    let ms = header_str(headers, "connect-timeout-ms")?
        .trim()
        .parse::<u64>()
        .ok()?;
    Instant::now().checked_add(Duration::from_millis(ms))
}

/// The keepalive interval a client asks for with `keepalive-ping-interval` (seconds); none when absent.
fn keepalive(headers: &HeaderMap) -> Option<Duration> {
    let value = header_str(headers, "keepalive-ping-interval")?;
    match value.trim().parse::<u64>() {
        Ok(secs) if secs > 0 => Some(Duration::from_secs(secs)),
        _ => Some(DEFAULT_KEEPALIVE),
    }
}

/// `process.Process/Start`: starts the process, then streams its events.
async fn start(
    sandbox: Arc<dyn LiveSandbox>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ConnectError> {
    let message = connect::read_stream(headers, body).await?;
    if field(&message, "pty").is_some() {
        return Err(ConnectError::unimplemented(
            "PTYs are not supported by sandboxd",
        ));
    }
    let process = message_field(&message, "process")?
        .ok_or_else(|| ConnectError::invalid_argument("process is required"))?;
    let cmd = string_field(process, "cmd")?
        .filter(|cmd| !cmd.is_empty())
        .ok_or_else(|| ConnectError::invalid_argument("process.cmd is required"))?;
    let cwd = match string_field(process, "cwd")?.filter(|cwd| !cwd.is_empty()) {
        Some(cwd) => Some(Root::absolute(&cwd).map_err(file_error)?),
        None => None,
    };
    let spec = ProcessSpec {
        cmd,
        args: string_list_field(process, "args")?,
        envs: string_map_field(process, "envs")?,
        cwd,
        // envd gives a process a stdin unless the request says otherwise (clients before 0.3.0 never say).
        stdin: bool_field(&message, "stdin")?.unwrap_or(true),
        tag: string_field(&message, "tag")?,
    };
    let attached = sandbox.start(spec).await.map_err(engine_error)?;
    let options = PumpOptions {
        keepalive: keepalive(headers),
        deadline: deadline(headers),
        kill_at_deadline: true,
    };
    Ok(spawn_pump(sandbox, attached, options))
}

/// The pid a `ProcessSelector` (`{"pid":N}` or `{"tag":"x"}`) names.
fn select_process(sandbox: &dyn LiveSandbox, message: &Value) -> Result<u32, ConnectError> {
    let selector = message_field(message, "process")?
        .ok_or_else(|| ConnectError::invalid_argument("process is required"))?;
    if let Some(pid) = int_field(selector, "pid")? {
        return u32::try_from(pid)
            .map_err(|_| ConnectError::invalid_argument(format!("Invalid pid {pid}")));
    }
    if let Some(tag) = string_field(selector, "tag")? {
        return sandbox
            .processes()
            .into_iter()
            .find(|p| p.spec.tag.as_deref() == Some(tag.as_str()))
            .map(|p| p.pid)
            .ok_or_else(|| ConnectError::not_found(format!("process with tag {tag} not found")));
    }
    Err(ConnectError::invalid_argument(
        "process must name a pid or a tag",
    ))
}

/// `process.Process/Connect`: attaches to a running process and streams its events.
async fn connect_process(
    sandbox: Arc<dyn LiveSandbox>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ConnectError> {
    let message = connect::read_stream(headers, body).await?;
    let pid = select_process(sandbox.as_ref(), &message)?;
    let attached = sandbox.attach(pid).map_err(engine_error)?;
    let options = PumpOptions {
        keepalive: keepalive(headers),
        deadline: deadline(headers),
        kill_at_deadline: false,
    };
    Ok(spawn_pump(sandbox, attached, options))
}

/// `process.Process/List`.
async fn list_processes(
    sandbox: &dyn LiveSandbox,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ConnectError> {
    connect::read_unary(headers, body).await?;
    let processes: Vec<Value> = sandbox
        .processes()
        .into_iter()
        .map(|p| {
            let mut config = Map::new();
            config.insert("args".into(), json!(p.spec.args));
            config.insert("cmd".into(), json!(p.spec.cmd));
            if let Some(cwd) = &p.spec.cwd {
                config.insert("cwd".into(), json!(cwd));
            }
            config.insert("envs".into(), json!(p.spec.envs));
            let mut info = Map::new();
            info.insert("config".into(), Value::Object(config));
            info.insert("pid".into(), json!(p.pid));
            if let Some(tag) = &p.spec.tag {
                info.insert("tag".into(), json!(tag));
            }
            Value::Object(info)
        })
        .collect();
    Ok(json!({ "processes": processes }))
}

/// The signals `SendSignal` takes (`process.Signal`).
const SIGNALS: &[(&str, i64)] = &[
    ("SIGNAL_UNSPECIFIED", 0),
    ("SIGNAL_SIGKILL", 9),
    ("SIGNAL_SIGTERM", 15),
];

/// `process.Process/SendSignal`.
async fn send_signal(
    sandbox: &dyn LiveSandbox,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ConnectError> {
    let message = connect::read_unary(headers, body).await?;
    let pid = select_process(sandbox, &message)?;
    let signal = match enum_field(&message, "signal", SIGNALS)? {
        Some(9) => Signal::SIGKILL,
        Some(15) => Signal::SIGTERM,
        Some(other) => {
            return Err(ConnectError::invalid_argument(format!(
                "Unsupported signal {other}"
            )))
        }
        None => return Err(ConnectError::invalid_argument("signal is required")),
    };
    sandbox.signal(pid, signal).await.map_err(engine_error)?;
    Ok(json!({}))
}

/// `process.Process/SendInput` (stdin only).
async fn send_input(
    sandbox: &dyn LiveSandbox,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ConnectError> {
    let message = connect::read_unary(headers, body).await?;
    let pid = select_process(sandbox, &message)?;
    let input = message_field(&message, "input")?.unwrap_or(&Value::Null);
    if field(input, "pty").is_some() {
        return Err(ConnectError::unimplemented(
            "PTY input is not supported by sandboxd",
        ));
    }
    let data = bytes_field(input, "stdin")?.unwrap_or_default();
    sandbox.send_input(pid, &data).await.map_err(engine_error)?;
    Ok(json!({}))
}

/// `process.Process/CloseStdin`.
async fn close_stdin(
    sandbox: &dyn LiveSandbox,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ConnectError> {
    let message = connect::read_unary(headers, body).await?;
    let pid = select_process(sandbox, &message)?;
    sandbox.close_stdin(pid).map_err(engine_error)?;
    Ok(json!({}))
}

/// How a process stream runs.
#[derive(Debug, Clone, Copy)]
struct PumpOptions {
    /// Send a keepalive event after this much silence.
    keepalive: Option<Duration>,
    /// The call's deadline (`connect-timeout-ms`).
    deadline: Option<Instant>,
    /// Kill the process (SIGKILL) at the deadline, as envd does for `Start`.
    kill_at_deadline: bool,
}

/// How forwarding a process's events stopped.
enum Outcome {
    /// The end event went out.
    Ended,
    /// The events stopped without an end (the sandbox went away).
    Lost,
    /// The deadline passed.
    Deadline,
    /// The client went away.
    ClientGone,
}

/// A process event as its `StartResponse`/`ConnectResponse` JSON, and whether it is the end.
fn event_json(event: ProcessEvent) -> (Value, bool) {
    match event {
        ProcessEvent::Stdout(data) => (
            json!({"event": {"data": {"stdout": STANDARD.encode(&data)}}}),
            false,
        ),
        ProcessEvent::Stderr(data) => (
            json!({"event": {"data": {"stderr": STANDARD.encode(&data)}}}),
            false,
        ),
        ProcessEvent::End(end) => (json!({"event": {"end": end_json(&end)}}), true),
    }
}

/// An `EndEvent`, keys in alphabetical order (as serde_json writes them either way).
fn end_json(end: &ProcessEnd) -> Value {
    let mut map = Map::new();
    if let Some(error) = &end.error {
        map.insert("error".into(), json!(error));
    }
    map.insert("exitCode".into(), json!(end.exit_code));
    map.insert("exited".into(), json!(end.exited));
    map.insert("status".into(), json!(end.status));
    Value::Object(map)
}

/// Sleeps until `at`, or forever.
async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Sends one message unless the deadline passes or the client goes first.
async fn send_or_stop(
    writer: &StreamWriter,
    message: &Value,
    deadline: Option<Instant>,
) -> Option<Outcome> {
    tokio::select! {
        sent = writer.send(message) => sent.err().map(|_| Outcome::ClientGone),
        () = sleep_until_opt(deadline) => Some(Outcome::Deadline),
    }
}

/// Forwards the start event, then the process's events, until one side stops.
async fn forward(attached: &mut Attached, writer: &StreamWriter, options: PumpOptions) -> Outcome {
    let start = json!({"event": {"start": {"pid": attached.pid}}});
    if let Some(outcome) = send_or_stop(writer, &start, options.deadline).await {
        return outcome;
    }
    let next_keepalive = |now: Instant| options.keepalive.and_then(|k| now.checked_add(k));
    let mut keepalive_at = next_keepalive(Instant::now());
    loop {
        let event = tokio::select! {
            event = attached.events.recv() => event,
            () = sleep_until_opt(keepalive_at) => {
                let ping = json!({"event": {"keepalive": {}}});
                if let Some(outcome) = send_or_stop(writer, &ping, options.deadline).await {
                    return outcome;
                }
                keepalive_at = next_keepalive(Instant::now());
                continue;
            }
            () = sleep_until_opt(options.deadline) => return Outcome::Deadline,
            () = writer.closed() => return Outcome::ClientGone,
        };
        let Some(event) = event else {
            return Outcome::Lost;
        };
        let (message, end) = event_json(event);
        if let Some(outcome) = send_or_stop(writer, &message, options.deadline).await {
            return outcome;
        }
        if end {
            return Outcome::Ended;
        }
        keepalive_at = next_keepalive(Instant::now());
    }
}

/// After the client left a `Start` with a deadline: reads (and drops) the events until the process ends, or kills
/// it at the deadline. Without a deadline the process simply runs on.
async fn drain(sandbox: &dyn LiveSandbox, attached: &mut Attached, options: PumpOptions) {
    let Some(deadline) = options.deadline.filter(|_| options.kill_at_deadline) else {
        return;
    };
    loop {
        tokio::select! {
            event = attached.events.recv() => match event {
                None | Some(ProcessEvent::End(_)) => return,
                Some(_) => {}
            },
            () = sleep_until(deadline) => {
                kill(sandbox, attached.pid).await;
                return;
            }
        }
    }
}

/// SIGKILLs a process whose deadline passed.
async fn kill(sandbox: &dyn LiveSandbox, pid: u32) {
    match sandbox.signal(pid, Signal::SIGKILL).await {
        Ok(()) | Err(EngineError::ProcessNotFound(_)) => {}
        Err(err) => tracing::warn!(pid, %err, "killing a process past its deadline"),
    }
}

/// Streams a process's events (start, data, end, then end-of-stream) from a task of its own.
fn spawn_pump(
    sandbox: Arc<dyn LiveSandbox>,
    mut attached: Attached,
    options: PumpOptions,
) -> Response {
    let (writer, response) = connect::stream_response();
    tokio::spawn(async move {
        match forward(&mut attached, &writer, options).await {
            Outcome::Ended => writer.finish(Ok(())).await,
            Outcome::Lost => {
                let err = ConnectError::new(
                    Code::Unavailable,
                    "The process's events ended without its end",
                );
                writer.finish(Err(err)).await;
            }
            Outcome::Deadline => {
                if options.kill_at_deadline {
                    kill(sandbox.as_ref(), attached.pid).await;
                }
                let err = ConnectError::new(
                    Code::DeadlineExceeded,
                    "The call's deadline (connect-timeout-ms) passed",
                );
                writer.finish(Err(err)).await;
            }
            Outcome::ClientGone => drain(sandbox.as_ref(), &mut attached, options).await,
        }
    });
    response
}

/// `POST /filesystem.Filesystem/{method}`.
async fn filesystem_rpc(
    Target { sandbox, .. }: Target,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let call = match method.as_str() {
        "Stat" | "ListDir" | "MakeDir" | "Move" | "Remove" => method.as_str(),
        "WatchDir" | "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher" => {
            return unimplemented_rpc(&headers, "Watching directories");
        }
        other => return unimplemented_rpc(&headers, &format!("filesystem.Filesystem/{other}")),
    };
    let message = match connect::read_unary(&headers, body).await {
        Ok(message) => message,
        Err(err) => return err.into_response(),
    };
    unary(filesystem_call(sandbox, call, &message).await)
}

/// A required string field.
fn required_string(message: &Value, camel: &str) -> Result<String, ConnectError> {
    string_field(message, camel)?
        .ok_or_else(|| ConnectError::invalid_argument(format!("{camel} is required")))
}

/// Runs one unary filesystem call.
async fn filesystem_call(
    sandbox: Arc<dyn LiveSandbox>,
    method: &str,
    message: &Value,
) -> Result<Value, ConnectError> {
    let fs = |err: EnvdError| err.to_connect();
    match method {
        "Stat" => {
            let path = required_string(message, "path")?;
            let entry = with_root(sandbox, move |root| root.stat(&path))
                .await
                .map_err(fs)?;
            Ok(json!({ "entry": entry_json(&entry) }))
        }
        "ListDir" => {
            let path = required_string(message, "path")?;
            let depth = int_field(message, "depth")?.unwrap_or(1);
            let depth = u32::try_from(depth.max(1)).unwrap_or(u32::MAX);
            let entries = with_root(sandbox, move |root| root.list(&path, depth))
                .await
                .map_err(fs)?;
            Ok(json!({ "entries": entries.iter().map(entry_json).collect::<Vec<_>>() }))
        }
        "MakeDir" => {
            let path = required_string(message, "path")?;
            let entry = with_root(sandbox, move |root| root.make_dir(&path))
                .await
                .map_err(fs)?;
            Ok(json!({ "entry": entry_json(&entry) }))
        }
        "Move" => {
            let source = required_string(message, "source")?;
            let destination = required_string(message, "destination")?;
            let entry = with_root(sandbox, move |root| root.rename(&source, &destination))
                .await
                .map_err(fs)?;
            Ok(json!({ "entry": entry_json(&entry) }))
        }
        "Remove" => {
            let path = required_string(message, "path")?;
            // As envd: removing what is not there succeeds.
            match with_root(sandbox, move |root| root.remove(&path)).await {
                Ok(()) | Err(EnvdError::File(FileError::NotFound(_))) => Ok(json!({})),
                Err(e) => Err(fs(e)),
            }
        }
        other => Err(ConnectError::unimplemented(format!(
            "filesystem.Filesystem/{other} is not supported by sandboxd"
        ))),
    }
}

/// An `EntryInfo` as proto3 JSON.
pub fn entry_json(entry: &Entry) -> Value {
    let kind = match entry.kind {
        EntryKind::File => "FILE_TYPE_FILE",
        EntryKind::Directory => "FILE_TYPE_DIRECTORY",
        EntryKind::Symlink => "FILE_TYPE_SYMLINK",
        EntryKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let mut map = Map::new();
    map.insert("name".into(), json!(entry.name));
    map.insert("type".into(), json!(kind));
    map.insert("path".into(), json!(entry.path));
    map.insert("size".into(), json!(entry.size.to_string()));
    map.insert("mode".into(), json!(entry.mode));
    map.insert("permissions".into(), json!(entry.permissions));
    map.insert("owner".into(), json!(entry.owner));
    map.insert("group".into(), json!(entry.group));
    map.insert("modifiedTime".into(), json!(rfc3339(entry.modified)));
    if let Some(target) = &entry.symlink_target {
        map.insert(
            "symlinkTarget".into(),
            json!(absolute_target(&entry.path, target)),
        );
    }
    Value::Object(map)
}

/// A symlink's target as envd reports it: an absolute path (a relative target taken from the link's directory),
/// `.` and `..` folded as text. Only reported; nothing is opened through it.
fn absolute_target(link: &str, target: &str) -> String {
    let joined = match target.starts_with('/') {
        true => target.to_owned(),
        false => {
            let dir = link.rsplit_once('/').map_or("", |(d, _)| d);
            format!("{dir}/{target}")
        }
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

#[cfg(test)]
mod tests {

    #[test]
    fn symlink_targets_are_reported_absolute() {
        assert_eq!(
            absolute_target("/home/user/d/l", "t.txt"),
            "/home/user/d/t.txt"
        );
        assert_eq!(
            absolute_target("/home/user/d/l", "../x/./t"),
            "/home/user/x/t"
        );
        assert_eq!(
            absolute_target("/home/user/l", "/etc/shadow"),
            "/etc/shadow"
        );
        assert_eq!(absolute_target("/l", "../../.."), "/");
    }
    use super::*;

    #[test]
    fn signature_matches_the_sdk() {
        // sha256("/home/user/a.txt:read:user:tok") in unpadded standard base64, as e2b's get_signature computes it.
        let sig = file_signature("/home/user/a.txt", FileOperation::Read, "user", "tok", None);
        assert!(sig.starts_with("v1_"));
        assert!(!sig.ends_with('='));
        let raw = Sha256::digest(b"/home/user/a.txt:read:user:tok");
        assert_eq!(sig, format!("v1_{}", STANDARD_NO_PAD.encode(raw)));
        let with_exp = file_signature("a", FileOperation::Write, "", "tok", Some("100"));
        assert_eq!(
            with_exp,
            format!(
                "v1_{}",
                STANDARD_NO_PAD.encode(Sha256::digest(b"a:write::tok:100"))
            )
        );
    }

    #[test]
    fn files_query() {
        let q = FilesQuery::parse(
            "path=%2Fa%20b&username=user&signature=v1_x&signature_expiration=5&x=1",
        );
        assert_eq!(q.path.as_deref(), Some("/a b"));
        assert_eq!(q.username.as_deref(), Some("user"));
        assert_eq!(q.signature.as_deref(), Some("v1_x"));
        assert_eq!(q.signature_expiration.as_deref(), Some("5"));
    }

    #[test]
    fn end_event_keys() {
        let end = ProcessEnd {
            exit_code: -1,
            exited: false,
            status: "signal: killed".into(),
            error: None,
        };
        assert_eq!(
            end_json(&end).to_string(),
            r#"{"exitCode":-1,"exited":false,"status":"signal: killed"}"#
        );
    }

    #[test]
    fn write_errors() {
        let enospc = io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(
            write_error(&enospc, false, 1, false).status(),
            StatusCode::INSUFFICIENT_STORAGE
        );
        assert_eq!(
            write_error(&enospc, true, 1, false).status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
        let corrupt = io::Error::new(io::ErrorKind::InvalidInput, "corrupt deflate stream");
        assert_eq!(
            write_error(&corrupt, false, 1, true).status(),
            StatusCode::BAD_REQUEST
        );
    }
}
