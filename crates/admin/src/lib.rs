//! The admin HTTP server of every kvplane process (node and operator).
//!
//! Routes on a maintained HTTP stack (axum on hyper): `/metrics` renders
//! the process's one Prometheus registry in the OpenMetrics text format;
//! `/readyz` answers 200 while the process wants traffic and 503 with a
//! reason when it does not (a draining node, a node out of its cluster);
//! `/livez` answers 200 whenever it answers at all. Everything a process
//! measures is registered in that one registry by the crate that measures
//! it; this crate only serves it.
//!
//! Why two probes: Kubernetes restarts a container whose liveness probe
//! fails, and only stops routing to one whose readiness probe fails. A node
//! that is merely waiting (for etcd to answer, for its store, for a drain to
//! end) must not be restarted, which would throw away its memory tier and
//! solve nothing; a process whose runtime no longer runs handlers must be.
//! So liveness asks nothing but that the handler runs (its answer within
//! the request timeout is the check), and readiness asks the process.
//! `/healthz` stays as an alias of `/readyz`: it was the one probe before,
//! and deployments rendered then still point their readiness probe at it.
//!
//! The accept loop is our own (hyper's HTTP/1 connection server under it),
//! not `axum::serve`, because the port must stay cheap to hold for anyone
//! who can reach it: connections are capped ([`AdminLimits`]; past the cap
//! a connection is closed at once and counted), headers must arrive within
//! a timeout, each request is answered within another, and a kept-alive
//! connection lives a bounded time. Idle or slow scrapers therefore cannot
//! use up the process's file descriptors.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// What `/readyz` (and `/healthz`) reports: `Ok(())` is ready, `Err(reason)`
/// is a 503 with the reason as the body. Called on every probe, so it reads
/// state and never waits.
pub type HealthCheck = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The content type of the OpenMetrics text exposition.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// How long [`AdminServer::stop`] waits for requests in progress.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The bounds of the admin port.
#[derive(Debug, Clone, Copy)]
pub struct AdminLimits {
    /// Connections open at once; more are closed as they are accepted.
    pub max_connections: usize,
    /// How long a request's headers may take to arrive.
    pub header_timeout: Duration,
    /// How long one request may take to answer.
    pub request_timeout: Duration,
    /// How long one (kept-alive) connection may stay open.
    pub connection_lifetime: Duration,
}

impl Default for AdminLimits {
    fn default() -> Self {
        AdminLimits {
            max_connections: 64,
            header_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            connection_lifetime: Duration::from_secs(60),
        }
    }
}

/// The admin port's own series.
#[derive(Debug, Clone, Default)]
pub struct AdminMetrics {
    refused: Counter,
    open: Gauge,
}

impl AdminMetrics {
    /// Registers the series in the registry the server will serve.
    pub fn register(registry: &mut Registry) -> AdminMetrics {
        let m = AdminMetrics::default();
        registry.register(
            "kvplane_admin_connections_refused",
            "Admin connections closed at accept because the cap was reached",
            m.refused.clone(),
        );
        registry.register("kvplane_admin_connections_open", "Admin connections open now", m.open.clone());
        m
    }

    /// Admin connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.get()
    }
}

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
    /// which) and serves until [`AdminServer::stop`], with the default
    /// [`AdminLimits`] and series registered nowhere.
    pub async fn start(addr: SocketAddr, registry: Arc<Registry>, health: HealthCheck) -> anyhow::Result<AdminServer> {
        AdminServer::start_with(addr, registry, health, AdminLimits::default(), AdminMetrics::default()).await
    }

    /// As [`AdminServer::start`], within `limits`, counting in `metrics`
    /// (registered in `registry` by [`AdminMetrics::register`]).
    pub async fn start_with(
        addr: SocketAddr,
        registry: Arc<Registry>,
        health: HealthCheck,
        limits: AdminLimits,
        metrics: AdminMetrics,
    ) -> anyhow::Result<AdminServer> {
        let listener = TcpListener::bind(addr).await.with_context(|| format!("binding the admin port {addr}"))?;
        let addr = listener.local_addr().context("reading the admin port's address")?;
        let state = Arc::new(AdminState { registry, health });
        let request_timeout = limits.request_timeout;
        let app = Router::new()
            .route("/metrics", get(metrics_route))
            .route("/livez", get(livez))
            .route("/readyz", get(readyz))
            .route("/healthz", get(readyz))
            .fallback(|| async { (StatusCode::NOT_FOUND, "try /metrics, /livez or /readyz\n") })
            .with_state(state)
            .layer(axum::middleware::from_fn(move |request, next: axum::middleware::Next| async move {
                match tokio::time::timeout(request_timeout, next.run(request)).await {
                    Ok(response) => response,
                    Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "request timed out\n").into_response(),
                }
            }));
        let (shutdown, stopped) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, app, limits, metrics, stopped));
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

