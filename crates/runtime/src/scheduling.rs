//! The placement-rule world's records, as the host's own types: what
//! [`PlacementRule::place`](crate::PlacementRule::place) takes and answers.
//!
//! One plain type per record of the contract's `scheduling` interface, with
//! the record's name and fields, so that docs/plugins.md and a plugin's
//! source read the same as the host's code. They are written here rather
//! than re-exported from the generated bindings so that the operator and
//! the conformance kit never name generated code: a change of the bindings
//! generator, or of how this crate calls it, stays inside the runtime. The
//! conversions from and to the bindings are at the end of this file, the
//! one place the two meet. Turning a placement into Kubernetes objects is
//! the operator's business (`kvplane_operator::scheduling`).

use crate::bindings::scheduling as wit;

/// What the reconciler is about to render: the pods of one role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRequest {
    /// Role of the pod in the pool: "cache" or "etcd".
    pub role: String,
    /// Name of the KVCache resource.
    pub name: String,
    /// Labels the rendered pods will carry (sorted by name).
    pub labels: Vec<(String, String)>,
    /// Annotations of the KVCache resource (sorted by name).
    pub annotations: Vec<(String, String)>,
    /// Number of pods of this role.
    pub replicas: u32,
}

/// The constraints for one role's pods. The reconciler merges the output of
/// several placement-rule plugins in declaration order. The default holds
/// no constraint at all: what a failing-open placement rule answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    pub node_affinity: Option<NodeAffinity>,
    pub pod_affinity: Option<PodAffinity>,
    pub pod_anti_affinity: Option<PodAffinity>,
    pub tolerations: Vec<Toleration>,
    pub topology_spread: Vec<TopologySpread>,
}

/// Operator of a node selector requirement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
    Gt,
    Lt,
}

/// Operator of a label selector requirement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

/// One node label condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRequirement {
    pub key: String,
    pub operator: NodeOperator,
    pub values: Vec<String>,
}

/// Node requirements that must all hold (ANDed).
pub type NodeTerm = Vec<NodeRequirement>;

/// A preferred node term and its weight (1-100).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightedNodeTerm {
    pub weight: i32,
    pub term: NodeTerm,
}

/// Node affinity: `required` terms are ORed, each term's requirements ANDed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAffinity {
    pub required: Vec<NodeTerm>,
    pub preferred: Vec<WeightedNodeTerm>,
}

/// One pod label condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelRequirement {
    pub key: String,
    pub operator: LabelOperator,
    pub values: Vec<String>,
}

/// A label selector: `match_labels` and `match_expressions` ANDed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelSelector {
    pub match_labels: Vec<(String, String)>,
    pub match_expressions: Vec<LabelRequirement>,
}

/// Pods selected by `selector` in `namespaces` (empty: the pod's own),
/// co-located (or kept apart) within the domain named by `topology_key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTerm {
    pub selector: LabelSelector,
    pub namespaces: Vec<String>,
    pub topology_key: String,
}

/// A preferred pod term and its weight (1-100).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightedPodTerm {
    pub weight: i32,
    pub term: PodTerm,
}

/// Pod affinity or anti-affinity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodAffinity {
    pub required: Vec<PodTerm>,
    pub preferred: Vec<WeightedPodTerm>,
}

/// Toleration operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TolerationOperator {
    Equal,
    Exists,
}

/// Taint effect a toleration matches; `Any` matches all effects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaintEffect {
    Any,
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

/// Lets pods run on nodes with a matching taint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Toleration {
    pub key: String,
    pub operator: TolerationOperator,
    pub value: String,
    pub effect: TaintEffect,
    pub toleration_seconds: Option<i64>,
}

/// What to do when a spread constraint cannot be met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnsatisfiableAction {
    DoNotSchedule,
    ScheduleAnyway,
}

/// Spread pods matched by `selector` evenly across `topology_key` domains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologySpread {
    pub max_skew: i32,
    pub topology_key: String,
    pub when_unsatisfiable: UnsatisfiableAction,
    pub selector: LabelSelector,
}

// The boundary: a request goes into the bindings, a placement comes out.
// Every conversion moves its strings and lists, none copies them.

fn all<T, U: From<T>>(items: Vec<T>) -> Vec<U> {
    items.into_iter().map(U::from).collect()
}

impl From<PodRequest> for wit::PodRequest {
    fn from(r: PodRequest) -> Self {
        wit::PodRequest { role: r.role, name: r.name, labels: r.labels, annotations: r.annotations, replicas: r.replicas }
    }
}

