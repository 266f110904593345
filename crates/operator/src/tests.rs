//! The pure half of the operator: spec → settings → children.

use k8s_openapi::api::core::v1::EnvVar;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::CustomResourceExt;

use super::crd::{BackendType, KVCache};
use super::render::{initial_cluster, render, Names, Placements, ANNOTATION_CONFIG_HASH};
use super::resolve::{resolve, Metadata, DEFAULT_NODE_IMAGE};

fn kv(yaml: &str) -> KVCache {
    serde_yaml::from_str(yaml).expect("a KVCache")
}

fn seed() -> KVCache {
    kv(include_str!("../../../examples/kvcache/aibrix-seed.yaml"))
}

fn owner() -> OwnerReference {
    OwnerReference {
        api_version: "kvplane.io/v1alpha1".into(),
        kind: "KVCache".into(),
        name: "x".into(),
        uid: "uid-1".into(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

#[test]
fn the_crd_in_the_repository_matches_the_types() {
    let generated = super::crd_yaml().expect("renders");
    let committed = include_str!("../../../crds/kvcache.yaml");
    assert!(generated == committed, "crds/kvcache.yaml is stale: regenerate it with `cargo run -p kvplane -- crd > crds/kvcache.yaml`");
    let crd = KVCache::crd();
    assert_eq!(crd.spec.group, "kvplane.io");
    assert_eq!(crd.spec.names.short_names.as_deref(), Some(&["kvc".to_string()][..]));
    let v = &crd.spec.versions[0];
    assert!(v.subresources.as_ref().and_then(|s| s.status.as_ref()).is_some(), "status subresource");
    let columns: Vec<&str> = v.additional_printer_columns.as_ref().unwrap().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(columns, ["Backend", "Ready", "Replicas", "Age"]);
}

#[test]
fn the_aibrix_seed_example_resolves_to_a_vineyard_pool_with_one_etcd() {
    let r = resolve(&seed()).expect("valid");
    assert_eq!(r.backend, BackendType::Vineyard);
    assert!(r.backend_inferred);
    assert_eq!(r.cache.replicas, 1);
    assert_eq!(r.cache.image, "aibrix/vineyardd:20241120");
    assert_eq!(r.service_type, "ClusterIP");
    assert_eq!(r.service_ports[0].port, 9600);
    let Metadata::Etcd(plan) = &r.metadata else { panic!("an etcd run by the operator") };
    assert_eq!(plan.workload.replicas, 1);
    assert!(r.plugins.iter().any(|p| p.source.builtin.as_deref() == Some("gpu-affinity")), "default placement rule");

    let c = render(&r, &Placements::default(), &owner());
    let pod = c.cache.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.containers[0].command.as_deref(), Some(&["vineyardd".to_string()][..]));
    let args = pod.containers[0].args.as_ref().unwrap();
    assert!(args.contains(&"--rpc_socket_port=9600".to_string()), "{args:?}");
    assert!(
        args.contains(&"--etcd_endpoint=http://aibrix-deepseek-33b-kvcache-etcd-client.aibrix-system.svc:2379".to_string()),
        "{args:?}"
    );
    assert_eq!(c.rpc.metadata.name.as_deref(), Some("aibrix-deepseek-33b-kvcache"));
}

#[test]
fn every_child_is_owned_by_the_kvcache() {
    let r = resolve(&seed()).unwrap();
    let c = render(&r, &Placements::default(), &owner());
    let etcd = c.etcd.as_ref().unwrap();
    for meta in [
        &c.config.metadata,
        &c.cache.metadata,
        &c.cache_headless.metadata,
        &c.rpc.metadata,
        &etcd.peers.metadata,
        &etcd.client.metadata,
        &etcd.members.metadata,
    ] {
        assert_eq!(meta.owner_references.as_deref(), Some(&[owner()][..]), "{:?}", meta.name);
        assert_eq!(meta.namespace.as_deref(), Some("aibrix-system"));
    }
}

#[test]
fn etcd_members_form_one_cluster() {
    let k = kv(r#"
apiVersion: kvplane.io/v1alpha1
kind: KVCache
metadata: {name: pool, namespace: ns}
spec:
  metadata: {etcd: {runtime: {replicas: 3}}}
"#);
    let r = resolve(&k).unwrap();
    let Metadata::Etcd(plan) = &r.metadata else { panic!("an etcd run by the operator") };
    assert_eq!(
        initial_cluster(&r, plan),
        "pool-etcd-0=http://pool-etcd-0.pool-etcd.ns.svc:2380,pool-etcd-1=http://pool-etcd-1.pool-etcd.ns.svc:2380,pool-etcd-2=http://pool-etcd-2.pool-etcd.ns.svc:2380"
    );
    let c = render(&r, &Placements::default(), &owner());
    let etcd = c.etcd.unwrap();
    let sts = etcd.members.spec.unwrap();
    assert_eq!(sts.replicas, Some(3));
    assert_eq!(sts.service_name.as_deref(), Some("pool-etcd"));
    assert_eq!(sts.pod_management_policy.as_deref(), Some("Parallel"));
    let args = sts.template.spec.unwrap().containers[0].args.clone().unwrap();
    assert!(args.iter().any(|a| a == "--initial-cluster-state=new"));
    assert!(args.iter().any(|a| a == "--initial-cluster-token=ns-pool"), "one token for every member");
    assert_eq!(etcd.peers.spec.as_ref().unwrap().cluster_ip.as_deref(), Some("None"));
    assert_eq!(etcd.peers.spec.as_ref().unwrap().publish_not_ready_addresses, Some(true));
}

#[test]
fn a_kvplane_pool_runs_the_node_with_its_config_and_memory() {
    let k = kv(include_str!("../../../examples/kvcache/kvplane.yaml"));
    let r = resolve(&k).unwrap();
    assert_eq!(r.backend, BackendType::Kvplane);
    let c = render(&r, &Placements::default(), &owner());
    let pod = c.cache.spec.as_ref().unwrap().template.spec.clone().unwrap();
    let args = pod.containers[0].args.clone().unwrap();
    assert_eq!(args[0], "node");
    assert!(args.contains(&"--config=/etc/kvplane/node.json".to_string()));
    let config = c.config.data.as_ref().unwrap()["node.json"].clone();
    // The node parses the rendered text through the same struct, strictly.
    let file: kvplane_config::NodeConfigFile = kvplane_config::from_json_strict(&config).expect("the node reads what the operator writes");
    assert_eq!(file.memory, Some(kvplane_config::ByteSize((8u64 << 30) / 10 * 8)), "{config}");
    let names: Vec<&str> = file.plugins.iter().map(|p| p.name.as_str()).collect();
    assert!(names.contains(&"ring") && names.contains(&"backoff"), "{config}");
}

#[test]
fn a_kvplane_node_is_probed_for_readiness_on_readyz_and_for_liveness_on_livez() {
    let r = resolve(&kv(include_str!("../../../examples/kvcache/kvplane.yaml"))).unwrap();
    let c = render(&r, &Placements::default(), &owner());
    let container = c.cache.spec.unwrap().template.spec.unwrap().containers.remove(0);
    let path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.as_ref().and_then(|p| p.http_get.as_ref()).and_then(|g| g.path.clone()).unwrap_or_else(|| panic!("no HTTP probe: {p:?}"))
    };
    assert_eq!(path(&container.readiness_probe), "/readyz");
    assert_eq!(path(&container.liveness_probe), "/livez");
    assert_eq!(path(&container.startup_probe), "/livez");
    let liveness = container.liveness_probe.unwrap();
    assert!(liveness.period_seconds.unwrap() * liveness.failure_threshold.unwrap() >= 30, "{liveness:?}");
    // Vineyard serves neither route.
    let vineyard = render(&resolve(&seed()).unwrap(), &Placements::default(), &owner());
    let container = vineyard.cache.spec.unwrap().template.spec.unwrap().containers.remove(0);
    assert!(container.readiness_probe.unwrap().tcp_socket.is_some());
    assert!(container.liveness_probe.is_none() && container.startup_probe.is_none());
}

#[test]
fn spec_edits_change_the_rendered_template_so_they_roll_out() {
    let base = kv(include_str!("../../../examples/kvcache/kvplane.yaml"));
    let render_of = |k: &KVCache| render(&resolve(k).unwrap(), &Placements::default(), &owner());
    let before = render_of(&base);
    let tpl = |c: &super::render::Children| c.cache.spec.as_ref().unwrap().template.clone();

    let mut edited = base.clone();
    edited.spec.cache.as_mut().unwrap().image = Some("ghcr.io/kvplane/kvplane:0.2.0".into());
    assert_eq!(tpl(&render_of(&edited)).spec.unwrap().containers[0].image.as_deref(), Some("ghcr.io/kvplane/kvplane:0.2.0"));

    let mut edited = base.clone();
    edited.spec.cache.as_mut().unwrap().env.push(EnvVar { name: "KVPLANE_LOG".into(), value: Some("debug".into()), ..Default::default() });
    let env = tpl(&render_of(&edited)).spec.unwrap().containers[0].env.clone().unwrap();
    assert!(env.iter().any(|e| e.name == "KVPLANE_LOG"));

    let mut edited = base.clone();
    edited.spec.cache.as_mut().unwrap().replicas = Some(5);
    assert_eq!(render_of(&edited).cache.spec.unwrap().replicas, Some(5));

    // A plugin change changes the node config, and so the pod template.
    let mut edited = base.clone();
    edited.spec.plugins.pop();
    let hash = |c: &super::render::Children| tpl(c).metadata.unwrap().annotations.unwrap()[ANNOTATION_CONFIG_HASH].clone();
    assert_ne!(hash(&before), hash(&render_of(&edited)));
}

#[test]
fn placement_is_rendered_into_both_roles() {
    let r = resolve(&seed()).unwrap();
    use kvplane_runtime::scheduling::{NodeAffinity, NodeOperator, NodeRequirement, TaintEffect, Toleration, TolerationOperator};
    let cache = crate::scheduling::role_placement(&kvplane_runtime::scheduling::Placement {
        node_affinity: Some(NodeAffinity {
            required: vec![vec![NodeRequirement {
                key: "nvidia.com/gpu.product".into(),
                operator: NodeOperator::In,
                values: vec!["NVIDIA-L20".into()],
            }]],
            preferred: vec![],
        }),
        pod_affinity: None,
        pod_anti_affinity: None,
        tolerations: vec![Toleration {
            key: "nvidia.com/gpu".into(),
            operator: TolerationOperator::Exists,
            value: String::new(),
            effect: TaintEffect::Any,
            toleration_seconds: None,
        }],
        topology_spread: vec![],
    });
    let placements = Placements { cache: cache.clone(), etcd: cache };
    let c = render(&r, &placements, &owner());
    for sts in [&c.cache, &c.etcd.as_ref().unwrap().members] {
        let pod = sts.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        let na = pod.affinity.as_ref().unwrap().node_affinity.as_ref().unwrap();
        let term = &na.required_during_scheduling_ignored_during_execution.as_ref().unwrap().node_selector_terms[0];
        assert_eq!(term.match_expressions.as_ref().unwrap()[0].values.as_deref(), Some(&["NVIDIA-L20".to_string()][..]));
        assert_eq!(pod.tolerations.as_ref().unwrap().len(), 1);
    }
}

#[test]
fn aibrix_memory_shorthand_is_gib_and_sizes_are_written_in_one_spelling() {
    let head = "apiVersion: kvplane.io/v1alpha1\nkind: KVCache\nmetadata: {name: m, namespace: ns}\nspec:\n";
    for (memory, want) in [("\"2\"", "2Gi"), ("4GiB", "4Gi"), ("1G", "1000000000")] {
        let r = resolve(&kv(&format!("{head}  cacheSpec: {{memory: {memory}}}\n"))).unwrap();
        let limits = r.cache.resources.unwrap().limits.unwrap();
        assert_eq!(limits["memory"].0, want, "memory: {memory}");
    }
}

fn resolve_err(yaml: &str) -> String {
    resolve(&kv(yaml)).expect_err("invalid").to_string()
}

#[test]
fn invalid_specs_name_the_field() {
    let head = "apiVersion: kvplane.io/v1alpha1\nkind: KVCache\nmetadata: {name: bad, namespace: ns}\nspec:\n";
    let cases = [
        ("  metadata: {etcd: {replicas: 2}}", "spec.metadata.etcd.replicas: 2 members"),
        ("  backend: {type: vineyard}", "spec.cacheSpec.image: a vineyard backend needs"),
        (
            "  backend: {type: vineyard}\n  cache: {image: vineyardd}\n  auth: {tokenSecretRef: t}",
            "spec.auth.tokenSecretRef: vineyardd checks no token",
        ),
        ("  backend: {type: eic, endpoints: [\"eic:9000\"]}", "spec.plugins: an eic backend needs a backend plugin"),
        ("  backend: {type: redis, endpoints: [\"no-port\"]}", "spec.backend.endpoints[0]: \"no-port\" is not host:port"),
        (
            "  plugins:\n  - {name: a, kind: retry, source: {builtin: backoff}}\n  - {name: a, kind: retry, source: {builtin: backoff}}",
            "spec.plugins[1].name: \"a\" is declared twice",
        ),
        ("  plugins:\n  - {name: a, kind: retry, source: {builtin: nope}}", "spec.plugins[0].source.builtin: no builtin plugin \"nope\""),
        (
            "  plugins:\n  - {name: a, kind: retry, source: {builtin: backoff, url: \"https://x\"}}",
            "spec.plugins[0].source: set exactly one",
        ),
        ("  service: {type: ClusterIP, nodePort: 30001}", "spec.service.nodePort"),
        ("  metadata: {redis: {image: redis}}", "spec.metadata.redis: kvplane keeps pool metadata in etcd"),
        // Sizes follow the one shared rule set; ambiguous ones are refused by field.
        ("  cacheSpec: {memory: 4GB}", "spec.cacheSpec.memory: \"4GB\" is ambiguous"),
        ("  cacheSpec: {image: v6d, sharedMemorySize: 1MB}", "spec.cacheSpec.sharedMemorySize: \"1MB\" is ambiguous"),
        ("  metadata: {etcd: {storage: {size: 10 parsecs}}}", "spec.metadata.etcd.storage.size"),
        ("  tls: {secretName: \" \"}", "spec.tls.secretName: names no Secret"),
        ("  tls: {secretName: t, clientCA: {secretName: a, configMapName: b}}", "spec.tls.clientCA: set exactly one"),
        ("  tls: {secretName: t, clientCA: {}}", "spec.tls.clientCA: set exactly one"),
        ("  tls: {secretName: t, clientCA: {secretName: a, key: \"\"}}", "spec.tls.clientCA.key: names no key"),
        ("  backend: {type: vineyard}\n  cache: {image: vineyardd}\n  tls: {secretName: t}", "spec.tls: vineyardd speaks no TLS"),
        (
            "  metadata: {etcd: {externalConnection: {address: \"etcd:2379\", username: kv}}}",
            "spec.metadata.etcd.externalConnection.passwordSecretRef: the etcd user needs its password",
        ),
        (
            "  metadata: {etcd: {externalConnection: {address: \"etcd:2379\", passwordSecretRef: p}}}",
            "spec.metadata.etcd.externalConnection.username: passwordSecretRef needs the etcd user",
        ),
        (
            "  metadata: {etcd: {externalConnection: {address: \"https://etcd:2379\", tls: {secretName: e}}}}",
            "spec.metadata.etcd.externalConnection.address: \"https://etcd:2379\": host:port",
        ),
        (
            "  metadata: {etcd: {externalConnection: {address: \"etcd:2379\", tls: {secretName: \"\"}}}}",
            "spec.metadata.etcd.externalConnection.tls.secretName: names no Secret",
        ),
        (
            "  metadata: {redis: {externalConnection: {address: \"r:6379\", tls: {secretName: e}}}}",
            "spec.metadata.redis.externalConnection.tls: applies to an etcd",
        ),
        ("  metadata: {etcd: {tls: {secretName: \" \"}}}", "spec.metadata.etcd.tls.secretName: names no Secret"),
        ("  metadata: {etcd: {tls: {secretName: m, clientSecretName: \"\"}}}", "spec.metadata.etcd.tls.clientSecretName: names no Secret"),
        (
            "  metadata: {etcd: {tls: {secretName: m}, externalConnection: {address: \"etcd:2379\"}}}",
            "spec.metadata.etcd.tls: is for the etcd the operator runs",
        ),
        (
            "  backend: {type: vineyard}\n  cache: {image: vineyardd}\n  metadata: {etcd: {tls: {secretName: m}}}",
            "spec.metadata.etcd.tls: vineyardd is given etcd's endpoint only",
        ),
    ];
    for (body, want) in cases {
        let e = resolve_err(&format!("{head}{body}\n"));
        assert!(e.contains(want), "{body}\n  got:  {e}\n  want: {want}");
    }
    let long =
        format!("apiVersion: kvplane.io/v1alpha1\nkind: KVCache\nmetadata: {{name: {}, namespace: ns}}\nspec: {{}}\n", "a".repeat(41));
    assert!(resolve_err(&long).contains("spec.metadata.name"));
}

#[test]
fn defaults_give_a_kvplane_pool_of_one() {
    let r = resolve(&kv("apiVersion: kvplane.io/v1alpha1\nkind: KVCache\nmetadata: {name: d, namespace: ns}\nspec: {}\n")).unwrap();
    assert_eq!((r.backend, r.cache.replicas, r.cache.image.as_str()), (BackendType::Kvplane, 1, DEFAULT_NODE_IMAGE));
    let c = render(&r, &Placements::default(), &owner());
    assert_eq!(c.cache.metadata.name.as_deref(), Some(Names::cache("d").as_str()));
}

#[test]
fn every_example_resolves() {
    for (name, yaml) in [
        ("aibrix-seed", include_str!("../../../examples/kvcache/aibrix-seed.yaml")),
        ("kvplane", include_str!("../../../examples/kvcache/kvplane.yaml")),
        ("kvplane-tls", include_str!("../../../examples/kvcache/kvplane-tls.yaml")),
        ("kvplane-tenants", include_str!("../../../examples/kvcache/kvplane-tenants.yaml")),
        ("redis", include_str!("../../../examples/kvcache/redis.yaml")),
        ("vineyard", include_str!("../../../examples/kvcache/vineyard.yaml")),
        ("vineyard-tier", include_str!("../../../examples/kvcache/vineyard-tier.yaml")),
        ("eic", include_str!("../../../examples/kvcache/eic.yaml")),
    ] {
        resolve(&kv(yaml)).unwrap_or_else(|e| panic!("examples/kvcache/{name}.yaml: {e}"));
    }
}

/// The cache container and pod of a rendered pool, as JSON (what the API
/// server stores), so the assertions read like the manifest.
fn cache_pod(yaml: &str) -> (serde_json::Value, super::render::Children) {
    let c = render(&resolve(&kv(yaml)).unwrap(), &Placements::default(), &owner());
    (serde_json::to_value(c.cache.spec.as_ref().unwrap().template.spec.as_ref().unwrap()).unwrap(), c)
}

/// Issue 21, item 3: a pool applied with no auth fields is not open: the
/// node gets `--token-file` from a Secret the operator generates (rendered
/// without data: the reconciler creates it once), mounted owner-only.
#[test]
fn a_pool_with_no_auth_fields_requires_a_generated_token() {
    let (pod, c) = cache_pod(include_str!("../../../examples/kvcache/kvplane.yaml"));
    let args = pod["containers"][0]["args"].as_array().unwrap();
    assert!(args.iter().any(|a| a == "--token-file=/var/run/secrets/kvplane.io/auth/token"), "{args:?}");
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "token").expect("a token volume").clone();
    assert_eq!(volume["secret"]["secretName"], "llama-kv-token");
    assert_eq!(volume["secret"]["items"][0]["key"], "token");
    assert_eq!(volume["secret"]["defaultMode"], 0o400);
    assert_eq!(volume["secret"]["optional"], false, "a missing Secret must keep the pod from starting, not start it open");
    let mount = pod["containers"][0]["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == "token").unwrap().clone();
    assert_eq!((mount["mountPath"].as_str(), mount["readOnly"].as_bool()), (Some("/var/run/secrets/kvplane.io/auth"), Some(true)));
    assert_eq!(pod["securityContext"]["fsGroup"], 65532, "the non-root node must be able to read its 0400 token");
    let secret = c.token.expect("a token Secret to create");
    assert_eq!(secret.metadata.name.as_deref(), Some("llama-kv-token"));
    assert_eq!(secret.metadata.owner_references.as_deref(), Some(&[owner()][..]));
    assert!(secret.data.is_none() && secret.string_data.is_none(), "the renderer generates no token (it would rotate every pass)");
}

#[test]
fn a_named_token_secret_is_mounted_and_none_is_generated() {
    let yaml = concat!(include_str!("../../../examples/kvcache/kvplane.yaml"), "  auth: {tokenSecretRef: my-token}\n");
    let (pod, c) = cache_pod(yaml);
    assert!(c.token.is_none());
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "token").expect("a token volume").clone();
    assert_eq!(volume["secret"]["secretName"], "my-token");
    assert!(pod["containers"][0]["args"].as_array().unwrap().iter().any(|a| a.as_str().unwrap().starts_with("--token-file=")));
}

/// `spec.auth.tenantsSecretRef`: the tenants file mounted and served, the
/// pool's token passed as the members' cluster token only (a client with
/// it would see every tenant's keys); refused for a vineyard pool.
#[test]
fn a_tenants_secret_is_mounted_and_the_pool_token_becomes_the_members_own() {
    let yaml = concat!(include_str!("../../../examples/kvcache/kvplane.yaml"), "  auth: {tenantsSecretRef: llama-tenants}\n");
    let (pod, c) = cache_pod(yaml);
    assert!(c.token.is_some(), "the members' token is still generated");
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "tenants").expect("a tenants volume").clone();
    assert_eq!(volume["secret"]["secretName"], "llama-tenants");
    assert_eq!(volume["secret"]["items"][0]["key"], "tenants.json");
    let mount = pod["containers"][0]["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == "tenants").unwrap().clone();
    assert_eq!(mount["mountPath"], "/var/run/secrets/kvplane.io/tenants");
    let args: Vec<&str> = pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert!(args.contains(&"--tenants-file=/var/run/secrets/kvplane.io/tenants/tenants.json"), "{args:?}");
    assert!(args.contains(&"--cluster-token-file=/var/run/secrets/kvplane.io/auth/token"), "{args:?}");
    assert!(!args.iter().any(|a| a.starts_with("--token-file=")), "no client tenant gets the members' token: {args:?}");
    let vineyard = concat!(include_str!("../../../examples/kvcache/vineyard.yaml"), "  auth: {tenantsSecretRef: t}\n");
    let e = resolve(&kv(vineyard)).unwrap_err().to_string();
    assert!(e.contains("auth.tenantsSecretRef") && e.contains("vineyardd"), "{e}");
}

/// Every example whose node listens on every address gets a token: the
/// node would refuse to start otherwise. vineyardd has no token to give.
#[test]
fn every_example_pool_listening_beyond_loopback_has_a_token() {
    for (name, yaml) in [
        ("kvplane", include_str!("../../../examples/kvcache/kvplane.yaml")),
        ("kvplane-tls", include_str!("../../../examples/kvcache/kvplane-tls.yaml")),
        ("redis", include_str!("../../../examples/kvcache/redis.yaml")),
        ("vineyard-tier", include_str!("../../../examples/kvcache/vineyard-tier.yaml")),
        ("eic", include_str!("../../../examples/kvcache/eic.yaml")),
        ("vineyard", include_str!("../../../examples/kvcache/vineyard.yaml")),
        ("aibrix-seed", include_str!("../../../examples/kvcache/aibrix-seed.yaml")),
    ] {
        let (pod, _) = cache_pod(yaml);
        let args: Vec<&str> = pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        if args.first() == Some(&"node") {
            assert!(args.iter().any(|a| a.starts_with("--listen=0.0.0.0")), "{name}: {args:?}");
            assert!(
                args.iter().any(|a| a.starts_with("--token-file=") || a.starts_with("--tenants-file=")),
                "examples/kvcache/{name}.yaml renders an open node: {args:?}"
            );
        }
    }
}

/// Issue 19: `spec.tiering` reaches the node's config as written (the node
/// reads it back strictly), and what the node would refuse at start is
/// refused here by the node's own validation, naming `spec.tiering.<field>`.
#[test]
fn tiering_settings_are_rendered_into_the_node_config_and_checked_as_the_node_checks_them() {
    let redis = include_str!("../../../examples/kvcache/redis.yaml");
    let with = |tiering: &str| format!("{redis}  tiering: {tiering}\n");
    let node_file = |yaml: &str| -> kvplane_config::NodeConfigFile {
        let c = render(&resolve(&kv(yaml)).unwrap(), &Placements::default(), &owner());
        kvplane_config::from_json_strict(&c.config.data.as_ref().unwrap()["node.json"]).expect("the node reads what the operator writes")
    };
    // Absent: nothing rendered, the node's defaults apply.
    assert_eq!(node_file(redis).tiering, None);
    let file = node_file(&with("{write: through, maxInFlight: 32Mi, atBound: skip, deadlineMs: 5000, writers: 4}"));
    let t = file.tiering.clone().expect("tiering rendered");
    assert_eq!(t.write, kvplane_config::WriteMode::Through);
    assert_eq!(t.mode, kvplane_config::IngestMode::All, "a field left out keeps the node's default");
    assert_eq!((t.max_in_flight.bytes(), t.at_bound, t.deadline_ms, t.writers), (32 << 20, kvplane_config::AtBound::Skip, 5000, 4));
    file.validate().expect("the rendered file passes the node's own validation");
    assert_eq!(node_file(&with("{mode: on-evict}")).tiering.unwrap().write, kvplane_config::WriteMode::Behind);

    let refused = |yaml: &str| resolve(&kv(yaml)).expect_err("refused").to_string();
    let e = refused(&with("{write: through, mode: hot}"));
    assert!(e.starts_with("spec.tiering.write: through applies to mode all"), "{e}");
    let head = "apiVersion: kvplane.io/v1alpha1\nkind: KVCache\nmetadata: {name: t, namespace: ns}\nspec:\n";
    let fail_open = format!(
        "{head}  backend: {{type: redis, endpoints: [\"redis:6379\"]}}\n  plugins:\n  - {{name: store, kind: backend, source: {{builtin: resp}}, \
         failurePolicy: failOpen, allowedEndpoints: [\"redis:6379\"]}}\n  tiering: {{write: through}}\n"
    );
    let e = refused(&fail_open);
    assert!(e.starts_with("spec.tiering.write: through needs the backend's failurePolicy failClosed"), "{e}");
    let e = refused(&with("{writers: 0}"));
    assert!(e.starts_with("spec.tiering.writers"), "{e}");
    let e = refused(&format!("{head}  tiering: {{write: behind}}\n"));
    assert!(e.starts_with("spec.tiering: no backend plugin"), "{e}");
    let e = refused(&format!("{head}  backend: {{type: vineyard}}\n  cache: {{image: vineyardd}}\n  tiering: {{}}\n"));
    assert!(e.starts_with("spec.tiering: a vineyard pool"), "{e}");
}

fn args_of(pod: &serde_json::Value) -> Vec<String> {
    pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect()
}

fn named<'a>(list: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    list.as_array().and_then(|l| l.iter().find(|v| v["name"] == name))
}

