//! Cluster membership of kvplane nodes in etcd, and client-side routing.
//!
//! Why etcd: a cache cluster needs every node and client to agree on who
//! is a member, and to stop routing to a node that died without saying so.
//! etcd gives both without a coordinator of our own: a node's record lives
//! under a lease ([`Membership`]), so it disappears when the node stops
//! renewing it, and every change has a revision that orders it, which
//! becomes the version of the slot table computed from it
//! ([`MembershipWatch`], [`Routing`]).
//!
//! Why a watch and not polling: membership changes are rare but must reach
//! everyone quickly; a watch delivers each change once, as it happens, at no
//! cost while nothing changes. A watch can break (its etcd member stops, or
//! loses its leader), so the follower lists again and watches from there.
//!
//! Why a member may declare itself gone before etcd does: a node cut off
//! from etcd keeps serving what it believes it owns, while the others have
//! already moved its keys elsewhere once its lease expired. So a member
//! counts its lease as lapsed from the moment etcd might have expired it —
//! the send time of the last confirmed renewal plus the TTL — and reports
//! [`Registration::Lost`] then, never later than the others stop seeing it.
//!
//! Why a lapsed member registers again by itself: a lapse is most often an
//! etcd outage, not the member's fault, and a member that stays out after
//! etcd is back serves no one (clients get no table from it, the others
//! route nothing to it) while looking healthy to everyone who does not ask
//! etcd. So the keeper that declared the lapse keeps asking etcd for a new
//! lease, with a bounded backoff, and puts the record again under it.
//!
//! Why a member may start before etcd answers ([`Membership::start`]): a
//! node restarted during an etcd outage that refused to start would
//! crash-loop on Kubernetes and lose its chance to serve what clients ask
//! it directly; it starts [`Registration::Pending`] instead, and the same
//! keeper registers it once etcd answers.
//!
//! Why TLS and users ([`EtcdTls`], [`EtcdAuth`]): whoever can write the
//! members' records decides where clients send their prompts' KV blocks,
//! so an etcd reachable beyond one host wants client certificates
//! (`--client-cert-auth`) and, to keep one etcd's tenants apart, users
//! whose roles reach only their cluster's prefix.
//!
//! Why the JSON gateway: the gRPC clients of etcd generate their code with
//! `protoc` at build time; etcd's own HTTP/JSON gateway offers the same few
//! calls (lease grant/keep-alive/revoke, put, range, watch) with the HTTP
//! client the workspace already builds.

use std::time::Duration;

mod etcd;
mod lease;
mod membership;
mod record;
mod routing;
mod security;
mod watch;

pub use membership::{Membership, MembershipWatcher, Registration, RegistrationCounters};
pub use record::{decode_member, encode_member, member_key, members_prefix};
pub use routing::{Router, Routing};
pub use security::{EtcdAuth, EtcdTls};
pub use watch::{MemberView, MembershipWatch};

/// Timing of the calls to etcd, and how to reach it securely.
#[derive(Debug, Clone)]
pub struct Options {
    /// Longest wait for one call (all endpoints together); a keep-alive also
    /// stops waiting when the lease would lapse.
    pub request_timeout: Duration,
    /// Longest wait for a TCP connection to one etcd endpoint.
    pub connect_timeout: Duration,
    /// Longest pause between attempts to list and watch again, and between
    /// attempts to register again after a lapse (counted by
    /// [`RegistrationCounters::failed_attempts`]).
    pub retry_max: Duration,
    /// TLS to etcd (its endpoints are then `https://`, or `host:port`
    /// meaning `https://host:port`). `None`: plain HTTP.
    pub tls: Option<EtcdTls>,
    /// An etcd user to authenticate as, for an etcd with `auth enable`.
    pub auth: Option<EtcdAuth>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            retry_max: Duration::from_secs(2),
            tls: None,
            auth: None,
        }
    }
}

/// What went wrong, naming the etcd endpoint, call or key at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no etcd endpoints were given")]
    NoEndpoints,
    #[error("etcd endpoint {endpoint:?}: {reason}")]
    BadEndpoint { endpoint: String, reason: String },
    #[error("invalid {what} {name:?}: use 1-253 of A-Z a-z 0-9 - _ . :")]
    InvalidName { what: &'static str, name: String },
    #[error("etcd {endpoint}{path}: {reason}")]
    Transport { endpoint: String, path: String, reason: String },
    #[error("no etcd endpoint answered {path} within {timeout:?}: {failures}")]
    Unreachable { path: String, timeout: Duration, failures: String },
    #[error("etcd {endpoint}{path}: {message} (gRPC code {code})")]
    Etcd { endpoint: String, path: String, code: i64, message: String },
    /// A TLS file for etcd that cannot be used.
    #[error("etcd TLS file {file}: {reason}")]
    Tls { file: String, reason: String },
    #[error("etcd {endpoint}{path}: unexpected answer: {reason}")]
    Protocol { endpoint: String, path: String, reason: String },
    #[error("member record {key}: {reason}")]
    BadRecord { key: String, reason: String },
    #[error("the registration under {key} is lost: {reason}")]
    Lost { key: String, reason: String },
    /// `source` while doing `what`, which names the key or lease.
    #[error("{what}: {source}")]
    During { what: String, source: Box<Error> },
}

impl Error {
    fn during(what: impl FnOnce() -> String) -> impl FnOnce(Error) -> Error {
        move |source| Error::During { what: what(), source: Box::new(source) }
    }
}
