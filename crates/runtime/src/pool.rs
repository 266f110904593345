//! Instances of one loaded plugin, and the guarded call into them.
//!
//! Each call checks out an instance (creating one from the `InstancePre` if
//! none is idle), runs under the declaration's deadline and memory cap, and
//! returns the instance to the pool only if the call ended cleanly. An
//! instance that trapped, timed out, hit its cap or answered out of contract
//! is dropped: its memory may be half-updated, and a fresh instance is cheap.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use wasmtime::component::InstancePre;
use wasmtime::{Store, Trap};

use super::bindings::{placement, retry, scheduling, store, WitError};
use super::decl::PluginDecl;
use super::engine::PluginEngine;
use super::error::{Fault, PluginError};
use super::host::{HostState, PluginShared};
use super::inspect::ComponentInfo;
use super::load::Loaded;

/// The exported interface of one world, as loaded from an instance.
pub trait GuestExports: Sized + Send + Sync + 'static {
    type Indices: Send + Sync + 'static;
    fn indices(pre: &InstancePre<HostState>) -> wasmtime::Result<Self::Indices>;
    fn load(indices: &Self::Indices, store: &mut Store<HostState>, instance: &wasmtime::component::Instance) -> wasmtime::Result<Self>;
    /// `open` / `configure`: run once on every fresh instance. The config is
    /// a `&Vec` because the generated bindings take one.
    #[allow(clippy::ptr_arg)]
    fn init<'a>(
        &'a self,
        store: &'a mut Store<HostState>,
        config: &'a Vec<(String, String)>,
    ) -> BoxFuture<'a, wasmtime::Result<Result<(), WitError>>>;
}

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

macro_rules! guest_exports {
    ($module:ident, $init:ident) => {
        impl GuestExports for $module::Guest {
            type Indices = $module::GuestIndices;
            fn indices(pre: &InstancePre<HostState>) -> wasmtime::Result<Self::Indices> {
                $module::GuestIndices::new(pre)
            }
            fn load(
                indices: &Self::Indices,
                store: &mut Store<HostState>,
                instance: &wasmtime::component::Instance,
            ) -> wasmtime::Result<Self> {
                indices.load(store, instance)
            }
            #[allow(clippy::ptr_arg)]
            fn init<'a>(
                &'a self,
                store: &'a mut Store<HostState>,
                config: &'a Vec<(String, String)>,
            ) -> BoxFuture<'a, wasmtime::Result<Result<(), WitError>>> {
                Box::pin(self.$init(store, config))
            }
        }
    };
}
guest_exports!(placement, call_configure);
guest_exports!(retry, call_configure);
guest_exports!(store, call_open);

/// A placement-rule instance's exports: 0.2.0, or 0.1.0 (see `compat`).
pub enum SchedulingGuest {
    V2(scheduling::Guest),
    V1(crate::compat::SchedulingV1),
}

pub enum SchedulingIndices {
    V2(scheduling::GuestIndices),
    V1(crate::compat::SchedulingV1Indices),
}

impl GuestExports for SchedulingGuest {
    type Indices = SchedulingIndices;
    fn indices(pre: &InstancePre<HostState>) -> wasmtime::Result<Self::Indices> {
        match scheduling::GuestIndices::new(pre) {
            Ok(i) => Ok(SchedulingIndices::V2(i)),
            Err(v2) => crate::compat::SchedulingV1Indices::new(pre).map(SchedulingIndices::V1).map_err(|_| v2),
        }
    }
    fn load(indices: &Self::Indices, store: &mut Store<HostState>, instance: &wasmtime::component::Instance) -> wasmtime::Result<Self> {
        Ok(match indices {
            SchedulingIndices::V2(i) => SchedulingGuest::V2(i.load(store, instance)?),
            SchedulingIndices::V1(i) => SchedulingGuest::V1(i.load(store, instance)?),
        })
    }
    #[allow(clippy::ptr_arg)]
    fn init<'a>(
        &'a self,
        store: &'a mut Store<HostState>,
        config: &'a Vec<(String, String)>,
    ) -> BoxFuture<'a, wasmtime::Result<Result<(), WitError>>> {
        match self {
            SchedulingGuest::V2(g) => Box::pin(g.call_configure(store, config)),
            SchedulingGuest::V1(g) => Box::pin(g.call_configure(store, config)),
        }
    }
}

impl SchedulingGuest {
    pub(crate) async fn call_place(
        &self,
        store: &mut Store<HostState>,
        request: &scheduling::PodRequest,
    ) -> wasmtime::Result<Result<scheduling::Placement, WitError>> {
        match self {
            SchedulingGuest::V2(g) => g.call_place(store, request).await,
            SchedulingGuest::V1(g) => g.call_place(store, request).await,
        }
    }
}

/// First wait after `open` / `configure` fails; doubled on each further
/// failure up to [`MAX_BROKEN_BACKOFF`].
pub(crate) const FIRST_BROKEN_BACKOFF: Duration = Duration::from_millis(100);
pub(crate) const MAX_BROKEN_BACKOFF: Duration = Duration::from_secs(30);

