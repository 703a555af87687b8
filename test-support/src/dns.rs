//! A UDP nameserver for tests (feature `dns`): A records from a table the test can change, NXDOMAIN for a name
//! not in it.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};
use tokio::net::UdpSocket;

type Table = Arc<Mutex<HashMap<String, Vec<Ipv4Addr>>>>;

/// A nameserver on 127.0.0.1, stopped when dropped.
pub struct Nameserver {
    /// Where it answers.
    pub addr: SocketAddr,
    records: Table,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Nameserver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn absolute(name: &str) -> String {
    format!("{}.", name.trim_end_matches('.').to_ascii_lowercase())
}

impl Nameserver {
    /// Starts answering for these names (a name with no addresses answers with no records).
    pub async fn start(records: &[(&str, Vec<Ipv4Addr>)]) -> io::Result<Nameserver> {
        let socket = UdpSocket::bind("127.0.0.1:0").await?;
        let addr = socket.local_addr()?;
        let records: Table = Arc::new(Mutex::new(
            records
                .iter()
                .map(|(n, ips)| (absolute(n), ips.clone()))
                .collect(),
        ));
        let table = records.clone();
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
                let Ok(query) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                if let Ok(bytes) = answer(&query, &table).to_vec() {
                    let _ = socket.send_to(&bytes, peer).await;
                }
            }
        });
        Ok(Nameserver {
            addr,
            records,
            task,
        })
    }

    /// Replaces a name's addresses (adding the name if it was not there).
    pub fn set(&self, name: &str, addresses: Vec<Ipv4Addr>) {
        let mut table = self.records.lock().unwrap_or_else(|p| p.into_inner());
        table.insert(absolute(name), addresses);
    }
}

fn answer(query: &Message, table: &Table) -> Message {
    let table = table.lock().unwrap_or_else(|p| p.into_inner());
    let mut response = Message::new();
    response
        .set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true)
        .add_queries(query.queries().to_vec());
    for q in query.queries() {
        let Some(addresses) = table.get(&q.name().to_ascii().to_ascii_lowercase()) else {
            response.set_response_code(ResponseCode::NXDomain);
            continue;
        };
        if q.query_type() == RecordType::A {
            for ip in addresses {
                response.add_answer(Record::from_rdata(q.name().clone(), 0, RData::A(A(*ip))));
            }
        }
    }
    response
}