impl From<wit::Placement> for Placement {
    fn from(p: wit::Placement) -> Self {
        Placement {
            node_affinity: p.node_affinity.map(NodeAffinity::from),
            pod_affinity: p.pod_affinity.map(PodAffinity::from),
            pod_anti_affinity: p.pod_anti_affinity.map(PodAffinity::from),
            tolerations: all(p.tolerations),
            topology_spread: all(p.topology_spread),
        }
    }
}

impl From<wit::NodeOperator> for NodeOperator {
    fn from(op: wit::NodeOperator) -> Self {
        match op {
            wit::NodeOperator::In => NodeOperator::In,
            wit::NodeOperator::NotIn => NodeOperator::NotIn,
            wit::NodeOperator::Exists => NodeOperator::Exists,
            wit::NodeOperator::DoesNotExist => NodeOperator::DoesNotExist,
            wit::NodeOperator::Gt => NodeOperator::Gt,
            wit::NodeOperator::Lt => NodeOperator::Lt,
        }
    }
}

impl From<wit::LabelOperator> for LabelOperator {
    fn from(op: wit::LabelOperator) -> Self {
        match op {
            wit::LabelOperator::In => LabelOperator::In,
            wit::LabelOperator::NotIn => LabelOperator::NotIn,
            wit::LabelOperator::Exists => LabelOperator::Exists,
            wit::LabelOperator::DoesNotExist => LabelOperator::DoesNotExist,
        }
    }
}

impl From<wit::NodeRequirement> for NodeRequirement {
    fn from(r: wit::NodeRequirement) -> Self {
        NodeRequirement { key: r.key, operator: r.operator.into(), values: r.values }
    }
}

impl From<wit::WeightedNodeTerm> for WeightedNodeTerm {
    fn from(w: wit::WeightedNodeTerm) -> Self {
        WeightedNodeTerm { weight: w.weight, term: all(w.term) }
    }
}

impl From<wit::NodeAffinity> for NodeAffinity {
    fn from(a: wit::NodeAffinity) -> Self {
        NodeAffinity { required: a.required.into_iter().map(all).collect(), preferred: all(a.preferred) }
    }
}

impl From<wit::LabelRequirement> for LabelRequirement {
    fn from(r: wit::LabelRequirement) -> Self {
        LabelRequirement { key: r.key, operator: r.operator.into(), values: r.values }
    }
}

impl From<wit::LabelSelector> for LabelSelector {
    fn from(s: wit::LabelSelector) -> Self {
        LabelSelector { match_labels: s.match_labels, match_expressions: all(s.match_expressions) }
    }
}

impl From<wit::PodTerm> for PodTerm {
    fn from(t: wit::PodTerm) -> Self {
        PodTerm { selector: t.selector.into(), namespaces: t.namespaces, topology_key: t.topology_key }
    }
}

impl From<wit::WeightedPodTerm> for WeightedPodTerm {
    fn from(w: wit::WeightedPodTerm) -> Self {
        WeightedPodTerm { weight: w.weight, term: w.term.into() }
    }
}

impl From<wit::PodAffinity> for PodAffinity {
    fn from(a: wit::PodAffinity) -> Self {
        PodAffinity { required: all(a.required), preferred: all(a.preferred) }
    }
}

impl From<wit::TolerationOperator> for TolerationOperator {
    fn from(op: wit::TolerationOperator) -> Self {
        match op {
            wit::TolerationOperator::Equal => TolerationOperator::Equal,
            wit::TolerationOperator::Exists => TolerationOperator::Exists,
        }
    }
}

impl From<wit::TaintEffect> for TaintEffect {
    fn from(e: wit::TaintEffect) -> Self {
        match e {
            wit::TaintEffect::Any => TaintEffect::Any,
            wit::TaintEffect::NoSchedule => TaintEffect::NoSchedule,
            wit::TaintEffect::PreferNoSchedule => TaintEffect::PreferNoSchedule,
            wit::TaintEffect::NoExecute => TaintEffect::NoExecute,
        }
    }
}

impl From<wit::Toleration> for Toleration {
    fn from(t: wit::Toleration) -> Self {
        Toleration {
            key: t.key,
            operator: t.operator.into(),
            value: t.value,
            effect: t.effect.into(),
            toleration_seconds: t.toleration_seconds,
        }
    }
}

impl From<wit::UnsatisfiableAction> for UnsatisfiableAction {
    fn from(a: wit::UnsatisfiableAction) -> Self {
        match a {
            wit::UnsatisfiableAction::DoNotSchedule => UnsatisfiableAction::DoNotSchedule,
            wit::UnsatisfiableAction::ScheduleAnyway => UnsatisfiableAction::ScheduleAnyway,
        }
    }
}

