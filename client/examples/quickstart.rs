//! The client quick start (docs/clients.md): one execution collected, one streamed, through a pool.

use client::{
    new_execution_id, Execute, ExecuteRequest, Language, Pool, RequestedLimits, ServerMessage,
};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The local daemon's defaults, as sandboxctl uses them.
    let url = std::env::var("SANDBOXD_URL").unwrap_or_else(|_| client::DEFAULT_URL.to_owned());
    let token = match std::env::var("SANDBOXD_TOKEN") {
        Ok(token) => token,
        Err(_) => tokio::fs::read_to_string(client::DEFAULT_TOKEN_FILE).await?,
    };
    let pool = Pool::builder(url)
        .token(token.trim())
        .size(5)
        .max_overflow(10)
        .build()?;

    // Collected: stdout and stderr bytes, status, reason, exit code, duration, resource usage.
    let request = ExecuteRequest::new(
        new_execution_id(),
        Language::Python,
        "print(6 * 7)",
        RequestedLimits::new(5_000, 128),
    );
    match pool.execute(request).await {
        Ok(r) => println!(
            "{:?}, exit {:?}: {}",
            r.status,
            r.exit_code,
            r.stdout_text()
        ),
        Err(e) if e.is_retryable() => eprintln!("unavailable, try again later: {e}"),
        Err(e) => eprintln!("failed: {e}"),
    }

    // Streamed: each event as it arrives.
    let request = ExecuteRequest::new(
        new_execution_id(),
        Language::Shell,
        "for i in 1 2 3; do echo $i; sleep 0.2; done",
        RequestedLimits::new(5_000, 64),
    );
    let mut execution = pool.execute_stream(request).await?;
    while let Some(event) = execution.next().await {
        match event?.message {
            ServerMessage::Stdout(chunk) => print!("{}", String::from_utf8_lossy(&chunk.decode()?)),
            ServerMessage::Result(r) => println!("done in {} ms", r.duration_ms),
            _ => {}
        }
    }
    Ok(())
}
