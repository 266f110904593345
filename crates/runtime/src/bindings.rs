//! Generated bindings for the `kvplane:plugin` contract.
//!
//! One synthetic world imports every host interface and exports every plugin
//! interface, so each host interface is implemented once; a plugin of any
//! world is then loaded through the `GuestIndices` of the one interface it
//! exports. Hand-written host code lives beside this module, never in it.

wasmtime::component::bindgen!({
    path: "../../wit",
    inline: "
        package kvplane:host;

        world plugin-host {
            import kvplane:plugin/buffers@0.1.0;
            import kvplane:plugin/transport@0.1.0;
            import kvplane:plugin/log@0.1.0;
            import kvplane:plugin/clock@0.1.0;
            import kvplane:plugin/metrics@0.1.0;
            export kvplane:plugin/store@0.1.0;
            export kvplane:plugin/placement@0.1.0;
            export kvplane:plugin/retry@0.1.0;
            export kvplane:plugin/scheduling@0.1.0;
        }
    ",
    imports: {
        "kvplane:plugin/transport": async | trappable,
        default: trappable,
    },
    exports: { default: async },
    additional_derives: [PartialEq],
    with: {
        "kvplane:plugin/buffers.buffer": crate::host::BlockBuffer,
        "kvplane:plugin/transport.connection": crate::transport::Connection,
    },
});

pub use exports::kvplane::plugin::{placement, retry, scheduling, store};
pub use kvplane::plugin::types::{BackendFeatures, Error as WitError, Node as WitNode};

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
        }
    }
}
