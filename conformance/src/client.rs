//! A small FSP/1 WebSocket client for the cases: connects (or records how the upgrade was refused), sends raw
//! frames, and reads server messages into [`Msg`]s, keeping the ones a case did not ask for yet, in order.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::stop::Stop;
use crate::wire::{short, Exec, Msg};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// How an upgrade attempt ended.
#[derive(Debug)]
pub enum Upgrade {
    /// The server upgraded the connection.
    Open(Box<Conn>),
    /// The server answered the upgrade with an HTTP status (and body).
    Refused {
        /// The HTTP status code.
        status: u16,
        /// The response body, lossily decoded.
        body: String,
    },
}

/// What arrived instead of a server message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Closed {
    /// A close frame, with its code and reason.
    Close(Option<(u16, String)>),
    /// The TCP connection ended or broke.
    Gone(String),
}

/// One frame as read.
#[derive(Debug)]
pub enum Frame {
    /// A text frame holding JSON.
    Json(Msg),
    /// A frame the spec does not allow from a server (binary, or text that is not JSON).
    Bad(String),
    /// The connection ended.
    Closed(Closed),
}

/// An open FSP connection.
#[derive(Debug)]
pub struct Conn {
    ws: Ws,
    stash: VecDeque<Msg>,
    /// Every message received on this connection, in order (for envelope checks).
    pub seen: Vec<Msg>,
    /// The deadline of one wait when a case does not give one.
    pub deadline: Duration,
}

/// Opens a WebSocket to `url` with an optional bearer token and extra headers.
pub async fn upgrade(
    url: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    deadline: Duration,
) -> Result<Upgrade, Stop> {
    let mut req = url
        .into_client_request()
        .map_err(|e| Stop::Harness(format!("bad endpoint {url:?}: {e}")))?;
    let mut add = |k: &str, v: &str| -> Result<(), Stop> {
        let name = tungstenite::http::HeaderName::from_bytes(k.as_bytes())
            .map_err(|e| Stop::Harness(format!("bad header name {k:?}: {e}")))?;
        let value = HeaderValue::from_str(v)
            .map_err(|e| Stop::Harness(format!("bad header value for {k}: {e}")))?;
        req.headers_mut().insert(name, value);
        Ok(())
    };
    if let Some(t) = token {
        add("Authorization", &format!("Bearer {t}"))?;
    }
    for (k, v) in headers {
        add(k, v)?;
    }
    let config = WebSocketConfig::default()
        .max_message_size(Some(512 << 20))
        .max_frame_size(Some(512 << 20));
    let connect = tokio_tungstenite::connect_async_with_config(req, Some(config), true);
    match tokio::time::timeout(deadline, connect).await {
        Err(_) => Err(Stop::Harness(format!(
            "the WebSocket upgrade to {url} did not finish within {deadline:?}"
        ))),
        Ok(Ok((ws, _))) => Ok(Upgrade::Open(Box::new(Conn {
            ws,
            stash: VecDeque::new(),
            seen: Vec::new(),
            deadline: Duration::from_secs(10),
        }))),
        Ok(Err(tungstenite::Error::Http(resp))) => Ok(Upgrade::Refused {
            status: resp.status().as_u16(),
            body: String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()).into_owned(),
        }),
        Ok(Err(e)) => Err(Stop::Harness(format!("cannot connect to {url}: {e}"))),
    }
}

impl Conn {
    /// Sends one JSON value as a text frame.
    pub async fn send_json(&mut self, v: &Value) -> Result<(), Stop> {
        self.send(Message::text(v.to_string())).await
    }

    /// Sends any frame.
    pub async fn send(&mut self, m: Message) -> Result<(), Stop> {
        self.ws.send(m).await.map_err(|e| {
            Stop::Fail(format!(
                "the server closed the connection (sending failed: {e})"
            ))
        })
    }

    /// Sends several JSON values in one write, so that the server reads them together.
    pub async fn send_all(&mut self, vs: &[Value]) -> Result<(), Stop> {
        for v in vs {
            self.ws
                .feed(Message::text(v.to_string()))
                .await
                .map_err(|e| Stop::Fail(format!("sending failed: {e}")))?;
        }
        self.ws
            .flush()
            .await
            .map_err(|e| Stop::Fail(format!("sending failed: {e}")))
    }

