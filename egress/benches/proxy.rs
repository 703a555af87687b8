//! `cargo bench -p sandboxd-egress --bench proxy`: what going through the egress proxy costs, against the same
//! traffic sent straight to the origin, both measured in the same run.
//!
//! Everything runs in one process on loopback: an HTTP origin served in plain text and over TLS (a self-signed
//! certificate for `origin.test`, the bench's clients trusting it), a [`egress::Proxy`] allowing `origin.test` on
//! those two ports (a `StaticResolver` maps the name to 127.0.0.1, `AddressPolicy::exempt_for_tests` permits
//! exactly the origin's two addresses), and the clients (hyper's HTTP/1.1 client connection, rustls through
//! tokio-rustls), all on one multi-threaded tokio runtime with a worker per core. Client sockets set
//! `TCP_NODELAY`, as HTTP clients do; the origin's too; the proxy's are left as the proxy sets them.
//!
//! Each measurement alternates a proxied and a direct sample (pair `i` takes the proxied one first when `i` is
//! even, the direct one first when odd), after untimed warm-up pairs (100 before each latency measurement, 20 in
//! quick mode; one before each download measurement), and prints:
//! 1. plain HTTP: `GET http://origin.test:PORT/small` (an 18-byte body) in absolute form through the proxy against
//!    `GET /small` straight to the origin, until the last body byte: over one kept-alive connection each (the
//!    proxy still opens an upstream connection per request), then over a new connection per request; p50, p90,
//!    p99 of each and the median of the paired differences;
//! 2. CONNECT: from opening a connection to the proxy, `CONNECT origin.test:PORT`, to the TLS handshake with the
//!    origin completed through the tunnel, against a TCP connect and the same handshake straight to the origin;
//!    full handshakes (client session resumption off); the same figures, and the time to the proxy's 200;
//! 3. throughput: `GET /big` (100 MB, 10^6-byte MB) over HTTPS through a CONNECT tunnel against HTTPS straight to
//!    the origin, then over plain HTTP through the proxy against plain HTTP straight to the origin; 5 rounds each,
//!    a new connection per round, timed from sending the request to the last body byte (connection setup is what
//!    part 2 measures); median, min and max MB/s and the ratio of the medians, proxied over direct.
//!
//! 4. the byte limit kept in a ledger (live restore): `/big` through a CONNECT tunnel of a second proxy whose limit
//!    (1 TB) is reserved 4 MiB at a time in a file on disk (8 bytes written in place, as `egress.reserved` is),
//!    against a third proxy with the same limit and no ledger; the same figures, and the reservations written.
//!
//! `EGRESS_BENCH_QUICK=1` shrinks the counts (200 pairs, 10 MB) for a smoke run. Figures, not assertions: nothing
//! here fails on a slow machine; a request that fails, answers an unexpected status or body length, or takes
//! longer than its timeout stops the bench with the error.

mod support;

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;
use support::{get, http1, tcp, tls, tls_config, tunnel, Origin, HOST, SMALL_BODY};

/// How long one latency sample (setup included) may take before the bench gives up.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one download round (setup included) may take.
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(300);
const MB: f64 = 1e6;

/// How much the run measures.
struct Plan {
    quick: bool,
    /// Pairs of each plain HTTP measurement.
    http_pairs: usize,
    /// Pairs of the CONNECT measurement.
    connect_pairs: usize,
    /// Untimed pairs before each latency measurement.
    warmup: usize,
    /// Bytes of each download.
    download: u64,
    /// Rounds of each download measurement.
    rounds: usize,
}

impl Plan {
    fn from_env() -> Plan {
        let quick = std::env::var("EGRESS_BENCH_QUICK").is_ok_and(|v| v == "1");
        match quick {
            true => Plan {
                quick,
                http_pairs: 200,
                connect_pairs: 200,
                warmup: 20,
                download: 10_000_000,
                rounds: 5,
            },
            false => Plan {
                quick,
                http_pairs: 5_000,
                connect_pairs: 2_000,
                warmup: 100,
                download: 100_000_000,
                rounds: 5,
            },
        }
    }
}

/// The samples of one interleaved measurement, pair by pair.
struct Pairs {
    proxied: Vec<Duration>,
    direct: Vec<Duration>,
}