impl From<wit::TopologySpread> for TopologySpread {
    fn from(c: wit::TopologySpread) -> Self {
        TopologySpread {
            max_skew: c.max_skew,
            topology_key: c.topology_key,
            when_unsatisfiable: c.when_unsatisfiable.into(),
            selector: c.selector.into(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `from` turns a case into the case of the same name: the bindings'
    /// `Debug` spells a case `Type::Case`, the host's `Case`.
    pub(crate) fn same_case<A: std::fmt::Debug + Copy, B: std::fmt::Debug + From<A>>(a: A) {
        let (from, to) = (format!("{a:?}"), format!("{:?}", B::from(a)));
        let (from, to) = (from.rsplit("::").next().unwrap(), to.rsplit("::").next().unwrap());
        assert_eq!(from, to, "{a:?} became {:?}", B::from(a));
    }

    #[test]
    fn every_case_keeps_its_name_across_the_boundary() {
        use wit::{LabelOperator as L, NodeOperator as N, TaintEffect as T, TolerationOperator as O, UnsatisfiableAction as U};
        for c in [N::In, N::NotIn, N::Exists, N::DoesNotExist, N::Gt, N::Lt] {
            same_case::<_, NodeOperator>(c);
        }
        for c in [L::In, L::NotIn, L::Exists, L::DoesNotExist] {
            same_case::<_, LabelOperator>(c);
        }
        for c in [O::Equal, O::Exists] {
            same_case::<_, TolerationOperator>(c);
        }
        for c in [T::Any, T::NoSchedule, T::PreferNoSchedule, T::NoExecute] {
            same_case::<_, TaintEffect>(c);
        }
        for c in [U::DoNotSchedule, U::ScheduleAnyway] {
            same_case::<_, UnsatisfiableAction>(c);
        }
    }

    #[test]
    fn a_placement_crosses_whole() {
        let selector = || wit::LabelSelector {
            match_labels: vec![("app".into(), "kv".into())],
            match_expressions: vec![wit::LabelRequirement { key: "tier".into(), operator: wit::LabelOperator::Exists, values: vec![] }],
        };
        let term = || wit::PodTerm { selector: selector(), namespaces: vec!["ns".into()], topology_key: "zone".into() };
        let placement = Placement::from(wit::Placement {
            node_affinity: Some(wit::NodeAffinity {
                required: vec![vec![wit::NodeRequirement {
                    key: "gpu".into(),
                    operator: wit::NodeOperator::In,
                    values: vec!["L20".into()],
                }]],
                preferred: vec![wit::WeightedNodeTerm { weight: 5, term: vec![] }],
            }),
            pod_affinity: Some(wit::PodAffinity { required: vec![term()], preferred: vec![] }),
            pod_anti_affinity: Some(wit::PodAffinity {
                required: vec![],
                preferred: vec![wit::WeightedPodTerm { weight: 7, term: term() }],
            }),
            tolerations: vec![wit::Toleration {
                key: "gpu".into(),
                operator: wit::TolerationOperator::Equal,
                value: "yes".into(),
                effect: wit::TaintEffect::NoExecute,
                toleration_seconds: Some(30),
            }],
            topology_spread: vec![wit::TopologySpread {
                max_skew: 2,
                topology_key: "zone".into(),
                when_unsatisfiable: wit::UnsatisfiableAction::ScheduleAnyway,
                selector: selector(),
            }],
        });
        let selector = LabelSelector {
            match_labels: vec![("app".into(), "kv".into())],
            match_expressions: vec![LabelRequirement { key: "tier".into(), operator: LabelOperator::Exists, values: vec![] }],
        };
        let term = PodTerm { selector: selector.clone(), namespaces: vec!["ns".into()], topology_key: "zone".into() };
        assert_eq!(
            placement,
            Placement {
                node_affinity: Some(NodeAffinity {
                    required: vec![vec![NodeRequirement { key: "gpu".into(), operator: NodeOperator::In, values: vec!["L20".into()] }]],
                    preferred: vec![WeightedNodeTerm { weight: 5, term: vec![] }],
                }),
                pod_affinity: Some(PodAffinity { required: vec![term.clone()], preferred: vec![] }),
                pod_anti_affinity: Some(PodAffinity { required: vec![], preferred: vec![WeightedPodTerm { weight: 7, term }] }),
                tolerations: vec![Toleration {
                    key: "gpu".into(),
                    operator: TolerationOperator::Equal,
                    value: "yes".into(),
                    effect: TaintEffect::NoExecute,
                    toleration_seconds: Some(30),
                }],
                topology_spread: vec![TopologySpread {
                    max_skew: 2,
                    topology_key: "zone".into(),
                    when_unsatisfiable: UnsatisfiableAction::ScheduleAnyway,
                    selector,
                }],
            }
        );
    }
}
