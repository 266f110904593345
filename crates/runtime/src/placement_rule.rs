//! Scheduling constraints produced by placement-rule plugins, validated by
//! the API server's rules on the host's own [`crate::scheduling`] types.
//!
//! Validation happens on the host so a plugin's mistake is reported as the
//! plugin's (with the field named), not as an opaque API-server rejection
//! of a whole StatefulSet. Turning a valid placement into Kubernetes objects
//! is the operator's business, not the runtime's.

use crate::scheduling::{
    LabelOperator, LabelSelector, NodeOperator, NodeRequirement, Placement, PodAffinity, PodTerm, TaintEffect, TolerationOperator,
};

fn is_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

/// A label key: `[prefix/]name` (Kubernetes "qualified name").
pub(crate) fn is_label_key(s: &str) -> bool {
    match s.split_once('/') {
        Some((prefix, name)) => is_dns_subdomain(prefix) && is_name_part(name),
        None => is_name_part(s),
    }
}

/// A label value: empty, or a name part.
pub(crate) fn is_label_value(s: &str) -> bool {
    s.is_empty() || is_name_part(s)
}

fn check_key(field: &str, key: &str) -> Result<(), String> {
    if is_label_key(key) {
        Ok(())
    } else {
        Err(format!("{field}: {key:?} is not a valid label key"))
    }
}

fn check_node_requirement(field: &str, r: &NodeRequirement) -> Result<(), String> {
    check_key(&format!("{field}.key"), &r.key)?;
    match r.operator {
        NodeOperator::In | NodeOperator::NotIn => {
            if r.values.is_empty() {
                return Err(format!("{field}.values: operator In/NotIn needs at least one value"));
            }
            for v in &r.values {
                if !is_label_value(v) {
                    return Err(format!("{field}.values: {v:?} is not a valid label value"));
                }
            }
        }
        NodeOperator::Exists | NodeOperator::DoesNotExist => {
            if !r.values.is_empty() {
                return Err(format!("{field}.values: operator Exists/DoesNotExist takes no values"));
            }
        }
        NodeOperator::Gt | NodeOperator::Lt => {
            if r.values.len() != 1 || r.values[0].parse::<i64>().is_err() {
                return Err(format!("{field}.values: operator Gt/Lt needs exactly one integer value"));
            }
        }
    }
    Ok(())
}

fn check_weight(field: &str, weight: i32) -> Result<(), String> {
    if (1..=100).contains(&weight) {
        Ok(())
    } else {
        Err(format!("{field}.weight: {weight} is outside 1..=100"))
    }
}

fn check_selector(field: &str, s: &LabelSelector) -> Result<(), String> {
    for (k, v) in &s.match_labels {
        check_key(&format!("{field}.matchLabels"), k)?;
        if !is_label_value(v) {
            return Err(format!("{field}.matchLabels[{k}]: {v:?} is not a valid label value"));
        }
    }
    for (i, r) in s.match_expressions.iter().enumerate() {
        let f = format!("{field}.matchExpressions[{i}]");
        check_key(&format!("{f}.key"), &r.key)?;
        match r.operator {
            LabelOperator::In | LabelOperator::NotIn if r.values.is_empty() => {
                return Err(format!("{f}.values: operator In/NotIn needs at least one value"))
            }
            LabelOperator::Exists | LabelOperator::DoesNotExist if !r.values.is_empty() => {
                return Err(format!("{f}.values: operator Exists/DoesNotExist takes no values"))
            }
            _ => {}
        }
    }
    Ok(())
}

fn check_pod_term(field: &str, t: &PodTerm) -> Result<(), String> {
    check_selector(&format!("{field}.labelSelector"), &t.selector)?;
    if t.topology_key.is_empty() {
        return Err(format!("{field}.topologyKey: must not be empty"));
    }
    check_key(&format!("{field}.topologyKey"), &t.topology_key)
}

fn check_pod_affinity(field: &str, a: &PodAffinity) -> Result<(), String> {
    for (i, t) in a.required.iter().enumerate() {
        check_pod_term(&format!("{field}.requiredDuringSchedulingIgnoredDuringExecution[{i}]"), t)?;
    }
    for (i, w) in a.preferred.iter().enumerate() {
        let f = format!("{field}.preferredDuringSchedulingIgnoredDuringExecution[{i}]");
        check_weight(&f, w.weight)?;
        check_pod_term(&format!("{f}.podAffinityTerm"), &w.term)?;
    }
    Ok(())
}

