//! Pod scheduling: placement-rule output as Kubernetes objects.
//!
//! A placement-rule plugin's answer arrives as the runtime's
//! [`kvplane_runtime::scheduling`] types, one per record of the contract,
//! checked by the runtime against the API server's rules; this module
//! builds the typed `Affinity`, `Toleration` and `TopologySpreadConstraint`
//! the pod template carries, field by field, and merges the output of
//! several rules.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity as K8sNodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodAffinity as K8sPodAffinity,
    PodAffinityTerm, PodAntiAffinity, PreferredSchedulingTerm, Toleration as K8sToleration, TopologySpreadConstraint,
    WeightedPodAffinityTerm,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector as K8sLabelSelector, LabelSelectorRequirement};
use kvplane_runtime::scheduling::{
    LabelOperator, LabelSelector, NodeAffinity, NodeOperator, NodeRequirement, Placement, PodAffinity, PodTerm, TaintEffect, Toleration,
    TolerationOperator, TopologySpread, UnsatisfiableAction,
};

use crate::render::RolePlacement;

fn non_empty<T>(v: Vec<T>) -> Option<Vec<T>> {
    (!v.is_empty()).then_some(v)
}

fn node_operator(op: NodeOperator) -> &'static str {
    match op {
        NodeOperator::In => "In",
        NodeOperator::NotIn => "NotIn",
        NodeOperator::Exists => "Exists",
        NodeOperator::DoesNotExist => "DoesNotExist",
        NodeOperator::Gt => "Gt",
        NodeOperator::Lt => "Lt",
    }
}

fn node_term(term: &[NodeRequirement]) -> NodeSelectorTerm {
    NodeSelectorTerm {
        match_expressions: Some(
            term.iter()
                .map(|r| NodeSelectorRequirement {
                    key: r.key.clone(),
                    operator: node_operator(r.operator).into(),
                    values: non_empty(r.values.clone()),
                })
                .collect(),
        ),
        match_fields: None,
    }
}

fn node_affinity(a: &NodeAffinity) -> K8sNodeAffinity {
    K8sNodeAffinity {
        required_during_scheduling_ignored_during_execution: (!a.required.is_empty())
            .then(|| NodeSelector { node_selector_terms: a.required.iter().map(|t| node_term(t)).collect() }),
        preferred_during_scheduling_ignored_during_execution: non_empty(
            a.preferred.iter().map(|w| PreferredSchedulingTerm { weight: w.weight, preference: node_term(&w.term) }).collect(),
        ),
    }
}

fn label_selector(s: &LabelSelector) -> K8sLabelSelector {
    let operator = |op: LabelOperator| match op {
        LabelOperator::In => "In",
        LabelOperator::NotIn => "NotIn",
        LabelOperator::Exists => "Exists",
        LabelOperator::DoesNotExist => "DoesNotExist",
    };
    K8sLabelSelector {
        match_labels: non_empty(s.match_labels.clone()).map(|l| l.into_iter().collect::<BTreeMap<_, _>>()),
        match_expressions: non_empty(
            s.match_expressions
                .iter()
                .map(|r| LabelSelectorRequirement {
                    key: r.key.clone(),
                    operator: operator(r.operator).into(),
                    values: non_empty(r.values.clone()),
                })
                .collect(),
        ),
    }
}

fn pod_term(t: &PodTerm) -> PodAffinityTerm {
    PodAffinityTerm {
        label_selector: Some(label_selector(&t.selector)),
        namespaces: non_empty(t.namespaces.clone()),
        topology_key: t.topology_key.clone(),
        ..Default::default()
    }
}

fn pod_terms(a: &PodAffinity) -> (Option<Vec<PodAffinityTerm>>, Option<Vec<WeightedPodAffinityTerm>>) {
    (
        non_empty(a.required.iter().map(pod_term).collect()),
        non_empty(a.preferred.iter().map(|w| WeightedPodAffinityTerm { weight: w.weight, pod_affinity_term: pod_term(&w.term) }).collect()),
    )
}

