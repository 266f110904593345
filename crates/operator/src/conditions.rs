//! The KVCache's status conditions, typed: which conditions exist and every
//! reason the operator gives, so a reason cannot be misspelt in one place and
//! a person reading `kubectl describe` sees a closed vocabulary.

use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::crd::{KVCache, KVCacheStatus};

/// The conditions a KVCache reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConditionType {
    /// Every member of etcd and every cache pod is ready.
    Ready,
    /// The etcd cluster (or the external metadata store) is available.
    EtcdReady,
    /// Every cache pod is ready.
    CacheReady,
    /// Every declared plugin was fetched, verified and loaded.
    PluginsResolved,
    /// Something that worked before does not, or had to be repaired.
    Degraded,
}

impl ConditionType {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ConditionType::Ready => "Ready",
            ConditionType::EtcdReady => "EtcdReady",
            ConditionType::CacheReady => "CacheReady",
            ConditionType::PluginsResolved => "PluginsResolved",
            ConditionType::Degraded => "Degraded",
        }
    }
}

/// Why a condition (or an Event) is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    // The spec.
    InvalidSpec,
    // Plugins.
    Resolved,
    PluginsNotResolved,
    UnknownBuiltin,
    SourceUnavailable,
    SourceNotFound,
    InvalidSource,
    DigestMismatch,
    InvalidLimits,
    LoadFailed,
    PlacementRuleFailed,
    // Applying children.
    ApplyFailed,
    Created,
    Repaired,
    Updated,
    ChildRepaired,
    // Readiness.
    MembersReady,
    MembersNotReady,
    External,
    PodsReady,
    PodsNotReady,
    AllReady,
    Waiting,
    AsExpected,
    NotReady,
    Starting,
}

impl Reason {
    /// CamelCase, as Kubernetes wants condition and Event reasons.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidSpec => "InvalidSpec",
            Reason::Resolved => "Resolved",
            Reason::PluginsNotResolved => "PluginsNotResolved",
            Reason::UnknownBuiltin => "UnknownBuiltin",
            Reason::SourceUnavailable => "SourceUnavailable",
            Reason::SourceNotFound => "SourceNotFound",
            Reason::InvalidSource => "InvalidSource",
            Reason::DigestMismatch => "DigestMismatch",
            Reason::InvalidLimits => "InvalidLimits",
            Reason::LoadFailed => "LoadFailed",
            Reason::PlacementRuleFailed => "PlacementRuleFailed",
            Reason::ApplyFailed => "ApplyFailed",
            Reason::Created => "Created",
            Reason::Repaired => "Repaired",
            Reason::Updated => "Updated",
            Reason::ChildRepaired => "ChildRepaired",
            Reason::MembersReady => "MembersReady",
            Reason::MembersNotReady => "MembersNotReady",
            Reason::External => "External",
            Reason::PodsReady => "PodsReady",
            Reason::PodsNotReady => "PodsNotReady",
            Reason::AllReady => "AllReady",
            Reason::Waiting => "Waiting",
            Reason::AsExpected => "AsExpected",
            Reason::NotReady => "NotReady",
            Reason::Starting => "Starting",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Sets a condition, keeping its transition time when its status is unchanged.
pub(crate) fn set(status: &mut KVCacheStatus, kv: &KVCache, type_: ConditionType, ok: bool, reason: Reason, message: &str) {
    let value = if ok { "True" } else { "False" };
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let generation = kv.metadata.generation;
    match status.conditions.iter_mut().find(|c| c.type_ == type_.as_str()) {
        Some(c) => {
            if c.status != value {
                c.last_transition_time = now;
            }
            c.status = value.into();
            c.reason = reason.as_str().into();
            c.message = message.into();
            c.observed_generation = generation;
        }
        None => status.conditions.push(Condition {
            type_: type_.as_str().into(),
            status: value.into(),
            reason: reason.as_str().into(),
            message: message.into(),
            last_transition_time: now,
            observed_generation: generation,
        }),
    }
}

/// Whether a condition is present and `True`.
pub(crate) fn is_true(status: &KVCacheStatus, type_: ConditionType) -> bool {
    status.conditions.iter().any(|c| c.type_ == type_.as_str() && c.status == "True")
}
