//! From KVCache annotations to scheduling rules, free of WIT types so it runs
//! and tests natively. `lib.rs` renders [`Rules`] into the WIT `placement`.
//!
//! Both the AIBrix spelling (`kvcache.orchestration.aibrix.ai/...`) and
//! kvplane's own (`kvplane.io/...`) are read, so a KVCache written for AIBrix
//! schedules the same way here; when both are present, the kvplane.io one
//! wins because it is the one a kvplane user wrote on purpose.

use crate::labels::{check_key, check_value};

pub const AIBRIX_PREFIX: &str = "kvcache.orchestration.aibrix.ai/";
pub const KVPLANE_PREFIX: &str = "kvplane.io/";

pub const GPU_TYPE: &str = "node-affinity-gpu-type";
pub const NODE_KEY: &str = "node-affinity-key";
pub const WORKLOAD: &str = "pod-affinity-workload";
pub const ANTI_AFFINITY: &str = "pod-anti-affinity";

/// The node label most GPU clusters carry (NVIDIA GPU feature discovery).
pub const DEFAULT_NODE_KEY: &str = "nvidia.com/gpu.product";
/// One pod per node by default: co-location means "same machine" for KV
/// transfer to stay off the network.
pub const DEFAULT_TOPOLOGY_KEY: &str = "kubernetes.io/hostname";
/// The label AIBrix puts on model workloads; the workload annotation names
/// its value.
pub const WORKLOAD_LABEL: &str = "model.aibrix.ai/name";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub topology_key: String,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { topology_key: DEFAULT_TOPOLOGY_KEY.to_string() }
    }
}

impl Settings {
    /// The error text is the `invalid` message for the host.
    pub fn from_config(config: &[(String, String)]) -> Result<Settings, String> {
        let mut s = Settings::default();
        let mut seen_topology_key = false;
        for (key, value) in config {
            match key.as_str() {
                "topology-key" => {
                    if seen_topology_key {
                        return Err(format!("config {key}={value:?}: {key} is set more than once"));
                    }
                    seen_topology_key = true;
                    check_key(value).map_err(|why| format!("config {key}={value:?}: not a label key: {why}"))?;
                    s.topology_key = value.clone();
                }
                _ => return Err(format!("config {key}={value:?}: unknown setting (known: topology-key)")),
            }
        }
        Ok(s)
    }
}

/// Required node affinity: nodes whose label `key` has one of `values`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRule {
    pub key: String,
    pub values: Vec<String>,
}

/// A required pod (anti-)affinity term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRule {
    pub match_labels: Vec<(String, String)>,
    pub topology_key: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    pub node: Option<NodeRule>,
    pub pod_affinity: Option<PodRule>,
    pub pod_anti_affinity: Option<PodRule>,
}

/// One annotation found under either spelling: its full name (for messages)
/// and value.
struct Found<'a> {
    name: &'a str,
    value: &'a str,
}

impl Found<'_> {
    fn invalid(&self, why: impl std::fmt::Display) -> String {
        format!("annotation {}={:?}: {why}", self.name, self.value)
    }
}

fn lookup<'a>(annotations: &'a [(String, String)], suffix: &str) -> Option<Found<'a>> {
    let find = |prefix: &str| {
        annotations.iter().find_map(|(name, value)| {
            let rest = name.strip_prefix(prefix)?;
            (rest == suffix).then_some(Found { name: name.as_str(), value: value.as_str() })
        })
    };
    find(KVPLANE_PREFIX).or_else(|| find(AIBRIX_PREFIX))
}

fn gpu_types(found: &Found) -> Result<Vec<String>, String> {
    let mut values: Vec<String> = Vec::new();
    for item in found.value.split(',') {
        // "A100, H100" is how people write lists by hand.
        let item = item.trim();
        if item.is_empty() {
            return Err(found.invalid("empty GPU type (expected one type or a comma-separated list)"));
        }
        check_value(item).map_err(|why| found.invalid(format!("GPU type {item:?} is not a label value: {why}")))?;
        if !values.iter().any(|v| v == item) {
            values.push(item.to_string());
        }
    }
    Ok(values)
}