    /// Sends a close frame and waits (briefly) for the server to end the connection.
    pub async fn close(mut self) {
        let _ = self.ws.close(None).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while let Some(Ok(_)) = self.ws.next().await {}
        })
        .await;
    }

    /// Reads the next frame from the socket (the kept messages are not looked at), or `None` after `within`.
    pub async fn frame(&mut self, within: Duration) -> Option<Frame> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let next = match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => return None,
                Ok(n) => n,
            };
            return Some(match next {
                None => Frame::Closed(Closed::Gone("end of stream".into())),
                Some(Err(e)) => Frame::Closed(Closed::Gone(e.to_string())),
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                Some(Ok(Message::Close(f))) => Frame::Closed(Closed::Close(
                    f.map(|f| (u16::from(f.code), f.reason.to_string())),
                )),
                Some(Ok(Message::Text(t))) => match serde_json::from_str::<Value>(t.as_str()) {
                    Ok(raw) => {
                        let m = Msg {
                            raw,
                            at: Instant::now(),
                        };
                        self.seen.push(m.clone());
                        Frame::Json(m)
                    }
                    Err(e) => Frame::Bad(format!(
                        "a text frame that is not JSON ({e}): {:?}",
                        t.as_str().chars().take(200).collect::<String>()
                    )),
                },
                Some(Ok(Message::Binary(b))) => Frame::Bad(format!(
                    "a binary frame of {} bytes from the server",
                    b.len()
                )),
                Some(Ok(Message::Frame(_))) => continue,
            });
        }
    }

    /// Reads the next frame without parsing text frames (for output floods, where parsing would slow the reader).
    /// `Ok(text)` for a text frame; `Err(frame)` for anything else (a parsed frame is never returned here).
    pub async fn raw(&mut self, within: Duration) -> Option<Result<String, Frame>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let next = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .ok()?;
            return Some(match next {
                None => Err(Frame::Closed(Closed::Gone("end of stream".into()))),
                Some(Err(e)) => Err(Frame::Closed(Closed::Gone(e.to_string()))),
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => continue,
                Some(Ok(Message::Close(f))) => Err(Frame::Closed(Closed::Close(
                    f.map(|f| (u16::from(f.code), f.reason.to_string())),
                ))),
                Some(Ok(Message::Text(t))) => Ok(t.as_str().to_owned()),
                Some(Ok(Message::Binary(b))) => Err(Frame::Bad(format!(
                    "a binary frame of {} bytes from the server",
                    b.len()
                ))),
            });
        }
    }

    /// Reads the next message from the socket; a close, a bad frame or the deadline is a failure naming `what`.
    async fn read(&mut self, until: tokio::time::Instant, what: &str) -> Result<Msg, Stop> {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        match self.frame(left).await {
            None => Err(Stop::Fail(format!(
                "timed out after {:?} waiting for {what}{}",
                self.deadline_of(left),
                self.pending_note()
            ))),
            Some(Frame::Json(m)) => Ok(m),
            Some(Frame::Bad(why)) => Err(Stop::Fail(format!("while waiting for {what}: {why}"))),
            Some(Frame::Closed(c)) => Err(Stop::Fail(format!(
                "the connection ended ({c:?}) while waiting for {what}{}",
                self.pending_note()
            ))),
        }
    }

    fn deadline_of(&self, left: Duration) -> Duration {
        left.max(Duration::from_millis(1))
    }

    fn pending_note(&self) -> String {
        if self.stash.is_empty() {
            String::new()
        } else {
            let labels: Vec<String> = self
                .stash
                .iter()
                .take(12)
                .map(|m| format!("{}({})", m.label(), m.id().unwrap_or("-")))
                .collect();
            format!("; other messages received meanwhile: {labels:?}")
        }
    }

    /// The next message (kept ones first) within `within`.
    pub async fn next(&mut self, within: Duration, what: &str) -> Result<Msg, Stop> {
        if let Some(m) = self.stash.pop_front() {
            return Ok(m);
        }
        let until = tokio::time::Instant::now() + within;
        self.read(until, what).await
    }

    /// Waits for a message matching `pred` and removes it; other messages are kept in order.
    pub async fn take(
        &mut self,
        within: Duration,
        what: &str,
        pred: impl Fn(&Msg) -> bool,
    ) -> Result<Msg, Stop> {
        if let Some(i) = self.stash.iter().position(&pred) {
            if let Some(m) = self.stash.remove(i) {
                return Ok(m);
            }
        }
        let until = tokio::time::Instant::now() + within;
        loop {
            let m = self.read(until, what).await?;
            if pred(&m) {
                return Ok(m);
            }
            self.stash.push_back(m);
        }
    }

    /// Waits for a message matching `pred` and returns a copy; it stays kept for a later [`collect`](Self::collect).
    pub async fn observe(
        &mut self,
        within: Duration,
        what: &str,
        pred: impl Fn(&Msg) -> bool,
    ) -> Result<Msg, Stop> {
        if let Some(m) = self.stash.iter().find(|m| pred(m)) {
            return Ok(m.clone());
        }
        let until = tokio::time::Instant::now() + within;
        loop {
            let m = self.read(until, what).await?;
            self.stash.push_back(m.clone());
            if pred(&m) {
                return Ok(m);
            }
        }
    }

    /// Takes the next `error` (any id).
    pub async fn take_error(&mut self, within: Duration) -> Result<Msg, Stop> {
        self.take(within, "an error", |m| m.kind() == "error").await
    }

    /// Sends a ping and waits for its pong.
    pub async fn ping(&mut self, within: Duration) -> Result<Msg, Stop> {
        self.send_json(&crate::msgs::ping()).await?;
        self.take(within, "a pong", |m| m.kind() == "pong").await
    }

    /// Collects execution `id` (kept messages first) until its terminal message (`result` or `error` with the id).
    pub async fn collect(
        &mut self,
        id: &str,
        sent: Instant,
        within: Duration,
    ) -> Result<Exec, Stop> {
        let mut e = Exec::new(id, sent);
        self.collect_into(&mut e, within).await?;
        Ok(e)
    }

    /// Goes on collecting into `e` until its terminal message.
    pub async fn collect_into(&mut self, e: &mut Exec, within: Duration) -> Result<(), Stop> {
        if e.done() {
            return Ok(());
        }
        let id = e.id.clone();
        let mut i = 0;
        while i < self.stash.len() {
            if self.stash[i].is_for(&id) {
                if let Some(m) = self.stash.remove(i) {
                    e.msgs.push(m);
                }
                if e.done() {
                    return Ok(());
                }
            } else {
                i += 1;
            }
        }
        let until = tokio::time::Instant::now() + within;
        loop {
            let what = format!("the end of execution {id:?} (so far {:?})", e.labels());
            let m = self.read(until, &what).await?;
            if m.is_for(&id) {
                e.msgs.push(m);
                if e.done() {
                    return Ok(());
                }
            } else {
                self.stash.push_back(m);
            }
        }
    }

    /// Sends `exec` (an `execute`) and collects it to its end.
    pub async fn run(&mut self, exec: &Value, within: Duration) -> Result<Exec, Stop> {
        let id = exec["id"].as_str().unwrap_or_default().to_owned();
        let sent = Instant::now();
        self.send_json(exec).await?;
        self.collect(&id, sent, within).await
    }

    /// Reads for `window` and fails if a message matching `pred` arrives (everything else is kept). Used to check
    /// that something does *not* happen; the window is the only fixed wait the suite uses.
    pub async fn expect_none(
        &mut self,
        window: Duration,
        what: &str,
        pred: impl Fn(&Msg) -> bool,
    ) -> Result<(), Stop> {
        if let Some(m) = self.stash.iter().find(|m| pred(m)) {
            return Err(Stop::Fail(format!("{what}: {}", short(&m.raw))));
        }
        let until = tokio::time::Instant::now() + window;
        loop {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            match self.frame(left).await {
                None => return Ok(()),
                Some(Frame::Json(m)) => {
                    if pred(&m) {
                        return Err(Stop::Fail(format!("{what}: {}", short(&m.raw))));
                    }
                    self.stash.push_back(m);
                }
                Some(Frame::Bad(why)) => return Err(Stop::Fail(why)),
                Some(Frame::Closed(c)) => {
                    return Err(Stop::Fail(format!(
                        "the connection ended unexpectedly: {c:?}"
                    )))
                }
            }
        }
    }

    /// Messages received and not claimed yet.
    pub fn unclaimed(&self) -> Vec<Msg> {
        self.stash.iter().cloned().collect()
    }

    /// Drops kept messages matching `pred`.
    pub fn discard(&mut self, pred: impl Fn(&Msg) -> bool) {
        self.stash.retain(|m| !pred(m));
    }
}