/// Why a plugin is broken and until when no new instance is tried.
#[derive(Debug, Clone)]
struct Broken {
    until: tokio::time::Instant,
    backoff: Duration,
    fault: Fault,
}

/// One live instance.
pub(crate) struct Instance<G> {
    pub(crate) store: Store<HostState>,
    pub(crate) guest: G,
}

/// A loaded plugin: its compiled component and its instance pool.
pub struct Plugin<G: GuestExports> {
    engine: Arc<PluginEngine>,
    shared: Arc<PluginShared>,
    pre: InstancePre<HostState>,
    indices: G::Indices,
    idle: Mutex<Vec<Instance<G>>>,
    /// Bounds concurrently running instances (and so the pool's memory).
    running: Semaphore,
    config: Vec<(String, String)>,
    /// Set while `open` / `configure` keeps failing: calls fail fast (and
    /// fall open where the policy says so) until the backoff has passed.
    broken: Mutex<Option<Broken>>,
    instantiations: AtomicU64,
    /// Call counter and histogram per function, resolved once.
    call_metrics: Mutex<Vec<(&'static str, crate::metrics::CallHandles)>>,
    pub info: ComponentInfo,
    pub from_cache: bool,
}

impl<G: GuestExports> Plugin<G> {
    pub(crate) fn new(engine: Arc<PluginEngine>, decl: PluginDecl, loaded: Loaded) -> Result<Self, super::error::LoadError> {
        let indices =
            G::indices(&loaded.pre).map_err(|e| super::error::LoadError::Link { plugin: decl.name.clone(), reason: format!("{e:#}") })?;
        let config = decl.config.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let running = Semaphore::new(decl.limits.max_instances.max(1));
        let shared = PluginShared::new(decl);
        engine.metrics.track(&shared);
        Ok(Plugin {
            engine,
            shared,
            pre: loaded.pre,
            indices,
            idle: Mutex::new(Vec::new()),
            running,
            config,
            broken: Mutex::new(None),
            instantiations: AtomicU64::new(0),
            call_metrics: Mutex::new(Vec::new()),
            info: loaded.info,
            from_cache: loaded.from_cache,
        })
    }

    pub fn decl(&self) -> &PluginDecl {
        &self.shared.decl
    }

    pub fn shared(&self) -> &Arc<PluginShared> {
        &self.shared
    }

    /// The host's counters for this runtime's plugins.
    pub(crate) fn metrics(&self) -> &crate::metrics::RuntimeMetrics {
        &self.engine.metrics
    }

    /// Instances currently idle in the pool.
    pub fn idle_instances(&self) -> usize {
        self.idle.lock().map(|i| i.len()).unwrap_or(0)
    }

    /// Instances created so far (a broken plugin is not re-instantiated on
    /// every call).
    pub fn instantiations(&self) -> u64 {
        self.instantiations.load(Ordering::Relaxed)
    }

    /// Create one instance and run its `open` / `configure` now, keeping it
    /// for the first call: a node checks every declared plugin this way
    /// before it serves.
    pub async fn warm_up(&self) -> Result<(), PluginError> {
        let instance = self.fresh_instance().await?;
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(instance);
        }
        Ok(())
    }