/// Runs `warmup` untimed pairs, then `n` pairs alternating which side goes first. Each side reports the time it
/// measured itself (so each call site shows what is timed); `limit` bounds a whole call, setup included.
async fn interleave(
    n: usize,
    warmup: usize,
    limit: Duration,
    mut proxied: impl AsyncFnMut() -> anyhow::Result<Duration>,
    mut direct: impl AsyncFnMut() -> anyhow::Result<Duration>,
) -> anyhow::Result<Pairs> {
    for _ in 0..warmup {
        bounded(limit, proxied()).await.context("proxied warm-up")?;
        bounded(limit, direct()).await.context("direct warm-up")?;
    }
    let mut pairs = Pairs {
        proxied: Vec::with_capacity(n),
        direct: Vec::with_capacity(n),
    };
    for i in 0..n {
        let (p, d) = if i % 2 == 0 {
            let p = bounded(limit, proxied()).await.context("proxied")?;
            (p, bounded(limit, direct()).await.context("direct")?)
        } else {
            let d = bounded(limit, direct()).await.context("direct")?;
            (bounded(limit, proxied()).await.context("proxied")?, d)
        };
        pairs.proxied.push(p);
        pairs.direct.push(d);
    }
    Ok(pairs)
}

async fn bounded<T>(
    limit: Duration,
    op: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::time::timeout(limit, op)
        .await
        .with_context(|| format!("timed out after {limit:?}"))?
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The nearest-rank percentile `p` of `values` (sorted here).
fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

fn median(values: &[f64]) -> f64 {
    percentile(&mut values.to_vec(), 50.0)
}

fn latency_row(label: &str, samples: &[Duration]) {
    let mut us: Vec<f64> = samples.iter().copied().map(micros).collect();
    println!(
        "  {label:<42}{:>10.1}{:>10.1}{:>10.1}",
        percentile(&mut us, 50.0),
        percentile(&mut us, 90.0),
        percentile(&mut us, 99.0),
    );
}

fn latency_header(title: &str) {
    println!("\n{title}");
    println!(
        "  {:<42}{:>10}{:>10}{:>10}",
        "", "p50 µs", "p90 µs", "p99 µs"
    );
}

/// The rows of one measurement, and the median of its paired differences.
fn latency_report(what: &str, pairs: &Pairs) {
    latency_row(&format!("{what}, proxied"), &pairs.proxied);
    latency_row(&format!("{what}, direct"), &pairs.direct);
    let differences: Vec<f64> = pairs
        .proxied
        .iter()
        .zip(&pairs.direct)
        .map(|(p, d)| micros(*p) - micros(*d))
        .collect();
    println!(
        "  {:<42}{:>+10.1}",
        format!("{what}, median(proxied − direct)"),
        median(&differences)
    );
}

/// Part 1: a small plain HTTP GET, kept-alive connections then a new connection per request.
async fn http_latency(plan: &Plan, origin: &Origin, proxy: SocketAddr) -> anyhow::Result<()> {
    let host = format!("{HOST}:{}", origin.plain.port());
    let absolute = format!("http://{host}/small");
    let want = SMALL_BODY.len() as u64;
    let (n, warmup) = (plan.http_pairs, plan.warmup);

    let mut via_proxy = http1(tcp(proxy).await?).await?;
    let mut to_origin = http1(tcp(origin.plain).await?).await?;
    let kept = interleave(
        n,
        warmup,
        SAMPLE_TIMEOUT,
        async || {
            let start = Instant::now();
            get(&mut via_proxy, &absolute, &host, want).await?;
            Ok(start.elapsed())
        },
        async || {
            let start = Instant::now();
            get(&mut to_origin, "/small", &host, want).await?;
            Ok(start.elapsed())
        },
    )
    .await
    .context("plain HTTP, kept-alive")?;

    let fresh = interleave(
        n,
        warmup,
        SAMPLE_TIMEOUT,
        async || {
            let start = Instant::now();
            let mut sender = http1(tcp(proxy).await?).await?;
            get(&mut sender, &absolute, &host, want).await?;
            Ok(start.elapsed())
        },
        async || {
            let start = Instant::now();
            let mut sender = http1(tcp(origin.plain).await?).await?;
            get(&mut sender, "/small", &host, want).await?;
            Ok(start.elapsed())
        },
    )
    .await
    .context("plain HTTP, new connections")?;

    latency_header(&format!(
        "1. plain HTTP GET /small ({want} B body) to the last byte, {n} pairs"
    ));
    latency_report("kept-alive", &kept);
    latency_report("new connection", &fresh);
    Ok(())
}

/// Part 2: connection to the proxy, CONNECT and TLS handshake through the tunnel, against TCP connect and TLS
/// handshake straight to the origin.
async fn connect_latency(plan: &Plan, origin: &Origin, proxy: SocketAddr) -> anyhow::Result<()> {
    let config = tls_config(&origin.cert)?;
    let target = format!("{HOST}:{}", origin.tls.port());
    let (n, warmup) = (plan.connect_pairs, plan.warmup);
    // Time to the proxy's 200, every proxied sample's (the warm-up's first).
    let mut answered = Vec::with_capacity(warmup + n);
    let pairs = interleave(
        n,
        warmup,
        SAMPLE_TIMEOUT,
        async || {
            let start = Instant::now();
            let stream = tunnel(proxy, &target).await?;
            answered.push(start.elapsed());
            tls(stream, &config).await?;
            Ok(start.elapsed())
        },
        async || {
            let start = Instant::now();
            tls(tcp(origin.tls).await?, &config).await?;
            Ok(start.elapsed())
        },
    )
    .await
    .context("CONNECT")?;

    let probe = tls(tcp(origin.tls).await?, &config).await?;
    let session = probe.get_ref().1;
    latency_header(&format!(
        "2. connect + TLS handshake with {HOST} ({:?}, {:?}, full handshakes), {n} pairs",
        session
            .protocol_version()
            .context("no negotiated version")?,
        session
            .negotiated_cipher_suite()
            .context("no negotiated suite")?
            .suite(),
    ));
    latency_report("CONNECT + TLS", &pairs);
    anyhow::ensure!(
        answered.len() == warmup + n,
        "a proxied sample went untimed"
    );
    latency_row("  of which CONNECT until its 200", &answered[warmup..]);
    Ok(())
}

/// One download measurement's line: median, min and max MB/s of each side, and the ratio of the medians.
fn throughput_report(what: &str, size: u64, pairs: &Pairs) {
    let rates = |samples: &[Duration]| -> Vec<f64> {
        samples
            .iter()
            .map(|d| size as f64 / MB / d.as_secs_f64())
            .collect()
    };
    let (proxied, direct) = (rates(&pairs.proxied), rates(&pairs.direct));
    let row = |side: &str, r: &[f64]| {
        let mut r = r.to_vec();
        println!(
            "  {:<42}{:>10.0}{:>10.0}{:>10.0}",
            format!("{what}, {side}"),
            percentile(&mut r, 50.0),
            percentile(&mut r, 0.0),
            percentile(&mut r, 100.0),
        );
    };
    row("proxied", &proxied);
    row("direct", &direct);
    println!(
        "  {:<42}{:>10.2}",
        format!("{what}, proxied / direct"),
        median(&proxied) / median(&direct)
    );
}

/// Part 3: `/big` through a CONNECT tunnel against HTTPS direct, then plain HTTP through the proxy against direct.
async fn throughput(plan: &Plan, origin: &Origin, proxy: SocketAddr) -> anyhow::Result<()> {
    let config = tls_config(&origin.cert)?;
    let size = plan.download;
    let tls_host = format!("{HOST}:{}", origin.tls.port());
    let plain_host = format!("{HOST}:{}", origin.plain.port());
    let absolute = format!("http://{plain_host}/big");

    let tunnelled = interleave(
        plan.rounds,
        1,
        DOWNLOAD_TIMEOUT,
        async || {
            let mut sender = http1(tls(tunnel(proxy, &tls_host).await?, &config).await?).await?;
            let start = Instant::now();
            get(&mut sender, "/big", &tls_host, size).await?;
            Ok(start.elapsed())
        },
        async || {
            let mut sender = http1(tls(tcp(origin.tls).await?, &config).await?).await?;
            let start = Instant::now();
            get(&mut sender, "/big", &tls_host, size).await?;
            Ok(start.elapsed())
        },
    )
    .await
    .context("HTTPS download")?;

    let plain = interleave(
        plan.rounds,
        1,
        DOWNLOAD_TIMEOUT,
        async || {
            let mut sender = http1(tcp(proxy).await?).await?;
            let start = Instant::now();
            get(&mut sender, &absolute, &plain_host, size).await?;
            Ok(start.elapsed())
        },
        async || {
            let mut sender = http1(tcp(origin.plain).await?).await?;
            let start = Instant::now();
            get(&mut sender, "/big", &plain_host, size).await?;
            Ok(start.elapsed())
        },
    )
    .await
    .context("plain HTTP download")?;

    println!(
        "\n3. download of GET /big ({} MB), {} rounds each",
        size as f64 / MB,
        plan.rounds
    );
    println!(
        "  {:<42}{:>10}{:>10}{:>10}",
        "", "med MB/s", "min MB/s", "max MB/s"
    );
    throughput_report("HTTPS, CONNECT tunnel", size, &tunnelled);
    throughput_report("plain HTTP", size, &plain);
    Ok(())
}

/// Part 4: a tunnel through a proxy whose byte limit is kept in a ledger, against one whose limit is not.
async fn ledger(plan: &Plan, origin: &Origin) -> anyhow::Result<()> {
    let limits = egress::ProxyLimits {
        egress_bytes: Some(1_000_000_000_000),
        ..egress::ProxyLimits::default()
    };
    let book = std::sync::Arc::new(support::FileLedger::new()?);
    let ledger = egress::Ledger {
        spent: 0,
        chunk: 4 << 20,
        reserve: book.clone(),
    };
    let (_kept, kept_addr) = support::proxy_with(origin, limits.clone(), Some(ledger)).await?;
    let (_plain, plain_addr) = support::proxy_with(origin, limits, None).await?;
    let config = tls_config(&origin.cert)?;
    let size = plan.download;
    let tls_host = format!("{HOST}:{}", origin.tls.port());
    let download = async |proxy: SocketAddr| -> anyhow::Result<Duration> {
        let mut sender = http1(tls(tunnel(proxy, &tls_host).await?, &config).await?).await?;
        let start = Instant::now();
        get(&mut sender, "/big", &tls_host, size).await?;
        Ok(start.elapsed())
    };
    let pairs = interleave(
        plan.rounds,
        1,
        DOWNLOAD_TIMEOUT,
        async || download(kept_addr).await,
        async || download(plain_addr).await,
    )
    .await
    .context("download with a ledger")?;
    println!(
        "\n4. the byte limit kept in a ledger: GET /big ({} MB) through a CONNECT tunnel, {} rounds each; \
         \"proxied\" is the proxy with the ledger, \"direct\" the proxy without",
        size as f64 / MB,
        plan.rounds
    );
    throughput_report("HTTPS, limit in a ledger", size, &pairs);
    println!(
        "  reservations written: {}",
        book.written.load(std::sync::atomic::Ordering::Relaxed)
    );
    Ok(())
}

async fn run(plan: Plan) -> anyhow::Result<()> {
    let origin = support::origin(plan.download).await?;
    let (proxy, proxy_addr) = support::proxy(&origin).await?;
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    println!("egress proxy bench: cargo bench -p sandboxd-egress --bench proxy");
    println!(
        "mode: {} (EGRESS_BENCH_QUICK=1 for the quick one); {workers} tokio workers shared by client, proxy and \
         origin; loopback; order alternating per pair",
        if plan.quick { "quick" } else { "full" },
    );
    http_latency(&plan, &origin, proxy_addr).await?;
    connect_latency(&plan, &origin, proxy_addr).await?;
    throughput(&plan, &origin, proxy_addr).await?;
    ledger(&plan, &origin).await?;
    let stats = proxy.stats();
    println!(
        "\nproxy counters: {} client connections, {} upstream, {} refused, {:.1} MB sent, {:.1} MB received",
        stats.connections,
        stats.upstream_connections,
        stats.refused,
        stats.bytes_sent as f64 / MB,
        stats.bytes_received as f64 / MB,
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(run(Plan::from_env()))
}
