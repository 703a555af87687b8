//! Hosts for the fleet tests on one machine: a bridge in the test's network namespace and, per host, a network
//! namespace joined to it by a veth pair, with its own address. Names and the /24 are unique per test process and
//! network; everything is deleted when the [`Network`] drops (on panic too), and only what it created.

#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use super::daemon::{require_daemon, Daemon, DaemonOpts};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// One host: its namespace (`/run/netns/<netns>`), the host-side end of its veth, and its address.
pub struct Host {
    pub netns: String,
    pub veth: String,
    pub ip: Ipv4Addr,
}

/// The bridge and the hosts on it.
pub struct Network {
    bridge: Option<String>,
    pub hosts: Vec<Host>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("run ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Network {
    /// A bridge with `n` hosts on it, or why it could not be made (what was made is deleted again).
    pub fn create(n: usize) -> Result<Network, String> {
        let pid = std::process::id();
        let k = NEXT.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{:05x}{k:x}", pid & 0xfffff);
        // 10.<100..249>.<0..249>.0/24 from the pid and the network's number.
        let (a, b) = (100 + (pid % 150) as u8, ((pid / 150 * 8 + k) % 250) as u8);
        let mut net = Network {
            bridge: None,
            hosts: Vec::new(),
        };
        let bridge = format!("sfb{tag}");
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        net.bridge = Some(bridge.clone());
        ip(&["addr", "add", &format!("10.{a}.{b}.1/24"), "dev", &bridge])?;
        ip(&["link", "set", &bridge, "up"])?;
        for i in 0..n {
            let host = Host {
                netns: format!("sandboxd-fleet-{tag}-{i}"),
                veth: format!("sfv{tag}{i}"),
                ip: Ipv4Addr::new(10, a, b, 10 + i as u8),
            };
            let peer = format!("sfp{tag}{i}");
            ip(&["netns", "add", &host.netns])?;
            let netns = host.netns.clone();
            net.hosts.push(host);
            let host = &net.hosts[i];
            ip(&[
                "link", "add", &host.veth, "type", "veth", "peer", "name", &peer,
            ])?;
            ip(&["link", "set", &peer, "netns", &netns])?;
            ip(&["link", "set", &host.veth, "master", &bridge, "up"])?;
            ip(&[
                "-n",
                &netns,
                "addr",
                "add",
                &format!("{}/24", host.ip),
                "dev",
                &peer,
            ])?;
            ip(&["-n", &netns, "link", "set", &peer, "up"])?;
            ip(&["-n", &netns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Cuts host `i` off (its link goes down; packets are lost, connections hang).
    pub fn partition(&self, i: usize) {
        ip(&["link", "set", &self.hosts[i].veth, "down"]).unwrap();
    }

    /// Joins host `i` again.
    pub fn heal(&self, i: usize) {
        ip(&["link", "set", &self.hosts[i].veth, "up"]).unwrap();
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for host in &self.hosts {
            // Deleting one end of a veth deletes both; deleting the namespace would too.
            let _ = ip(&["link", "del", &host.veth]);
            if let Err(e) = ip(&["netns", "del", &host.netns]) {
                eprintln!("netns: {e}");
            }
        }
        if let Some(bridge) = &self.bridge {
            if let Err(e) = ip(&["link", "del", bridge]) {
                eprintln!("netns: {e}");
            }
        }
    }
}

/// Three daemons on three hosts (real daemon: root), with one token, each with its own state directory, port,
/// cgroup parent and uid range; `None` after saying why it cannot run. The daemons drop (stop) before the network.
pub struct Hosts {
    pub daemons: Vec<Daemon>,
    pub net: Network,
    pub token: String,
}

pub async fn hosts(test: &str, max_concurrent: usize) -> Option<Hosts> {
    hosts_with(test, max_concurrent, 0).await
}

/// [`hosts`], with `pool_size` warm containers on each daemon.
pub async fn hosts_with(test: &str, max_concurrent: usize, pool_size: usize) -> Option<Hosts> {
    let bin = require_daemon(test)?;
    let net = match Network::create(3) {
        Ok(net) => net,
        Err(e) => {
            test_support::cannot_run(test, &format!("cannot create network namespaces: {e}"));
            return None;
        }
    };
    let token = format!("fleet-test-{:016x}", rand::random::<u64>());
    let mut daemons = Vec::new();
    for host in &net.hosts {
        let opts = DaemonOpts {
            max_concurrent,
            max_queue: 64,
            netns: Some(host.netns.clone()),
            host: host.ip.to_string(),
            token: Some(token.clone()),
            pool_size,
            ..DaemonOpts::default()
        };
        daemons.push(Daemon::start(&bin, opts).await);
    }
    Some(Hosts {
        daemons,
        net,
        token,
    })
}

impl Hosts {
    /// The daemons' endpoints.
    pub fn urls(&self) -> Vec<String> {
        self.daemons.iter().map(|d| d.url()).collect()
    }
}