/// Issue 21, item 3: `spec.tls` puts the kubernetes.io/tls Secret into the
/// cache pods as a directory (never subPath, which the kubelet does not
/// update: cert-manager's renewal must reach the node's reload), not
/// optional, with the node flags that name its files; the client CA for
/// mutual TLS from a Secret key or a ConfigMap key. The token stays, and
/// probes and Services do not change.
#[test]
fn a_pool_with_tls_mounts_its_secret_as_a_directory_and_names_the_files() {
    let plain = include_str!("../../../examples/kvcache/kvplane.yaml");
    let yaml = format!("{plain}  tls:\n    secretName: llama-kv-tls\n    clientCA: {{secretName: llama-kv-tls}}\n");
    let (pod, c) = cache_pod(&yaml);
    let args = args_of(&pod);
    for want in [
        "--tls-cert=/var/run/secrets/kvplane.io/tls/tls.crt",
        "--tls-key=/var/run/secrets/kvplane.io/tls/tls.key",
        "--tls-client-ca=/var/run/secrets/kvplane.io/tls-client-ca/ca.crt",
        "--token-file=/var/run/secrets/kvplane.io/auth/token",
    ] {
        assert!(args.iter().any(|a| a == want), "{want} not in {args:?}");
    }
    let tls = named(&pod["volumes"], "tls").expect("a tls volume");
    assert_eq!(tls["secret"]["secretName"], "llama-kv-tls");
    assert_eq!(tls["secret"]["optional"], false, "a missing Secret must keep the pod from starting");
    let keys: Vec<&str> = tls["secret"]["items"].as_array().unwrap().iter().map(|i| i["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["tls.crt", "tls.key", "ca.crt"]);
    let ca = named(&pod["volumes"], "tls-client-ca").expect("a client CA volume");
    assert_eq!(
        (&ca["secret"]["secretName"], &ca["secret"]["items"][0]["key"], &ca["secret"]["items"][0]["path"]),
        (&"llama-kv-tls".into(), &"ca.crt".into(), &"ca.crt".into())
    );
    for (volume, dir) in [("tls", "/var/run/secrets/kvplane.io/tls"), ("tls-client-ca", "/var/run/secrets/kvplane.io/tls-client-ca")] {
        let mount = named(&pod["containers"][0]["volumeMounts"], volume).unwrap_or_else(|| panic!("no {volume} mount"));
        assert_eq!((mount["mountPath"].as_str(), mount["readOnly"].as_bool()), (Some(dir), Some(true)));
        assert!(mount.get("subPath").is_none(), "a subPath mount is never updated by the kubelet: {mount}");
    }
    // The admin port and the Services are the same as without TLS.
    let (plain_pod, plain_children) = cache_pod(plain);
    assert_eq!(pod["containers"][0]["readinessProbe"], plain_pod["containers"][0]["readinessProbe"]);
    assert_eq!(pod["containers"][0]["readinessProbe"]["httpGet"]["port"], 9601);
    assert_eq!(pod["containers"][0]["livenessProbe"], plain_pod["containers"][0]["livenessProbe"]);
    assert_eq!(c.rpc, plain_children.rpc);
    assert_eq!(c.cache_headless, plain_children.cache_headless);

    // A client CA from a ConfigMap (trust-manager's Bundle target).
    let yaml = format!("{plain}  tls:\n    secretName: t\n    clientCA: {{configMapName: bundle, key: trust.pem}}\n");
    let (pod, _) = cache_pod(&yaml);
    let ca = named(&pod["volumes"], "tls-client-ca").unwrap();
    assert_eq!(
        (&ca["configMap"]["name"], &ca["configMap"]["items"][0]["key"], &ca["configMap"]["optional"]),
        (&"bundle".into(), &"trust.pem".into(), &false.into())
    );
    // Without clientCA: no client CA flag (the token is the credential).
    let (pod, _) = cache_pod(&format!("{plain}  tls: {{secretName: t}}\n"));
    assert!(!args_of(&pod).iter().any(|a| a.starts_with("--tls-client-ca")));
    assert!(named(&pod["volumes"], "tls-client-ca").is_none());
}

/// An external etcd with TLS and a user: the node's config names the
/// mounted files under cluster.etcd, the endpoint is https://, and the
/// rendered file passes the node's own validation.
#[test]
fn an_external_etcd_with_tls_and_a_user_is_rendered_into_the_node_config() {
    let yaml = "apiVersion: kvplane.io/v1alpha1\nkind: KVCache\nmetadata: {name: ext, namespace: ns}\nspec:\n  metadata:\n    etcd:\n      externalConnection: {address: \"etcd.infra:2379\", username: kvplane, passwordSecretRef: etcd-pw, tls: {secretName: etcd-client}}\n";
    let r = resolve(&kv(yaml)).unwrap();
    let c = render(&r, &Placements::default(), &owner());
    let text = c.config.data.as_ref().unwrap()["node.json"].clone();
    let file: kvplane_config::NodeConfigFile = kvplane_config::from_json_strict(&text).unwrap();
    file.validate().unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(file.metadata, Some(kvplane_config::MetadataEndpoints::Etcd(vec!["https://etcd.infra:2379".into()])));
    let etcd = file.cluster.unwrap().etcd.unwrap();
    let tls = etcd.tls.unwrap();
    assert_eq!(tls.ca_file.to_str(), Some("/var/run/secrets/kvplane.io/etcd-tls/ca.crt"));
    assert_eq!(tls.cert_file.as_deref().and_then(|p| p.to_str()), Some("/var/run/secrets/kvplane.io/etcd-tls/tls.crt"));
    assert_eq!(tls.key_file.as_deref().and_then(|p| p.to_str()), Some("/var/run/secrets/kvplane.io/etcd-tls/tls.key"));
    let auth = etcd.auth.unwrap();
    assert_eq!((auth.username.as_str(), auth.password_file.to_str()), ("kvplane", Some("/var/run/secrets/kvplane.io/etcd-auth/password")));
    let pod = serde_json::to_value(c.cache.spec.as_ref().unwrap().template.spec.as_ref().unwrap()).unwrap();
    assert_eq!(named(&pod["volumes"], "etcd-tls").unwrap()["secret"]["secretName"], "etcd-client");
    assert_eq!(named(&pod["volumes"], "etcd-auth").unwrap()["secret"]["items"][0]["key"], "password");
    // The operator's own etcd: plain, no cluster.etcd.
    let (pod, c) = cache_pod(include_str!("../../../examples/kvcache/kvplane.yaml"));
    let file: kvplane_config::NodeConfigFile = kvplane_config::from_json_strict(&c.config.data.as_ref().unwrap()["node.json"]).unwrap();
    assert!(file.cluster.unwrap().etcd.is_none());
    assert!(named(&pod["volumes"], "etcd-tls").is_none());
}

/// The etcd the operator runs, with `metadata.etcd.tls`: its members serve
/// both ports over TLS and require client certificates, the cache pods
/// mount the client certificate and their node config names it, and the
/// endpoint is https://. With or without TLS, a NetworkPolicy lets only
/// the pool's own pods reach the members.
#[test]
fn the_operators_etcd_with_tls_requires_client_certificates_and_only_the_pool_reaches_it() {
    let yaml = "apiVersion: kvplane.io/v1alpha1\nkind: KVCache\nmetadata: {name: pool, namespace: ns}\nspec:\n  metadata:\n    etcd: {replicas: 3, tls: {secretName: etcd-members, clientSecretName: etcd-client}}\n";
    let r = resolve(&kv(yaml)).unwrap();
    let c = render(&r, &Placements::default(), &owner());
    let etcd = c.etcd.as_ref().unwrap();
    let member = serde_json::to_value(etcd.members.spec.as_ref().unwrap().template.spec.as_ref().unwrap()).unwrap();
    let args = args_of(&member);
    for flag in [
        "--cert-file=/var/run/secrets/kvplane.io/etcd-member-tls/tls.crt",
        "--trusted-ca-file=/var/run/secrets/kvplane.io/etcd-member-tls/ca.crt",
        "--client-cert-auth",
        "--peer-cert-file=/var/run/secrets/kvplane.io/etcd-member-tls/tls.crt",
        "--peer-client-cert-auth",
        "--listen-client-urls=https://0.0.0.0:2379",
        "--listen-peer-urls=https://0.0.0.0:2380",
        "--advertise-client-urls=https://$(POD_NAME).pool-etcd.ns.svc:2379",
    ] {
        assert!(args.iter().any(|a| a == flag), "{flag} missing from {args:?}");
    }
    let cluster = args.iter().find_map(|a| a.strip_prefix("--initial-cluster=")).unwrap();
    assert_eq!(cluster.matches("=https://").count(), 3, "{cluster}");
    assert_eq!(named(&member["volumes"], "tls").unwrap()["secret"]["secretName"], "etcd-members");
    let text = c.config.data.as_ref().unwrap()["node.json"].clone();
    let file: kvplane_config::NodeConfigFile = kvplane_config::from_json_strict(&text).unwrap();
    file.validate().unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(file.metadata, Some(kvplane_config::MetadataEndpoints::Etcd(vec!["https://pool-etcd-client.ns.svc:2379".into()])));
    let tls = file.cluster.unwrap().etcd.unwrap().tls.unwrap();
    assert_eq!(tls.cert_file.as_deref().and_then(|p| p.to_str()), Some("/var/run/secrets/kvplane.io/etcd-tls/tls.crt"));
    let pod = serde_json::to_value(c.cache.spec.as_ref().unwrap().template.spec.as_ref().unwrap()).unwrap();
    assert_eq!(named(&pod["volumes"], "etcd-tls").unwrap()["secret"]["secretName"], "etcd-client");

    let policy = serde_json::to_value(&etcd.policy).unwrap();
    assert_eq!(policy["metadata"]["name"], "pool-etcd");
    assert_eq!(policy["spec"]["podSelector"]["matchLabels"]["kvplane.io/role"], "etcd");
    assert_eq!(policy["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    let rules = policy["spec"]["ingress"].as_array().unwrap();
    let from: Vec<(&str, &str, usize)> = rules
        .iter()
        .map(|r| {
            let labels = &r["from"][0]["podSelector"]["matchLabels"];
            (
                labels["kvplane.io/kvcache"].as_str().unwrap(),
                labels["kvplane.io/role"].as_str().unwrap(),
                r["ports"].as_array().unwrap().len(),
            )
        })
        .collect();
    assert_eq!(from, [("pool", "cache", 1), ("pool", "etcd", 2)]);

    // Without tls: plain members, no cluster.etcd, the same policy.
    let plain = render(
        &resolve(&kv(&yaml.replace(", tls: {secretName: etcd-members, clientSecretName: etcd-client}", ""))).unwrap(),
        &Placements::default(),
        &owner(),
    );
    let plain_etcd = plain.etcd.as_ref().unwrap();
    let member = serde_json::to_value(plain_etcd.members.spec.as_ref().unwrap().template.spec.as_ref().unwrap()).unwrap();
    assert!(!args_of(&member).iter().any(|a| a.contains("tls") || a.contains("cert")), "{:?}", args_of(&member));
    assert_eq!(plain_etcd.policy, etcd.policy);
    let file: kvplane_config::NodeConfigFile = kvplane_config::from_json_strict(&plain.config.data.as_ref().unwrap()["node.json"]).unwrap();
    assert!(file.cluster.unwrap().etcd.is_none());
}

/// examples/kvcache/kvplane-tenants.yaml and its files agree: the tenants
/// Secret holds a tenants file the node would take, the pool serves it,
/// and the etcd Certificates write the Secrets `metadata.etcd.tls` names,
/// for the names and usages docs/security.md asks of them.
#[test]
fn the_tenants_example_and_its_secrets_agree() {
    let (pod, c) = cache_pod(include_str!("../../../examples/kvcache/kvplane-tenants.yaml"));
    let docs = |text: &str| -> Vec<serde_yaml::Value> {
        serde_yaml::Deserializer::from_str(text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect()
    };
    let secret = &docs(include_str!("../../../examples/kvcache/tenants/secret.yaml"))[0];
    let tenants: kvplane_config::TenantsFile =
        kvplane_config::from_json_strict(secret["stringData"]["tenants.json"].as_str().unwrap()).unwrap();
    tenants.validate(false).unwrap();
    assert_eq!(tenants.tenants.len(), 2);
    let mounted = pod["volumes"].as_array().unwrap().iter().filter_map(|v| v["secret"]["secretName"].as_str()).collect::<Vec<_>>();
    assert!(mounted.contains(&secret["metadata"]["name"].as_str().unwrap()), "{mounted:?}");
    assert!(args_of(&pod).iter().any(|a| a.starts_with("--tenants-file=")), "{:?}", args_of(&pod));

    let certificates = docs(include_str!("../../../examples/kvcache/tenants/etcd-certificates.yaml"));
    let certificate = |secret: &str| {
        certificates
            .iter()
            .find(|d| d["kind"] == "Certificate" && d["spec"]["secretName"] == secret)
            .unwrap_or_else(|| panic!("no Certificate writes {secret}"))
    };
    let member = serde_json::to_value(c.etcd.as_ref().unwrap().members.spec.as_ref().unwrap().template.spec.as_ref().unwrap()).unwrap();
    let members = certificate(named(&member["volumes"], "tls").unwrap()["secret"]["secretName"].as_str().unwrap());
    let names: Vec<&str> = members["spec"]["dnsNames"].as_sequence().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    assert_eq!(names, ["*.shared-kv-etcd.default.svc", "shared-kv-etcd-client.default.svc"]);
    let usages: Vec<&str> = members["spec"]["usages"].as_sequence().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    assert!(usages.contains(&"server auth") && usages.contains(&"client auth"), "{usages:?}");
    let client = certificate(named(&pod["volumes"], "etcd-tls").unwrap()["secret"]["secretName"].as_str().unwrap());
    assert_eq!(client["spec"]["issuerRef"], members["spec"]["issuerRef"]);
}

/// examples/kvcache/kvplane-tls.yaml and its engine pod agree: the pool
/// serves TLS from the Secret its Certificate writes, and the engine pod
/// reads the CA and the token from the Secrets the pool has.
#[test]
fn the_tls_example_and_its_engine_pod_name_the_same_secrets() {
    let (pod, c) = cache_pod(include_str!("../../../examples/kvcache/kvplane-tls.yaml"));
    assert!(args_of(&pod).iter().any(|a| a == "--tls-cert=/var/run/secrets/kvplane.io/tls/tls.crt"));
    let tls = named(&pod["volumes"], "tls").unwrap()["secret"]["secretName"].as_str().unwrap().to_owned();
    let token = c.token.as_ref().and_then(|t| t.metadata.name.clone()).unwrap();
    let certificate: Vec<serde_yaml::Value> =
        serde_yaml::Deserializer::from_str(include_str!("../../../examples/kvcache/tls/certificate.yaml"))
            .map(|d| serde::Deserialize::deserialize(d).unwrap())
            .collect();
    let written: Vec<&str> =
        certificate.iter().filter(|d| d["kind"] == "Certificate").map(|d| d["spec"]["secretName"].as_str().unwrap()).collect();
    assert!(written.contains(&tls.as_str()), "{written:?} {tls}");
    assert!(written.contains(&named(&pod["volumes"], "etcd-tls").unwrap()["secret"]["secretName"].as_str().unwrap()));
    let engine: serde_yaml::Value = serde_yaml::from_str(include_str!("../../../examples/kvcache/tls/engine-pod.yaml")).unwrap();
    let spec = &engine["spec"];
    assert_eq!(spec["volumes"][0]["secret"]["secretName"].as_str(), Some(tls.as_str()));
    assert_eq!(spec["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["name"].as_str(), Some(token.as_str()));
    let extra = spec["containers"][0]["args"][2].as_str().unwrap();
    let extra: serde_json::Value = serde_json::from_str(extra).unwrap();
    assert_eq!(extra["kv_connector_extra_config"]["tls_ca"], "/var/run/secrets/kvplane.io/ca/ca.crt");
}

/// Issue 21, item 1 follow-up: a pool with `spec.tls` is a cluster whose
/// members copy blocks to each other over TLS: node.json's
/// `cluster.peerTls` names the TLS Secret's `ca.crt` (mounted beside
/// `tls.crt`) and the name every pod's certificate carries,
/// `NAME-cache.NAMESPACE.svc`; with `clientCA` the members present their
/// own certificate. Without `spec.tls`, none.
#[test]
fn a_pool_with_tls_renders_the_tls_its_members_speak_to_each_other() {
    let plain = include_str!("../../../examples/kvcache/kvplane.yaml");
    let peer_tls = |yaml: &str| {
        let (_, c) = cache_pod(yaml);
        let text = c.config.data.as_ref().unwrap()["node.json"].clone();
        let file: kvplane_config::NodeConfigFile = kvplane_config::from_json_strict(&text).unwrap();
        file.validate().unwrap_or_else(|e| panic!("{e}: {text}"));
        file.cluster.expect("a kvplane pool is a cluster").peer_tls
    };
    let path = |p: &Option<std::path::PathBuf>| p.as_deref().and_then(|p| p.to_str()).map(str::to_owned);
    let r = resolve(&kv(plain)).unwrap();
    let service = format!("{}-cache.{}.svc", r.name, r.namespace);

    let mutual = peer_tls(&format!("{plain}  tls:\n    secretName: llama-kv-tls\n    clientCA: {{secretName: llama-kv-tls}}\n")).unwrap();
    assert_eq!(mutual.ca_file.to_str(), Some("/var/run/secrets/kvplane.io/tls/ca.crt"));
    assert_eq!(path(&mutual.cert_file).as_deref(), Some("/var/run/secrets/kvplane.io/tls/tls.crt"));
    assert_eq!(path(&mutual.key_file).as_deref(), Some("/var/run/secrets/kvplane.io/tls/tls.key"));
    assert_eq!(mutual.server_name.as_deref(), Some(service.as_str()));

    let server_only = peer_tls(&format!("{plain}  tls: {{secretName: t}}\n")).unwrap();
    assert_eq!(server_only.ca_file.to_str(), Some("/var/run/secrets/kvplane.io/tls/ca.crt"));
    assert_eq!((server_only.cert_file, server_only.key_file), (None, None), "no client CA: peers present no certificate");
    assert_eq!(server_only.server_name.as_deref(), Some(service.as_str()));

    assert!(peer_tls(plain).is_none(), "a pool without spec.tls has plain peers");
}
