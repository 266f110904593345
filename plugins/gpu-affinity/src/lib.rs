//! `builtin:gpu-affinity`: scheduling constraints for a KVCache's pods from
//! its annotations — GPU-type node affinity, co-location with a model
//! workload, and one pod of a role per node. The annotation logic lives in
//! [`rules`] (with label syntax in [`labels`]) so it can be tested natively;
//! this file adapts it to the WIT `scheduling` interface.
//!
//! Annotations (AIBrix `kvcache.orchestration.aibrix.ai/` or kvplane
//! `kvplane.io/` prefix; kvplane.io wins): `node-affinity-gpu-type`,
//! `node-affinity-key`, `pod-affinity-workload`, `pod-anti-affinity`.
//!
//! Config: `topology-key` (default `kubernetes.io/hostname`) — the domain for
//! pod affinity and anti-affinity.

pub mod labels;
pub mod rules;

use std::cell::RefCell;

use bindings::exports::kvplane::plugin::scheduling::{
    Error, Guest, LabelSelector, NodeAffinity, NodeOperator, NodeRequirement, Placement, PodAffinity, PodRequest, PodTerm,
};
use rules::{PodRule, Rules, Settings};

// The generated WIT bindings: the canonical ABI's unsafe glue and the
// component's exports, apart from the policy code (the workspace denies
// unsafe code and unreachable `pub` items everywhere else).
#[allow(unsafe_code, unreachable_pub)]
mod bindings {
    wit_bindgen::generate!({
        world: "placement-rule",
        path: "../../wit",
    });
}

thread_local! {
    static SETTINGS: RefCell<Settings> = RefCell::new(Settings::default());
}

fn required_pod_term(rule: PodRule) -> PodAffinity {
    PodAffinity {
        required: vec![PodTerm {
            selector: LabelSelector { match_labels: rule.match_labels, match_expressions: Vec::new() },
            // Empty: the pod's own namespace, where the KVCache and its
            // workload live.
            namespaces: Vec::new(),
            topology_key: rule.topology_key,
        }],
        preferred: Vec::new(),
    }
}

fn render(rules: Rules) -> Placement {
    Placement {
        node_affinity: rules.node.map(|n| NodeAffinity {
            required: vec![vec![NodeRequirement { key: n.key, operator: NodeOperator::In, values: n.values }]],
            preferred: Vec::new(),
        }),
        pod_affinity: rules.pod_affinity.map(required_pod_term),
        pod_anti_affinity: rules.pod_anti_affinity.map(required_pod_term),
        tolerations: Vec::new(),
        topology_spread: Vec::new(),
    }
}

struct GpuAffinity;

impl Guest for GpuAffinity {
    fn configure(config: Vec<(String, String)>) -> Result<(), Error> {
        let parsed = Settings::from_config(&config).map_err(Error::Invalid)?;
        SETTINGS.with(|s| *s.borrow_mut() = parsed);
        Ok(())
    }

    fn place(request: PodRequest) -> Result<Placement, Error> {
        SETTINGS.with(|s| rules::rules(&s.borrow(), &request.labels, &request.annotations)).map(render).map_err(Error::Invalid)
    }
}

// The exported symbol names (`kvplane:plugin/scheduling@0.1.0#place`) are not
// valid in a native linker version script, so the native cdylib built for
// unit tests carries no exports.
#[cfg(target_arch = "wasm32")]
#[allow(unsafe_code)] // the exports' canonical-ABI glue, generated
mod export {
    use super::GpuAffinity;
    crate::bindings::export!(GpuAffinity with_types_in crate::bindings);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn request(role: &str, annotations: &[(&str, &str)]) -> PodRequest {
        PodRequest {
            role: role.into(),
            name: "kv1".into(),
            labels: pairs(&[("kvplane.io/name", "kv1"), ("kvplane.io/role", role)]),
            annotations: pairs(annotations),
            replicas: 3,
        }
    }

    fn is_empty(p: &Placement) -> bool {
        p.node_affinity.is_none()
            && p.pod_affinity.is_none()
            && p.pod_anti_affinity.is_none()
            && p.tolerations.is_empty()
            && p.topology_spread.is_empty()
    }

    #[test]
    fn renders_required_terms_for_every_role() {
        <GpuAffinity as Guest>::configure(Vec::new()).expect("empty config");
        for role in ["cache", "etcd"] {
            let p = <GpuAffinity as Guest>::place(request(
                role,
                &[
                    ("kvcache.orchestration.aibrix.ai/node-affinity-gpu-type", "L20,H100"),
                    ("kvcache.orchestration.aibrix.ai/pod-affinity-workload", "llama"),
                    ("kvcache.orchestration.aibrix.ai/pod-anti-affinity", "true"),
                ],
            ))
            .expect("valid annotations");

            let node = p.node_affinity.expect("node affinity");
            assert!(node.preferred.is_empty());
            assert_eq!(node.required.len(), 1);
            let term = &node.required[0];
            assert_eq!(term.len(), 1);
            assert_eq!(term[0].key, "nvidia.com/gpu.product");
            assert!(matches!(term[0].operator, NodeOperator::In));
            assert_eq!(term[0].values, ["L20", "H100"]);

            let aff = p.pod_affinity.expect("pod affinity");
            assert!(aff.preferred.is_empty());
            assert_eq!(aff.required.len(), 1);
            assert_eq!(aff.required[0].selector.match_labels, pairs(&[("model.aibrix.ai/name", "llama")]));
            assert!(aff.required[0].selector.match_expressions.is_empty());
            assert!(aff.required[0].namespaces.is_empty());
            assert_eq!(aff.required[0].topology_key, "kubernetes.io/hostname");

            let anti = p.pod_anti_affinity.expect("pod anti-affinity");
            assert_eq!(anti.required.len(), 1);
            assert_eq!(anti.required[0].selector.match_labels, request(role, &[]).labels);
            assert_eq!(anti.required[0].topology_key, "kubernetes.io/hostname");

            assert!(p.tolerations.is_empty() && p.topology_spread.is_empty());
        }
    }

    #[test]
    fn guest_empty_placement_errors_and_config() {
        <GpuAffinity as Guest>::configure(Vec::new()).expect("empty config");
        let p = <GpuAffinity as Guest>::place(request("cache", &[])).expect("no annotations");
        assert!(is_empty(&p));

        let err = <GpuAffinity as Guest>::place(request("cache", &[("kvplane.io/pod-anti-affinity", "yes")])).unwrap_err();
        assert!(matches!(&err, Error::Invalid(m) if m.starts_with("annotation kvplane.io/pod-anti-affinity=\"yes\"")), "{err:?}");

        let err = <GpuAffinity as Guest>::configure(pairs(&[("zone", "a")])).unwrap_err();
        assert!(matches!(&err, Error::Invalid(m) if m.contains("config zone=")), "{err:?}");

        <GpuAffinity as Guest>::configure(pairs(&[("topology-key", "topology.kubernetes.io/zone")])).expect("valid");
        let p = <GpuAffinity as Guest>::place(request("cache", &[("kvplane.io/pod-affinity-workload", "m")])).unwrap();
        assert_eq!(p.pod_affinity.unwrap().required[0].topology_key, "topology.kubernetes.io/zone");
        // A rejected config keeps the previous settings.
        assert!(<GpuAffinity as Guest>::configure(pairs(&[("topology-key", "")])).is_err());
        let p = <GpuAffinity as Guest>::place(request("cache", &[("kvplane.io/pod-affinity-workload", "m")])).unwrap();
        assert_eq!(p.pod_affinity.unwrap().required[0].topology_key, "topology.kubernetes.io/zone");
    }
}
