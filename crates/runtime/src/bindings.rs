//! Generated bindings for the `kvplane:plugin@0.2.0` contract.
//!
//! One synthetic world imports every host interface and exports every plugin
//! interface, so each host interface is implemented once; each plugin world
//! is then linked with only its own imports (`engine.rs`) and loaded through
//! the `GuestIndices` of the one interface it exports. Hand-written host code
//! lives beside this module, never in it; only the conversions between the
//! contract's errors and members and the host's own live here.
//!
//! Private to the runtime: the rest of the host calls the typed handles of
//! `worlds`, which take and answer hand-written types (`worlds`,
//! `scheduling`, [`KvError`](kvplane_protocol::KvError)) converted at that
//! boundary, so no other crate depends on what the generator emits.

wasmtime::component::bindgen!({
    path: "../../wit",
    inline: "
        package kvplane:host;

        world plugin-host {
            import kvplane:plugin/buffers@0.2.0;
            import kvplane:plugin/transport@0.2.0;
            import kvplane:plugin/driver@0.2.0;
            import kvplane:plugin/log@0.2.0;
            import kvplane:plugin/clock@0.2.0;
            import kvplane:plugin/metrics@0.2.0;
            export kvplane:plugin/store@0.2.0;
            export kvplane:plugin/placement@0.2.0;
            export kvplane:plugin/retry@0.2.0;
            export kvplane:plugin/scheduling@0.2.0;
        }
    ",
    imports: {
        "kvplane:plugin/transport": async | trappable,
        "kvplane:plugin/driver": async | trappable,
        default: trappable,
    },
    exports: { default: async },
    additional_derives: [PartialEq],
    with: {
        "kvplane:plugin/buffers.buffer": crate::buffer::BlockBuffer,
        "kvplane:plugin/transport.connection": crate::transport::PluginConnection,
        "kvplane:plugin/driver.session": crate::driver::DriverSession,
    },
});

pub(crate) use exports::kvplane::plugin::{placement, retry, scheduling, store};
pub(crate) use kvplane::plugin::types::{
    BackendFeatures, Busy, CallOptions, Error as WitError, Member as WitMember, MemberState as WitMemberState,
};

impl From<WitError> for kvplane_protocol::KvError {
    fn from(e: WitError) -> Self {
        use kvplane_protocol::KvError;
        match e {
            WitError::NotFound => KvError::NotFound,
            WitError::Timeout(m) => KvError::Timeout(m),
            WitError::Unavailable(m) => KvError::Unavailable(m),
            WitError::Invalid(m) => KvError::Invalid(m),
            WitError::Capacity(m) => KvError::Capacity(m),
            WitError::Internal(m) => KvError::Internal(m),
            WitError::Unsupported(m) => KvError::Unsupported(m),
            WitError::Busy(b) => KvError::Busy { retry_after_ms: b.retry_after_ms, message: b.message },
            WitError::Denied(m) => KvError::Denied(m),
        }
    }
}

impl From<kvplane_protocol::KvError> for WitError {
    fn from(e: kvplane_protocol::KvError) -> Self {
        use kvplane_protocol::KvError;
        match e {
            KvError::NotFound => WitError::NotFound,
            KvError::Timeout(m) => WitError::Timeout(m),
            KvError::Unavailable(m) => WitError::Unavailable(m),
            KvError::Invalid(m) => WitError::Invalid(m),
            KvError::Capacity(m) => WitError::Capacity(m),
            KvError::Internal(m) => WitError::Internal(m),
            KvError::Unsupported(m) => WitError::Unsupported(m),
            KvError::Busy { retry_after_ms, message } => WitError::Busy(Busy { retry_after_ms, message }),
            KvError::Denied(m) => WitError::Denied(m),
            // The contract has no `corrupt` case (a host-side check failed,
            // not the plugin's own error): a policy sees it as internal.
            KvError::Corrupt(m) => WitError::Internal(format!("corrupt: {m}")),
        }
    }
}

impl From<kvplane_slots::MemberState> for WitMemberState {
    fn from(s: kvplane_slots::MemberState) -> Self {
        use kvplane_slots::MemberState as S;
        match s {
            S::Joining => WitMemberState::Joining,
            S::Up => WitMemberState::Up,
            S::Draining => WitMemberState::Draining,
            S::Down => WitMemberState::Down,
        }
    }
}

impl From<&kvplane_slots::Member> for WitMember {
    fn from(m: &kvplane_slots::Member) -> Self {
        WitMember {
            id: m.id.clone(),
            endpoint: m.endpoint.clone(),
            zone: m.zone.clone(),
            weight: m.weight,
            state: m.state.into(),
            labels: m.labels.clone(),
        }
    }
}

impl From<&kvplane_protocol::KvError> for WitError {
    fn from(e: &kvplane_protocol::KvError) -> Self {
        e.clone().into()
    }
}