/// The rules the annotations ask for, for a pod carrying `labels`. `role` is
/// deliberately not consulted: cache and etcd pods follow the same
/// annotations.
pub fn rules(settings: &Settings, labels: &[(String, String)], annotations: &[(String, String)]) -> Result<Rules, String> {
    let mut out = Rules::default();

    let node_key = lookup(annotations, NODE_KEY);
    match lookup(annotations, GPU_TYPE) {
        Some(gpu) => {
            let values = gpu_types(&gpu)?;
            let key = match &node_key {
                Some(k) => {
                    check_key(k.value).map_err(|why| k.invalid(format!("not a node label key: {why}")))?;
                    k.value.to_string()
                }
                None => DEFAULT_NODE_KEY.to_string(),
            };
            out.node = Some(NodeRule { key, values });
        }
        None => {
            // Silently ignoring it would leave the user believing the pods
            // are pinned to a GPU type when they may land anywhere.
            if let Some(k) = node_key {
                return Err(k.invalid(format!(
                    "set without {KVPLANE_PREFIX}{GPU_TYPE} or {AIBRIX_PREFIX}{GPU_TYPE}, so there is no value to match"
                )));
            }
        }
    }

    if let Some(w) = lookup(annotations, WORKLOAD) {
        if w.value.is_empty() {
            return Err(w.invalid("empty workload name"));
        }
        check_value(w.value).map_err(|why| w.invalid(format!("not a label value: {why}")))?;
        out.pod_affinity = Some(PodRule {
            match_labels: vec![(WORKLOAD_LABEL.to_string(), w.value.to_string())],
            topology_key: settings.topology_key.clone(),
        });
    }

    if let Some(a) = lookup(annotations, ANTI_AFFINITY) {
        match a.value {
            "true" => {
                // An empty selector matches every pod in the namespace: the
                // cache pods would refuse to share a node with anything.
                if labels.is_empty() {
                    return Err(a.invalid("the pod request has no labels to select the pool's own pods with"));
                }
                out.pod_anti_affinity = Some(PodRule { match_labels: labels.to_vec(), topology_key: settings.topology_key.clone() });
            }
            "false" => {}
            _ => return Err(a.invalid("expected \"true\" or \"false\"")),
        }
    }

    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn pool_labels() -> Vec<(String, String)> {
        pairs(&[("app.kubernetes.io/instance", "kv1"), ("kvplane.io/role", "cache")])
    }

    fn run(annotations: &[(&str, &str)]) -> Result<Rules, String> {
        rules(&Settings::default(), &pool_labels(), &pairs(annotations))
    }

    fn node(key: &str, values: &[&str]) -> Option<NodeRule> {
        Some(NodeRule { key: key.into(), values: values.iter().map(|v| v.to_string()).collect() })
    }

    const A_GPU: &str = "kvcache.orchestration.aibrix.ai/node-affinity-gpu-type";
    const A_KEY: &str = "kvcache.orchestration.aibrix.ai/node-affinity-key";
    const A_WORKLOAD: &str = "kvcache.orchestration.aibrix.ai/pod-affinity-workload";
    const A_ANTI: &str = "kvcache.orchestration.aibrix.ai/pod-anti-affinity";
    const K_GPU: &str = "kvplane.io/node-affinity-gpu-type";
    const K_KEY: &str = "kvplane.io/node-affinity-key";
    const K_WORKLOAD: &str = "kvplane.io/pod-affinity-workload";
    const K_ANTI: &str = "kvplane.io/pod-anti-affinity";

    #[test]
    fn no_annotations_means_no_rules() {
        assert_eq!(run(&[]), Ok(Rules::default()));
        // Unrelated annotations, including other AIBrix ones, are not ours.
        assert_eq!(run(&[("kvcache.orchestration.aibrix.ai/backend", "vineyard"), ("team", "ml")]), Ok(Rules::default()));
    }

    #[test]
    fn gpu_type_gives_node_affinity_on_the_default_key() {
        for name in [A_GPU, K_GPU] {
            let r = run(&[(name, "NVIDIA-L20")]).unwrap();
            assert_eq!(r.node, node("nvidia.com/gpu.product", &["NVIDIA-L20"]), "{name}");
            assert_eq!((r.pod_affinity, r.pod_anti_affinity), (None, None));
        }
    }

    #[test]
    fn custom_node_key() {
        let r = run(&[(A_GPU, "NVIDIA-L20"), (A_KEY, "machine.cluster.vke.volcengine.com/gpu-name")]).unwrap();
        assert_eq!(r.node, node("machine.cluster.vke.volcengine.com/gpu-name", &["NVIDIA-L20"]));
        let r = run(&[(K_GPU, "H100"), (K_KEY, "gpu")]).unwrap();
        assert_eq!(r.node, node("gpu", &["H100"]));
        // Spellings mix: each annotation is looked up on its own.
        let r = run(&[(A_KEY, "acme.io/accel"), (K_GPU, "H100")]).unwrap();
        assert_eq!(r.node, node("acme.io/accel", &["H100"]));
    }

    #[test]
    fn comma_list_gives_several_values() {
        let r = run(&[(A_GPU, "NVIDIA-A100-SXM4-80GB, NVIDIA-H100-80GB-HBM3,NVIDIA-L20")]).unwrap();
        assert_eq!(r.node, node("nvidia.com/gpu.product", &["NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3", "NVIDIA-L20"]));
        let r = run(&[(K_GPU, "L20,H100,L20")]).unwrap();
        assert_eq!(r.node, node("nvidia.com/gpu.product", &["L20", "H100"]), "duplicates dropped, order kept");
    }

    #[test]
    fn workload_gives_pod_affinity_on_the_hostname() {
        for name in [A_WORKLOAD, K_WORKLOAD] {
            let r = run(&[(name, "deepseek-coder-33b-instruct")]).unwrap();
            assert_eq!(
                r.pod_affinity,
                Some(PodRule {
                    match_labels: pairs(&[("model.aibrix.ai/name", "deepseek-coder-33b-instruct")]),
                    topology_key: "kubernetes.io/hostname".into(),
                }),
                "{name}"
            );
            assert_eq!((r.node, r.pod_anti_affinity), (None, None));
        }
    }

    #[test]
    fn anti_affinity_selects_the_pools_own_pods() {
        for name in [A_ANTI, K_ANTI] {
            let r = run(&[(name, "true")]).unwrap();
            assert_eq!(
                r.pod_anti_affinity,
                Some(PodRule { match_labels: pool_labels(), topology_key: "kubernetes.io/hostname".into() }),
                "{name}"
            );
            assert_eq!(run(&[(name, "false")]), Ok(Rules::default()), "{name}");
        }
    }

    #[test]
    fn anti_affinity_rejects_other_values() {
        for bad in ["", "yes", "True", "1", " true"] {
            let err = run(&[(A_ANTI, bad)]).unwrap_err();
            assert!(err.starts_with(&format!("annotation {A_ANTI}={bad:?}")), "{err}");
            assert!(err.contains("\"true\" or \"false\""), "{err}");
        }
    }

    #[test]
    fn anti_affinity_without_request_labels_is_refused() {
        let err = rules(&Settings::default(), &[], &pairs(&[(K_ANTI, "true")])).unwrap_err();
        assert!(err.starts_with("annotation kvplane.io/pod-anti-affinity=\"true\""), "{err}");
        // "false" needs no labels.
        assert_eq!(rules(&Settings::default(), &[], &pairs(&[(K_ANTI, "false")])), Ok(Rules::default()));
    }

    #[test]
    fn kvplane_spelling_wins_over_aibrix() {
        let r = run(&[
            (A_ANTI, "true"),
            (A_GPU, "L20"),
            (A_KEY, "aibrix.example/gpu"),
            (A_WORKLOAD, "from-aibrix"),
            (K_ANTI, "false"),
            (K_GPU, "H100"),
            (K_KEY, "kvplane.example/gpu"),
            (K_WORKLOAD, "from-kvplane"),
        ])
        .unwrap();
        assert_eq!(r.node, node("kvplane.example/gpu", &["H100"]));
        assert_eq!(r.pod_affinity.unwrap().match_labels, pairs(&[("model.aibrix.ai/name", "from-kvplane")]));
        assert_eq!(r.pod_anti_affinity, None);
        // The losing spelling is not read, so its value cannot fail the request.
        assert!(run(&[(A_ANTI, "maybe"), (K_ANTI, "true")]).unwrap().pod_anti_affinity.is_some());
    }

    #[test]
    fn all_three_together() {
        let r = run(&[(A_GPU, "L20"), (A_WORKLOAD, "llama"), (A_ANTI, "true")]).unwrap();
        assert!(r.node.is_some() && r.pod_affinity.is_some() && r.pod_anti_affinity.is_some());
    }

    #[test]
    fn configured_topology_key_is_used_for_pod_terms_only() {
        let s = Settings::from_config(&pairs(&[("topology-key", "topology.kubernetes.io/zone")])).unwrap();
        let r = rules(&s, &pool_labels(), &pairs(&[(K_GPU, "L20"), (K_WORKLOAD, "llama"), (K_ANTI, "true")])).unwrap();
        assert_eq!(r.pod_affinity.unwrap().topology_key, "topology.kubernetes.io/zone");
        assert_eq!(r.pod_anti_affinity.unwrap().topology_key, "topology.kubernetes.io/zone");
        assert_eq!(r.node, node("nvidia.com/gpu.product", &["L20"]));
    }

    #[test]
    fn invalid_annotations_name_the_annotation() {
        // (annotations, the annotation the error must name, why)
        type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str);
        let cases: &[Case] = &[
            (&[(A_GPU, "")], A_GPU, "empty GPU type"),
            (&[(K_GPU, "L20,,H100")], K_GPU, "empty GPU type"),
            (&[(K_GPU, "L20,")], K_GPU, "empty GPU type"),
            (&[(K_GPU, "NVIDIA L20")], K_GPU, "not a label value"),
            (&[(K_GPU, &"x".repeat(64))], K_GPU, "64 characters"),
            (&[(K_GPU, "L20"), (K_KEY, "")], K_KEY, "not a node label key"),
            (&[(K_GPU, "L20"), (A_KEY, "Bad.Prefix/gpu")], A_KEY, "not a DNS subdomain"),
            (&[(K_GPU, "L20"), (K_KEY, "a/b/c")], K_KEY, "not a node label key"),
            (&[(K_KEY, "nvidia.com/gpu.product")], K_KEY, "no value to match"),
            (&[(A_WORKLOAD, "")], A_WORKLOAD, "empty workload name"),
            (&[(K_WORKLOAD, "my/model")], K_WORKLOAD, "not a label value"),
            (&[(K_WORKLOAD, "-model")], K_WORKLOAD, "begin and end"),
        ];
        for (annotations, named, why) in cases {
            let err = run(annotations).expect_err(named);
            assert!(err.starts_with(&format!("annotation {named}=")), "{err}");
            assert!(err.contains(why), "{err} should say {why:?}");
        }
    }

    #[test]
    fn config_defaults_and_errors() {
        assert_eq!(Settings::from_config(&[]).unwrap().topology_key, "kubernetes.io/hostname");
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("topology-key", "")], "config topology-key=\"\": not a label key"),
            (&[("topology-key", "zone key")], "config topology-key=\"zone key\": not a label key"),
            (&[("topology-key", "a"), ("topology-key", "b")], "config topology-key=\"b\": topology-key is set more than once"),
            (&[("node-key", "x")], "config node-key=\"x\": unknown setting"),
        ];
        for (config, want) in cases {
            let err = Settings::from_config(&pairs(config)).expect_err(want);
            assert!(err.starts_with(want), "got {err:?}, want prefix {want:?}");
        }
    }
}