fn toleration(t: &Toleration) -> K8sToleration {
    K8sToleration {
        key: (!t.key.is_empty()).then(|| t.key.clone()),
        operator: Some(match t.operator {
            TolerationOperator::Equal => "Equal".into(),
            TolerationOperator::Exists => "Exists".into(),
        }),
        value: (!t.value.is_empty()).then(|| t.value.clone()),
        effect: match t.effect {
            TaintEffect::Any => None,
            TaintEffect::NoSchedule => Some("NoSchedule".into()),
            TaintEffect::PreferNoSchedule => Some("PreferNoSchedule".into()),
            TaintEffect::NoExecute => Some("NoExecute".into()),
        },
        toleration_seconds: t.toleration_seconds,
    }
}

fn spread(c: &TopologySpread) -> TopologySpreadConstraint {
    TopologySpreadConstraint {
        max_skew: c.max_skew,
        topology_key: c.topology_key.clone(),
        when_unsatisfiable: match c.when_unsatisfiable {
            UnsatisfiableAction::DoNotSchedule => "DoNotSchedule".into(),
            UnsatisfiableAction::ScheduleAnyway => "ScheduleAnyway".into(),
        },
        label_selector: Some(label_selector(&c.selector)),
        ..Default::default()
    }
}

/// The pod-template fields for one placement.
pub fn role_placement(p: &Placement) -> RolePlacement {
    let node = p.node_affinity.as_ref().map(node_affinity);
    let pod = p.pod_affinity.as_ref().map(|a| {
        let (required, preferred) = pod_terms(a);
        K8sPodAffinity {
            required_during_scheduling_ignored_during_execution: required,
            preferred_during_scheduling_ignored_during_execution: preferred,
        }
    });
    let anti = p.pod_anti_affinity.as_ref().map(|a| {
        let (required, preferred) = pod_terms(a);
        PodAntiAffinity {
            required_during_scheduling_ignored_during_execution: required,
            preferred_during_scheduling_ignored_during_execution: preferred,
        }
    });
    let affinity = (node.is_some() || pod.is_some() || anti.is_some()).then_some(Affinity {
        node_affinity: node,
        pod_affinity: pod,
        pod_anti_affinity: anti,
    });
    RolePlacement {
        affinity,
        tolerations: p.tolerations.iter().map(toleration).collect(),
        topology_spread: p.topology_spread.iter().map(spread).collect(),
    }
}

/// A placement as the pod-spec JSON Kubernetes would store (for printing by
/// `kvplane demo` and the conformance kit).
pub fn to_pod_spec_json(p: &Placement) -> serde_json::Value {
    let r = role_placement(p);
    serde_json::json!({
        "affinity": r.affinity,
        "tolerations": r.tolerations,
        "topologySpreadConstraints": r.topology_spread,
    })
}

/// Combines the output of several placement rules: every constraint of
/// every rule holds. Required node terms are ANDed (each term of one rule
/// combined with each term of the other), everything else is concatenated.
pub fn merge(a: RolePlacement, b: RolePlacement) -> RolePlacement {
    let affinity = match (a.affinity, b.affinity) {
        (None, x) | (x, None) => x,
        (Some(x), Some(y)) => Some(Affinity {
            node_affinity: merge_node(x.node_affinity, y.node_affinity),
            pod_affinity: match (x.pod_affinity, y.pod_affinity) {
                (None, p) | (p, None) => p,
                (Some(p), Some(q)) => Some(K8sPodAffinity {
                    required_during_scheduling_ignored_during_execution: concat(
                        p.required_during_scheduling_ignored_during_execution,
                        q.required_during_scheduling_ignored_during_execution,
                    ),
                    preferred_during_scheduling_ignored_during_execution: concat(
                        p.preferred_during_scheduling_ignored_during_execution,
                        q.preferred_during_scheduling_ignored_during_execution,
                    ),
                }),
            },
            pod_anti_affinity: match (x.pod_anti_affinity, y.pod_anti_affinity) {
                (None, p) | (p, None) => p,
                (Some(p), Some(q)) => Some(PodAntiAffinity {
                    required_during_scheduling_ignored_during_execution: concat(
                        p.required_during_scheduling_ignored_during_execution,
                        q.required_during_scheduling_ignored_during_execution,
                    ),
                    preferred_during_scheduling_ignored_during_execution: concat(
                        p.preferred_during_scheduling_ignored_during_execution,
                        q.preferred_during_scheduling_ignored_during_execution,
                    ),
                }),
            },
        }),
    };
    let mut tolerations = a.tolerations;
    tolerations.extend(b.tolerations);
    let mut topology_spread = a.topology_spread;
    topology_spread.extend(b.topology_spread);
    RolePlacement { affinity, tolerations, topology_spread }
}