/// Check `p` against the rules the Kubernetes API server applies to the same
/// pod-spec fields. The error names the field.
pub(crate) fn validate(p: &Placement) -> Result<(), String> {
    if let Some(na) = &p.node_affinity {
        for (i, term) in na.required.iter().enumerate() {
            let f = format!("nodeAffinity.required.nodeSelectorTerms[{i}]");
            if term.is_empty() {
                return Err(format!("{f}: an empty term matches no node"));
            }
            for (j, r) in term.iter().enumerate() {
                check_node_requirement(&format!("{f}.matchExpressions[{j}]"), r)?;
            }
        }
        for (i, w) in na.preferred.iter().enumerate() {
            let f = format!("nodeAffinity.preferred[{i}]");
            check_weight(&f, w.weight)?;
            for (j, r) in w.term.iter().enumerate() {
                check_node_requirement(&format!("{f}.preference.matchExpressions[{j}]"), r)?;
            }
        }
    }
    if let Some(a) = &p.pod_affinity {
        check_pod_affinity("podAffinity", a)?;
    }
    if let Some(a) = &p.pod_anti_affinity {
        check_pod_affinity("podAntiAffinity", a)?;
    }
    for (i, t) in p.tolerations.iter().enumerate() {
        let f = format!("tolerations[{i}]");
        if !t.key.is_empty() {
            check_key(&format!("{f}.key"), &t.key)?;
        }
        match t.operator {
            TolerationOperator::Exists if !t.value.is_empty() => return Err(format!("{f}.value: must be empty when operator is Exists")),
            TolerationOperator::Equal if t.key.is_empty() => return Err(format!("{f}.operator: must be Exists when key is empty")),
            TolerationOperator::Equal if !is_label_value(&t.value) => {
                return Err(format!("{f}.value: {:?} is not a valid label value", t.value))
            }
            _ => {}
        }
        if t.toleration_seconds.is_some() && t.effect != TaintEffect::NoExecute {
            return Err(format!("{f}.tolerationSeconds: only allowed with effect NoExecute"));
        }
    }
    for (i, c) in p.topology_spread.iter().enumerate() {
        let f = format!("topologySpreadConstraints[{i}]");
        if c.max_skew < 1 {
            return Err(format!("{f}.maxSkew: {} must be at least 1", c.max_skew));
        }
        check_key(&format!("{f}.topologyKey"), &c.topology_key)?;
        check_selector(&format!("{f}.labelSelector"), &c.selector)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::{NodeAffinity, Toleration};

    fn empty() -> Placement {
        Placement::default()
    }

    #[test]
    fn label_keys_and_values_follow_kubernetes_rules() {
        assert!(is_label_key("nvidia.com/gpu.product"));
        assert!(is_label_key("kubernetes.io/hostname"));
        assert!(is_label_key("app"));
        assert!(!is_label_key(""));
        assert!(!is_label_key("-app"));
        assert!(!is_label_key("Upper.Case/name"));
        assert!(!is_label_key(&"a".repeat(64)));
        assert!(is_label_value(""));
        assert!(is_label_value("NVIDIA-L20"));
        assert!(!is_label_value("has space"));
    }

    #[test]
    fn invalid_node_affinity_names_the_field() {
        let mut p = empty();
        p.node_affinity = Some(NodeAffinity {
            required: vec![vec![NodeRequirement { key: "nvidia.com/gpu.product".into(), operator: NodeOperator::In, values: vec![] }]],
            preferred: vec![],
        });
        let err = validate(&p).unwrap_err();
        assert!(err.contains("nodeSelectorTerms[0].matchExpressions[0].values"), "{err}");
        p.node_affinity = Some(NodeAffinity { required: vec![vec![]], preferred: vec![] });
        assert!(validate(&p).unwrap_err().contains("empty term"));
    }

    #[test]
    fn tolerations_are_checked() {
        let mut p = empty();
        p.tolerations = vec![Toleration {
            key: "gpu".into(),
            operator: TolerationOperator::Exists,
            value: "x".into(),
            effect: TaintEffect::NoSchedule,
            toleration_seconds: None,
        }];
        assert!(validate(&p).unwrap_err().contains("tolerations[0].value"));
        p.tolerations[0].value.clear();
        assert_eq!(validate(&p), Ok(()));
        p.tolerations[0].toleration_seconds = Some(5);
        assert!(validate(&p).unwrap_err().contains("tolerationSeconds"));
    }
}
