//! Loading `kvplane:plugin@0.1.0` placement-rule components on a 0.2.0 host.
//!
//! 0.2.0 changed every data-path world (backend, key-placement,
//! retry-policy) but left the placement-rule world's functions and records
//! as they were; only the shared `error` variant gained cases, which a 0.1.0
//! plugin never returns. So a 0.1.0 placement-rule component keeps loading:
//! its imports (`log`, `metrics`, the types-only `types`, all @0.1.0) are
//! linked here to the same host code, and its export is called through the
//! 0.2.0 records, which the component model checks structurally, with a
//! 0.1.0-shaped [`ErrorV1`] for its six error cases. Any other 0.1.0
//! component is refused at load with both versions and the world named.

use wasmtime::component::{ComponentType, Func, InstancePre, Lift, Linker, Lower};
use wasmtime::{AsContextMut, StoreContextMut};

use super::bindings::kvplane::plugin::{log, metrics};
use super::bindings::scheduling::{Placement, PodRequest};
use super::bindings::WitError;
use super::host::HostState;

/// `types.error` as 0.1.0 defined it.
#[derive(ComponentType, Lift, Lower, Clone, Debug, PartialEq)]
#[component(variant)]
pub enum ErrorV1 {
    #[component(name = "not-found")]
    NotFound,
    #[component(name = "timeout")]
    Timeout(String),
    #[component(name = "unavailable")]
    Unavailable(String),
    #[component(name = "invalid")]
    Invalid(String),
    #[component(name = "capacity")]
    Capacity(String),
    #[component(name = "internal")]
    Internal(String),
}

impl From<ErrorV1> for WitError {
    fn from(e: ErrorV1) -> WitError {
        match e {
            ErrorV1::NotFound => WitError::NotFound,
            ErrorV1::Timeout(m) => WitError::Timeout(m),
            ErrorV1::Unavailable(m) => WitError::Unavailable(m),
            ErrorV1::Invalid(m) => WitError::Invalid(m),
            ErrorV1::Capacity(m) => WitError::Capacity(m),
            ErrorV1::Internal(m) => WitError::Internal(m),
        }
    }
}

/// Link the 0.1.0 imports a placement-rule component may have.
pub(crate) fn link_v0_1(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    // Types-only interface: nothing to define, but the instance must exist.
    linker.instance("kvplane:plugin/types@0.1.0").map_err(anyhow::Error::from)?;
    let mut l = linker.instance("kvplane:plugin/log@0.1.0").map_err(anyhow::Error::from)?;
    l.func_wrap("log", |mut store: StoreContextMut<'_, HostState>, (level, message): (log::Level, String)| {
        log::Host::log(store.data_mut(), level, message)
    })
    .map_err(anyhow::Error::from)?;
    let mut m = linker.instance("kvplane:plugin/metrics@0.1.0").map_err(anyhow::Error::from)?;
    m.func_wrap("counter-add", |mut store: StoreContextMut<'_, HostState>, (name, delta): (String, u64)| {
        metrics::Host::counter_add(store.data_mut(), name, delta)
    })
    .map_err(anyhow::Error::from)?;
    m.func_wrap("gauge-set", |mut store: StoreContextMut<'_, HostState>, (name, value): (String, f64)| {
        metrics::Host::gauge_set(store.data_mut(), name, value)
    })
    .map_err(anyhow::Error::from)?;
    m.func_wrap("histogram-observe", |mut store: StoreContextMut<'_, HostState>, (name, value): (String, f64)| {
        metrics::Host::histogram_observe(store.data_mut(), name, value)
    })
    .map_err(anyhow::Error::from)?;
    Ok(())
}

type Config = Vec<(String, String)>;

/// Where the 0.1.0 `scheduling` export's functions are.
pub struct SchedulingV1Indices {
    configure: wasmtime::component::ComponentExportIndex,
    place: wasmtime::component::ComponentExportIndex,
}

impl SchedulingV1Indices {
    pub fn new(pre: &InstancePre<HostState>) -> wasmtime::Result<SchedulingV1Indices> {
        let component = pre.component();
        let iface = component
            .get_export_index(None, "kvplane:plugin/scheduling@0.1.0")
            .ok_or_else(|| wasmtime::Error::msg("no export kvplane:plugin/scheduling@0.1.0"))?;
        let func = |name: &str| {
            component
                .get_export_index(Some(&iface), name)
                .ok_or_else(|| wasmtime::Error::msg(format!("kvplane:plugin/scheduling@0.1.0 has no {name}")))
        };
        Ok(SchedulingV1Indices { configure: func("configure")?, place: func("place")? })
    }

    pub fn load(
        &self,
        mut store: impl AsContextMut<Data = HostState>,
        instance: &wasmtime::component::Instance,
    ) -> wasmtime::Result<SchedulingV1> {
        let missing = || wasmtime::Error::msg("kvplane:plugin/scheduling@0.1.0 export is not a function");
        let configure = instance.get_func(store.as_context_mut(), self.configure).ok_or_else(missing)?;
        let place = instance.get_func(store.as_context_mut(), self.place).ok_or_else(missing)?;
        // Type-check both now, so a mismatch is a load error, not a call fault.
        configure.typed::<(&Config,), (Result<(), ErrorV1>,)>(store.as_context_mut())?;
        place.typed::<(&PodRequest,), (Result<Placement, ErrorV1>,)>(store.as_context_mut())?;
        Ok(SchedulingV1 { configure, place })
    }
}

/// A 0.1.0 placement-rule instance's exports.
pub struct SchedulingV1 {
    configure: Func,
    place: Func,
}

impl SchedulingV1 {
    pub(crate) async fn call_configure(
        &self,
        mut store: impl AsContextMut<Data = HostState>,
        config: &Config,
    ) -> wasmtime::Result<Result<(), WitError>> {
        // Typed per call: a typed function's parameter lifetimes are fixed
        // when it is made, and these borrow the caller's arguments.
        let f = self.configure.typed::<(&Config,), (Result<(), ErrorV1>,)>(store.as_context_mut())?;
        let (r,) = f.call_async(store.as_context_mut(), (config,)).await?;
        Ok(r.map_err(WitError::from))
    }

    pub(crate) async fn call_place(
        &self,
        mut store: impl AsContextMut<Data = HostState>,
        request: &PodRequest,
    ) -> wasmtime::Result<Result<Placement, WitError>> {
        let f = self.place.typed::<(&PodRequest,), (Result<Placement, ErrorV1>,)>(store.as_context_mut())?;
        let (r,) = f.call_async(store.as_context_mut(), (request,)).await?;
        Ok(r.map_err(WitError::from))
    }
}