fn merge_node(a: Option<K8sNodeAffinity>, b: Option<K8sNodeAffinity>) -> Option<K8sNodeAffinity> {
    let (n1, n2) = match (a, b) {
        (None, n) | (n, None) => return n,
        (Some(n1), Some(n2)) => (n1, n2),
    };
    let required = match (n1.required_during_scheduling_ignored_during_execution, n2.required_during_scheduling_ignored_during_execution) {
        (None, r) | (r, None) => r,
        (Some(s1), Some(s2)) => {
            let mut terms = Vec::new();
            for t1 in &s1.node_selector_terms {
                for t2 in &s2.node_selector_terms {
                    let mut exprs = t1.match_expressions.clone().unwrap_or_default();
                    exprs.extend(t2.match_expressions.clone().unwrap_or_default());
                    terms.push(NodeSelectorTerm { match_expressions: Some(exprs), ..Default::default() });
                }
            }
            Some(NodeSelector { node_selector_terms: terms })
        }
    };
    Some(K8sNodeAffinity {
        required_during_scheduling_ignored_during_execution: required,
        preferred_during_scheduling_ignored_during_execution: concat(
            n1.preferred_during_scheduling_ignored_during_execution,
            n2.preferred_during_scheduling_ignored_during_execution,
        ),
    })
}

fn concat<T>(a: Option<Vec<T>>, b: Option<Vec<T>>) -> Option<Vec<T>> {
    match (a, b) {
        (None, x) | (x, None) => x,
        (Some(mut x), Some(y)) => {
            x.extend(y);
            Some(x)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty() -> Placement {
        Placement { node_affinity: None, pod_affinity: None, pod_anti_affinity: None, tolerations: vec![], topology_spread: vec![] }
    }

    #[test]
    fn builds_typed_objects_in_kubernetes_spelling() {
        let mut p = empty();
        p.node_affinity = Some(NodeAffinity {
            required: vec![vec![NodeRequirement { key: "k".into(), operator: NodeOperator::In, values: vec!["v".into()] }]],
            preferred: vec![],
        });
        p.tolerations = vec![Toleration {
            key: "gpu".into(),
            operator: TolerationOperator::Exists,
            value: String::new(),
            effect: TaintEffect::NoSchedule,
            toleration_seconds: None,
        }];
        let r = role_placement(&p);
        let req = r
            .affinity
            .as_ref()
            .unwrap()
            .node_affinity
            .as_ref()
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap();
        let expr = &req.node_selector_terms[0].match_expressions.as_ref().unwrap()[0];
        assert_eq!((expr.key.as_str(), expr.operator.as_str(), expr.values.clone()), ("k", "In", Some(vec!["v".to_string()])));
        assert_eq!(r.tolerations[0].operator.as_deref(), Some("Exists"));
        assert_eq!(r.tolerations[0].value, None);
        assert_eq!(r.tolerations[0].effect.as_deref(), Some("NoSchedule"));
        let v = to_pod_spec_json(&p);
        assert_eq!(
            v["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0],
            serde_json::json!({"key": "k", "operator": "In", "values": ["v"]})
        );
    }

    #[test]
    fn an_empty_placement_adds_no_affinity() {
        assert_eq!(role_placement(&empty()), RolePlacement::default());
    }
}