/// Accepts within the cap until stopped, then waits for the connections
/// still open (the caller bounds that wait).
async fn accept_loop(listener: TcpListener, app: Router, limits: AdminLimits, metrics: AdminMetrics, mut stopped: watch::Receiver<bool>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors: back off instead of spinning.
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            // Only `stop` (or the server's drop) sends, and only `true`.
            _ = stopped.changed() => break,
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            metrics.refused.inc();
            tracing::debug!(%peer, limit = limits.max_connections, "admin connection refused: at the cap");
            drop(stream);
            continue;
        };
        let (app, open) = (app.clone(), metrics.open.clone());
        conns.spawn(async move {
            open.inc();
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
            if let Ok(Err(e)) = tokio::time::timeout(limits.connection_lifetime, conn).await {
                tracing::debug!(%peer, error = %e, "admin connection ended");
            }
            open.dec();
            drop(slot);
        });
    }
    while conns.join_next().await.is_some() {}
}

async fn metrics_route(State(state): State<Arc<AdminState>>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS)], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}\n")).into_response(),
    }
}

/// Alive: this handler ran, on the runtime that serves everything else.
async fn livez() -> Response {
    (StatusCode::OK, "ok\n").into_response()
}

async fn readyz(State(state): State<Arc<AdminState>>) -> Response {
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

    /// `/readyz` follows the check, `/healthz` says the same, and `/livez`
    /// stays 200 while the process is not ready.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn liveness_holds_while_readiness_follows_the_check() {
        let ready = Arc::new(AtomicBool::new(true));
        let r = Arc::clone(&ready);
        let health: HealthCheck =
            Arc::new(move || if r.load(Ordering::Acquire) { Ok(()) } else { Err("member n0 is not registered in cluster c".into()) });
        let server = AdminServer::start("127.0.0.1:0".parse().unwrap(), Arc::new(Registry::default()), health).await.unwrap();
        let base = format!("http://{}", server.addr());
        let probe = |path: &'static str| {
            let base = base.clone();
            async move { tokio::task::spawn_blocking(move || get(&format!("{base}{path}"))).await.unwrap() }
        };
        for path in ["/livez", "/readyz", "/healthz"] {
            assert_eq!(probe(path).await, (200, "ok\n".to_string()), "{path} while ready");
        }
        ready.store(false, Ordering::Release);
        let not_ready = (503, "member n0 is not registered in cluster c\n".to_string());
        assert_eq!(probe("/readyz").await, not_ready);
        assert_eq!(probe("/healthz").await, not_ready, "/healthz is an alias of /readyz");
        assert_eq!(probe("/livez").await, (200, "ok\n".to_string()), "not ready is still alive");
        ready.store(true, Ordering::Release);
        assert_eq!(probe("/readyz").await.0, 200);
        let (status, body) = probe("/healthy").await;
        assert!(status == 404 && body.contains("/livez") && body.contains("/readyz"), "{status} {body}");
        server.stop().await;
    }

    /// Idle connections past the cap are closed at accept, those within it
    /// once their headers are late, and a scraper gets in afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_connections_are_capped_and_timed_out() {
        use std::io::Read as _;
        let mut registry = Registry::default();
        let metrics = AdminMetrics::register(&mut registry);
        let limits = AdminLimits { max_connections: 4, header_timeout: Duration::from_millis(300), ..AdminLimits::default() };
        let health: HealthCheck = Arc::new(|| Ok(()));
        let server =
            AdminServer::start_with("127.0.0.1:0".parse().unwrap(), Arc::new(registry), health, limits, metrics.clone()).await.unwrap();
        let addr = server.addr();
        let closed = tokio::task::spawn_blocking(move || {
            let conns: Vec<std::net::TcpStream> = (0..12).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
            conns
                .into_iter()
                .map(|mut c| {
                    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    // The end of the stream or a reset; a read timeout
                    // means the server kept it.
                    match c.read(&mut [0u8; 1]) {
                        Ok(0) => true,
                        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
                        Ok(_) => false,
                    }
                })
                .filter(|closed| *closed)
                .count()
        })
        .await
        .unwrap();
        assert_eq!(closed, 12, "every idle connection was closed");
        assert!(metrics.refused() >= 8, "{} refused at the cap", metrics.refused());
        let base = format!("http://{addr}");
        let (status, body) = tokio::task::spawn_blocking(move || get(&format!("{base}/metrics"))).await.unwrap();
        assert_eq!(status, 200);
        assert!(body.contains("kvplane_admin_connections_refused_total"), "{body}");
        server.stop().await;
    }
}
