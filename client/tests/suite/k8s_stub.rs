//! A stub Kubernetes API server for discovery tests: it answers every request with the EndpointSliceList the
//! test set (built from a list recorded from a real cluster, `tests/data/endpointslices.json`, in the
//! `discovery.k8s.io/v1` format) or with a refusal, and keeps every request's head so the test can check the path,
//! the label selector and the bearer token.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use client::KubernetesDiscovery;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// The recorded list: one IPv4 slice of the Service `sandboxd`, a ready endpoint, a not-ready one, ports
/// `metrics` and `fsp`.
const RECORDED: &str = include_str!("../data/endpointslices.json");

/// The namespace and Service the stub's slices belong to.
pub const NAMESPACE: &str = "sandboxd";
pub const SERVICE: &str = "sandboxd";

struct Answer {
    status: u16,
    body: String,
}

pub struct ApiStub {
    pub addr: SocketAddr,
    answer: Arc<Mutex<Answer>>,
    heads: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ApiStub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ApiStub {
    /// Listens on a fresh loopback port (`http://`) and serves an empty list until told otherwise.
    pub async fn start() -> ApiStub {
        Self::start_with(None).await
    }

    /// The same over `https://`, with a self-signed certificate for 127.0.0.1; also returns the certificate in
    /// PEM, the CA a client must trust.
    pub async fn start_tls() -> (ApiStub, String) {
        let (acceptor, _, pem) = super::fake::self_signed("127.0.0.1");
        let stub = Self::start_with(Some(acceptor)).await;
        (stub, pem)
    }

    async fn start_with(tls: Option<TlsAcceptor>) -> ApiStub {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let answer = Arc::new(Mutex::new(Answer {
            status: 200,
            body: slice_list(&[]),
        }));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let (answer, heads) = (answer.clone(), heads.clone());
            tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let (answer, heads, tls) = (answer.clone(), heads.clone(), tls.clone());
                    tokio::spawn(async move {
                        match tls {
                            Some(acceptor) => {
                                if let Ok(stream) = acceptor.accept(tcp).await {
                                    answer_one(stream, &answer, &heads).await;
                                }
                            }
                            None => answer_one(tcp, &answer, &heads).await,
                        }
                    });
                }
            })
        };
        ApiStub {
            addr,
            answer,
            heads,
            task,
        }
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `https://ADDR`.
    pub fn tls_url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// From now on, the list holds `endpoints` (address and `fsp` port, ready).
    pub fn serve(&self, endpoints: &[(SocketAddr, bool)]) {
        *self.answer.lock().unwrap() = Answer {
            status: 200,
            body: slice_list(endpoints),
        };
    }

    /// From now on, the API refuses with `status` and a `Status` object carrying `message`.
    pub fn refuse(&self, status: u16, message: &str) {
        *self.answer.lock().unwrap() = Answer {
            status,
            body: json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                         "message": message, "reason": "Forbidden", "code": status})
            .to_string(),
        };
    }

    /// The heads of the requests so far.
    pub fn requests(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }

    /// A discovery of the stub's Service through this stub, listing every 100 ms with the token in `token_file`.
    pub fn discovery(&self, token_file: &Path) -> KubernetesDiscovery {
        let mut k8s = KubernetesDiscovery::new(SERVICE);
        k8s.namespace = Some(NAMESPACE.into());
        k8s.api_url = Some(self.url());
        k8s.token_file = token_file.to_owned();
        k8s.interval = Duration::from_millis(100);
        k8s
    }
}

/// Reads one request's head, keeps it, and writes the current answer.
async fn answer_one<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    answer: &Mutex<Answer>,
    heads: &Mutex<Vec<String>>,
) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    heads
        .lock()
        .unwrap()
        .push(String::from_utf8_lossy(&head).into_owned());
    let response = {
        let a = answer.lock().unwrap();
        format!(
            "HTTP/1.1 {} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{}",
            a.status,
            a.body.len(),
            a.body
        )
    };
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// The recorded list with its endpoints replaced by `endpoints` (each one a copy of the recorded ready or
/// not-ready endpoint, with its address and pod name changed), in one slice per port (the recorded slice, named
/// apart, with its `fsp` port set).
pub fn slice_list(endpoints: &[(SocketAddr, bool)]) -> String {
    let mut list: Value = serde_json::from_str(RECORDED).unwrap();
    let recorded_slice = list["items"][0].clone();
    let recorded = recorded_slice["endpoints"].as_array().unwrap().clone();
    let (ready, not_ready) = (&recorded[0], &recorded[1]);
    assert_eq!(ready["conditions"]["ready"], true);
    assert_eq!(not_ready["conditions"]["ready"], false);
    let mut ports: Vec<u16> = endpoints.iter().map(|(a, _)| a.port()).collect();
    ports.sort();
    ports.dedup();
    let slices: Vec<Value> = ports
        .iter()
        .map(|&port| {
            let mut slice = recorded_slice.clone();
            slice["metadata"]["name"] = json!(format!("sandboxd-{port}"));
            slice["endpoints"] = endpoints
                .iter()
                .enumerate()
                .filter(|(_, (a, _))| a.port() == port)
                .map(|(i, (a, is_ready))| {
                    let mut e = if *is_ready { ready } else { not_ready }.clone();
                    e["addresses"] = json!([a.ip().to_string()]);
                    e["targetRef"]["name"] = json!(format!("sandboxd-pod{i}"));
                    e
                })
                .collect();
            for p in slice["ports"].as_array_mut().unwrap() {
                if p["name"] == "fsp" {
                    p["port"] = json!(port);
                }
            }
            slice
        })
        .collect();
    list["items"] = Value::Array(slices);
    list.to_string()
}