    /// This plugin's call metrics for `function`, resolved on first use.
    fn call_handles(&self, function: &'static str) -> crate::metrics::CallHandles {
        let mut cache = self.call_metrics.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, h)) = cache.iter().find(|(f, _)| *f == function) {
            return h.clone();
        }
        let h = self.engine.metrics.call_handles(&self.shared.decl.name, function);
        cache.push((function, h.clone()));
        h
    }

    fn error(&self, function: &'static str, fault: Fault) -> PluginError {
        PluginError { plugin: self.shared.decl.name.clone(), function, fault }
    }

    fn arm(&self, store: &mut Store<HostState>) {
        let timeout = self.shared.decl.limits.timeout;
        store.data_mut().deadline = Some(tokio::time::Instant::now() + timeout);
        store.set_epoch_deadline(PluginEngine::ticks_for(timeout));
    }

    async fn fresh_instance(&self) -> Result<Instance<G>, PluginError> {
        if let Some(b) = self.broken.lock().ok().and_then(|b| b.clone()) {
            let now = tokio::time::Instant::now();
            if now < b.until {
                return Err(self.error("configure", Fault::Broken { cause: Box::new(b.fault), retry_in: b.until - now }));
            }
        }
        self.instantiations.fetch_add(1, Ordering::Relaxed);
        let result = self.instantiate().await;
        if let Ok(mut broken) = self.broken.lock() {
            match &result {
                Ok(_) => *broken = None,
                Err(e) => {
                    let backoff = broken.as_ref().map_or(FIRST_BROKEN_BACKOFF, |b| (b.backoff * 2).min(MAX_BROKEN_BACKOFF));
                    tracing::warn!(plugin = %self.shared.decl.name, "plugin is broken, next try in {backoff:?}: {e}");
                    *broken = Some(Broken { until: tokio::time::Instant::now() + backoff, backoff, fault: e.fault.clone() });
                }
            }
        }
        result
    }

    async fn instantiate(&self) -> Result<Instance<G>, PluginError> {
        let state = HostState::new(self.shared.clone()).map_err(|e| self.error("instantiate", Fault::Instantiate(format!("{e:#}"))))?;
        let mut store = Store::new(&self.engine.engine, state);
        store.limiter(|s| &mut s.memory);
        store.epoch_deadline_trap();
        self.arm(&mut store);
        let timeout = self.shared.decl.limits.timeout;
        let started = tokio::time::timeout(timeout, async {
            let instance = self.pre.instantiate_async(&mut store).await?;
            let guest = G::load(&self.indices, &mut store, &instance)?;
            let configured = guest.init(&mut store, &self.config).await?;
            wasmtime::Result::Ok((guest, configured))
        })
        .await;
        match started {
            Err(_) => Err(self.error("instantiate", Fault::Deadline { timeout })),
            Ok(Err(e)) => Err(self.error("instantiate", classify(&store, e))),
            Ok(Ok((_, Err(e)))) => Err(self.error("configure", Fault::Configure(e.into()))),
            Ok(Ok((guest, Ok(())))) => Ok(Instance { store, guest }),
        }
    }

    /// Run `call` on an instance under the declaration's deadline. `call`
    /// returns the guest's answer or a `Fault` it found in that answer.
    pub(crate) async fn call<R: Send>(
        &self,
        function: &'static str,
        call: impl for<'a> FnOnce(&'a mut Instance<G>) -> BoxFuture<'a, wasmtime::Result<Result<R, Fault>>>,
    ) -> Result<R, PluginError> {
        let started = std::time::Instant::now();
        let result = self.call_inner(function, call).await;
        let fault = result.as_ref().err().map(|e| &e.fault);
        let handles = self.call_handles(function);
        self.engine.metrics.record_call(&self.shared.decl.name, function, &handles, started.elapsed(), fault);
        result
    }

    async fn call_inner<R: Send>(
        &self,
        function: &'static str,
        call: impl for<'a> FnOnce(&'a mut Instance<G>) -> BoxFuture<'a, wasmtime::Result<Result<R, Fault>>>,
    ) -> Result<R, PluginError> {
        let _permit =
            self.running.acquire().await.map_err(|_| self.error(function, Fault::Instantiate("the plugin is shutting down".into())))?;
        let pooled = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        let mut instance = match pooled {
            Some(i) => i,
            None => self.fresh_instance().await?,
        };
        self.arm(&mut instance.store);
        let timeout = self.shared.decl.limits.timeout;
        // The epoch deadline stops guest code; this timeout stops host I/O
        // the guest is waiting on. A little slack lets the epoch trap win
        // when both fire, so the error says what the guest was doing.
        let outcome = tokio::time::timeout(timeout + timeout / 10 + super::engine::EPOCH_TICK * 2, call(&mut instance)).await;
        let fault = match outcome {
            Ok(Ok(Ok(value))) => {
                instance.store.data_mut().deadline = None;
                self.give_back(instance, function);
                return Ok(value);
            }
            Ok(Ok(Err(fault))) => fault,
            Ok(Err(e)) => classify(&instance.store, e),
            Err(_) => Fault::Deadline { timeout },
        };
        // Any fault — even a contract error found in the output — retires the
        // instance: its state can no longer be trusted.
        if fault.is_breakage() {
            tracing::warn!(plugin = %self.shared.decl.name, function, "dropping plugin instance: {fault}");
            drop(instance);
        } else {
            self.give_back(instance, function);
        }
        Err(self.error(function, fault))
    }

    /// Return an instance to the pool after a call, unless the `handles`
    /// limit refused it: the handles it holds and never dropped (a lent
    /// destination kept, views never released) stay spent, and an instance
    /// that cannot be lent a handle would fail every later call. A fresh
    /// instance replaces it on the next call.
    fn give_back(&self, instance: Instance<G>, function: &'static str) {
        let state = instance.store.data();
        if state.handles_exhausted {
            tracing::warn!(
                plugin = %self.shared.decl.name,
                function,
                handles = state.usage.handles,
                "dropping plugin instance: its handles limit ({}) was reached and it holds {} handles",
                self.shared.decl.limits.handles,
                state.usage.handles
            );
            self.shared.hit_limit("handles-recycled");
            return;
        }
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(instance);
        }
    }
}

/// Turn a wasmtime error from a call into the fault a person can act on.
fn classify(store: &Store<HostState>, error: wasmtime::Error) -> Fault {
    let state = store.data();
    if state.memory.hit {
        return Fault::MemoryCap { limit: state.memory.limit };
    }
    match error.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => Fault::Deadline { timeout: state.shared.decl.limits.timeout },
        Some(Trap::StackOverflow) => Fault::StackOverflow,
        Some(trap) => {
            let stderr = state.stderr_text();
            let message = if stderr.is_empty() { trap.to_string() } else { format!("{trap}; stderr: {stderr}") };
            Fault::Trap { message }
        }
        None => Fault::Trap { message: format!("{error:#}") },
    }
}
