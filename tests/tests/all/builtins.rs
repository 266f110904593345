//! Every builtin plugin passes its world's conformance kit, through the same
//! runtime the node and operator use.

use kvplane_plugin_kit::conformance;
use kvplane_runtime::{PluginDecl, PluginRuntime, PluginSource, World};

fn decl(name: &str, world: World) -> PluginDecl {
    PluginDecl::new(format!("builtin:{name}"), world, PluginSource::Builtin(name.into()))
}

fn runtime() -> PluginRuntime {
    PluginRuntime::new(None).expect("creating the plugin runtime")
}

#[tokio::test]
async fn ring_passes_the_key_placement_kit() {
    let report = conformance::key_placement(&runtime().load_key_placement(decl("ring", World::KeyPlacement)).unwrap()).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}

/// `builtin:ring`'s table is the native fail-open default's, slot for slot,
/// with members in every state and of several weights.
#[tokio::test]
async fn ring_agrees_with_the_native_ring() {
    use kvplane_slots::{Member, MemberState, SLOTS};
    let ring = runtime().load_key_placement(decl("ring", World::KeyPlacement)).unwrap();
    let mut members: Vec<Member> = (0..7).map(|i| Member::up(format!("n{i}"), format!("h{i}:1"))).collect();
    members[1].state = MemberState::Draining;
    members[2].state = MemberState::Down;
    members[3].state = MemberState::Joining;
    members[4].weight = 300;
    let wasm = ring.compute(1, members.clone(), SLOTS, 3).await.unwrap();
    let native = kvplane_runtime::worlds::native_slot_table(1, members, SLOTS, 3).unwrap();
    assert_eq!(wasm, native);
}

#[tokio::test]
async fn backoff_passes_the_retry_kit() {
    let mut d = decl("backoff", World::RetryPolicy);
    d.config.insert("budget-ms".into(), conformance::RETRY_BUDGET_MS.to_string());
    let report = conformance::retry_policy(&runtime().load_retry_policy(d).unwrap(), conformance::RETRY_BUDGET_MS).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}

#[tokio::test]
async fn gpu_affinity_passes_the_placement_rule_kit() {
    let report = conformance::placement_rule(&runtime().load_placement_rule(decl("gpu-affinity", World::PlacementRule)).unwrap()).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}

/// The AIBrix example's annotations turn into the affinity AIBrix users
/// expect, for both roles of the pool.
#[tokio::test]
async fn gpu_affinity_renders_aibrix_annotations() {
    use kvplane_runtime::scheduling::PodRequest;
    let rule = runtime().load_placement_rule(decl("gpu-affinity", World::PlacementRule)).unwrap();
    for role in ["cache", "etcd"] {
        let placement = rule
            .place(PodRequest {
                role: role.into(),
                name: "aibrix-deepseek-33b-kvcache".into(),
                labels: vec![("kvplane.io/name".into(), "aibrix-deepseek-33b-kvcache".into()), ("kvplane.io/role".into(), role.into())],
                annotations: vec![
                    ("kvcache.orchestration.aibrix.ai/node-affinity-gpu-type".into(), "NVIDIA-L20".into()),
                    ("kvcache.orchestration.aibrix.ai/pod-affinity-workload".into(), "deepseek-coder-33b-instruct".into()),
                    ("kvplane.io/pod-anti-affinity".into(), "true".into()),
                ],
                replicas: 3,
            })
            .await
            .unwrap();
        let v = kvplane_operator::scheduling::to_pod_spec_json(&placement);
        let node =
            &v["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0];
        assert_eq!(node, &serde_json::json!({"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L20"]}), "{role}: {v}");
        let pod = &v["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0];
        assert_eq!(pod["labelSelector"]["matchLabels"]["model.aibrix.ai/name"], "deepseek-coder-33b-instruct", "{role}: {v}");
        assert_eq!(pod["topologyKey"], "kubernetes.io/hostname");
        let anti = &v["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0];
        assert_eq!(anti["labelSelector"]["matchLabels"]["kvplane.io/role"], role, "{role}: {v}");
    }
}
