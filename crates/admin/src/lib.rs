//! The admin HTTP server of every kvplane process (node and operator).
//!
//! Two routes on a maintained HTTP stack (axum on hyper): `/metrics` renders
//! the process's one Prometheus registry in the OpenMetrics text format, and
//! `/healthz` answers 200 while the process wants traffic and 503 with a
//! reason when it does not (a draining node). Everything a process measures
//! is registered in that one registry by the crate that measures it; this
//! crate only serves it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// What `/healthz` reports: `Ok(())` is healthy, `Err(reason)` is a 503
/// with the reason as the body.
pub type HealthCheck = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The content type of the OpenMetrics text exposition.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// How long one request may take; a scraper that stalls is cut off.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long [`AdminServer::stop`] waits for requests in progress.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

struct AdminState {
    registry: Arc<Registry>,
    health: HealthCheck,
}

/// A running admin server; dropping it stops it too.
pub struct AdminServer {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl AdminServer {
    /// Binds `addr` (port 0 picks a free port; [`AdminServer::addr`] tells
    /// which) and serves until [`AdminServer::stop`].
    pub async fn start(addr: SocketAddr, registry: Arc<Registry>, health: HealthCheck) -> anyhow::Result<AdminServer> {
        let listener = TcpListener::bind(addr).await.with_context(|| format!("binding the admin port {addr}"))?;
        let addr = listener.local_addr().context("reading the admin port's address")?;
        let state = Arc::new(AdminState { registry, health });
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .fallback(|| async { (StatusCode::NOT_FOUND, "try /metrics or /healthz\n") })
            .with_state(state)
            .layer(axum::middleware::from_fn(|request, next: axum::middleware::Next| async move {
                match tokio::time::timeout(REQUEST_TIMEOUT, next.run(request)).await {
                    Ok(response) => response,
                    Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "request timed out\n").into_response(),
                }
            }));
        let (shutdown, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = stopped.wait_for(|s| *s).await;
            });
            if let Err(e) = serve.await {
                tracing::warn!(error = %e, "admin server stopped");
            }
        });
        Ok(AdminServer { addr, shutdown, task })
    }

    /// The address actually bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and waits (a bounded time) for requests in progress.
    pub async fn stop(mut self) {
        let _ = self.shutdown.send(true);
        if tokio::time::timeout(STOP_TIMEOUT, &mut self.task).await.is_err() {
            self.task.abort();
        }
    }
}

impl Drop for AdminServer {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        self.task.abort();
    }
}

async fn metrics(State(state): State<Arc<AdminState>>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS)], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}\n")).into_response(),
    }
}

async fn healthz(State(state): State<Arc<AdminState>>) -> Response {
    match (state.health)() {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use prometheus_client::metrics::counter::Counter;

    use super::*;

    fn get(url: &str) -> (u16, String) {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut resp = agent.get(url).call().expect("the admin server answers");
        (resp.status().as_u16(), resp.body_mut().read_to_string().unwrap())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serves_the_registry_and_the_health_check() {
        let mut registry = Registry::default();
        let requests = Counter::<u64>::default();
        registry.register("kvplane_test_requests", "Requests seen by the test.", requests.clone());
        requests.inc_by(3);
        let healthy = Arc::new(AtomicBool::new(true));
        let h = Arc::clone(&healthy);
        let health: HealthCheck = Arc::new(move || if h.load(Ordering::Acquire) { Ok(()) } else { Err("draining".into()) });
        let server = AdminServer::start("127.0.0.1:0".parse().unwrap(), Arc::new(registry), health).await.unwrap();
        let base = format!("http://{}", server.addr());
        let (status, body) = tokio::task::spawn_blocking({
            let base = base.clone();
            move || get(&format!("{base}/metrics"))
        })
        .await
        .unwrap();
        assert_eq!(status, 200);
        assert!(body.contains("kvplane_test_requests_total 3"), "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");
        let (status, body) = tokio::task::spawn_blocking({
            let base = base.clone();
            move || get(&format!("{base}/healthz"))
        })
        .await
        .unwrap();
        assert_eq!((status, body.as_str()), (200, "ok\n"));
        healthy.store(false, Ordering::Release);
        let (status, body) = tokio::task::spawn_blocking({
            let base = base.clone();
            move || get(&format!("{base}/healthz"))
        })
        .await
        .unwrap();
        assert_eq!((status, body.as_str()), (503, "draining\n"));
        let (status, _) = tokio::task::spawn_blocking(move || get(&format!("{base}/nope"))).await.unwrap();
        assert_eq!(status, 404);
        server.stop().await;
    }
}
