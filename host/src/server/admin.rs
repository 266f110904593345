//! The admin port: `/metrics` (Prometheus text) and `/healthz`.
//!
//! A few lines of HTTP/1.1 by hand rather than an HTTP stack: two fixed GET
//! routes, one request per connection, bounded reads.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::NodeState;

/// Longest request head read before answering 431.
const MAX_REQUEST_HEAD: usize = 8 << 10;

pub(super) async fn serve(listener: TcpListener, state: Arc<NodeState>, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let state = Arc::clone(&state);
                    tokio::spawn(async move {
                        if let Err(e) = tokio::time::timeout(Duration::from_secs(5), answer(stream, &state)).await {
                            tracing::debug!(error = %e, "admin request timed out");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.changed() => return,
        }
    }
}

async fn answer(mut stream: TcpStream, state: &NodeState) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_REQUEST_HEAD {
            return respond(&mut stream, "431 Request Header Fields Too Large", "text/plain", "request head too large\n").await;
        }
    }
    let line = String::from_utf8_lossy(&head);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    match (method, path) {
        ("GET", "/metrics") => respond(&mut stream, "200 OK", "text/plain; version=0.0.4", &state.render_metrics()).await,
        ("GET", "/healthz") => {
            if state.is_draining() {
                respond(&mut stream, "503 Service Unavailable", "text/plain", "draining\n").await
            } else {
                respond(&mut stream, "200 OK", "text/plain", "ok\n").await
            }
        }
        ("GET", _) => respond(&mut stream, "404 Not Found", "text/plain", "try /metrics or /healthz\n").await,
        _ => respond(&mut stream, "405 Method Not Allowed", "text/plain", "only GET\n").await,
    }
}

async fn respond(stream: &mut TcpStream, status: &str, content_type: &str, body: &str) -> std::io::Result<()> {
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(msg.as_bytes()).await?;
    stream.shutdown().await
}
