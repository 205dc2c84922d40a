//! A property of the operator over specs it has never seen: random TrainingJobs and
//! DataStages generated from the CRDs' own schemas (optional fields present or not,
//! boundary numbers, hostile strings) are applied to the real API server with the operator
//! running. Every object the API server accepts gets a status for its generation within a
//! few seconds, whatever its children meet (refusals, quota), and the operator never panics
//! or stops. The figures are printed.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Operator, TestNamespace, client, ensure_crds};
use kube::api::{Api, DynamicObject, PostParams};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};

/// Panics anywhere in this test process (the operator runs in it).
static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Strings that are valid in many places, and strings that are valid almost nowhere.
const STRINGS: &[&str] = &[
    "a",
    "gpu",
    "resnet",
    "data-1",
    "ml.example.com",
    "/data",
    "imagenet/",
    "Standard_ND96asr_v4",
    "Standard_D4s_v5",
    "myregistry.azurecr.io/trainer:1",
    "http://127.0.0.1:10000/devstoreaccount1",
    "10Gi",
    "",
    " ",
    "a b",
    "ä",
    "../x",
    "-x",
    "UPPER",
    "ringmaster.dev/x",
    "x\ny",
    "'; DROP TABLE jobs; --",
    "sv=2024&sig=secret",
];

/// Keys of generated maps (labels, selectors, annotations, env of InfiniBand).
const KEYS: &[&str] = &[
    "app",
    "example.com/team",
    "NCCL_DEBUG",
    "kubernetes.azure.com/agentpool",
    "bad key",
    "ringmaster.dev/job-name",
    "",
];

/// Draws a value for `schema` (a structural OpenAPI v3 schema). A `careful` generator keeps
/// to each field's enum, pattern, length and range (so that many objects pass the schema and
/// meet the operator); a careless one crosses them at random.
struct Generator {
    rng: StdRng,
    careful: bool,
}

impl Generator {
    fn value(&mut self, schema: &Value, depth: usize) -> Value {
        if let Some(values) = schema["enum"].as_array() {
            return if self.careful || self.rng.random_bool(0.95) {
                values.choose(&mut self.rng).cloned().unwrap_or(Value::Null)
            } else {
                json!("NotAnEnumValue")
            };
        }
        if schema["x-kubernetes-int-or-string"] == true {
            return if self.careful {
                json!(["1", "64Gi", "10Gi", "500m"].choose(&mut self.rng))
            } else if self.rng.random_bool(0.5) {
                json!(self.rng.random_range(0..4))
            } else {
                json!(["1", "64Gi", "500m", "1k", "-1", "x"].choose(&mut self.rng))
            };
        }
        match schema["type"].as_str() {
            Some("object") => self.object(schema, depth),
            Some("array") => {
                let max = schema["maxItems"].as_u64().unwrap_or(3).min(3) as usize;
                let min = if self.careful {
                    schema["minItems"].as_u64().unwrap_or(0) as usize
                } else {
                    0
                };
                let n = if depth > 4 {
                    min
                } else {
                    self.rng.random_range(min..=max.max(min))
                };
                Value::Array(
                    (0..n)
                        .map(|_| self.value(&schema["items"], depth + 1))
                        .collect(),
                )
            }
            Some("string") => json!(self.string(schema)),
            Some("integer") => json!(self.integer(schema)),
            Some("number") => {
                let v = self.integer(schema) as f64;
                json!(if self.rng.random_bool(0.3) {
                    v / 10.0
                } else {
                    v
                })
            }
            Some("boolean") => json!(self.rng.random_bool(0.5)),
            _ => Value::Null,
        }
    }

    fn object(&mut self, schema: &Value, depth: usize) -> Value {
        let mut out = Map::new();
        if let Some(properties) = schema["properties"].as_object() {
            let required: Vec<&str> = schema["required"]
                .as_array()
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            // Optional fields thin out with depth, so Kubernetes' own deep types stay small.
            let chance = if self.careful { 0.3 } else { 0.5 } / (depth as f64 + 1.0);
            let chance = chance.max(0.05);
            // An object of optional fields only, with rules, is mostly "exactly one of"
            // (a destination, an auth method): a careful generator sets exactly one.
            let one_of = self.careful
                && required.is_empty()
                && schema["x-kubernetes-validations"].is_array();
            let only = if one_of {
                let names: Vec<&String> = properties.keys().collect();
                names.choose(&mut self.rng).map(|n| n.to_string())
            } else {
                None
            };
            for (name, property) in properties {
                let wanted = match &only {
                    Some(only) => only == name,
                    None => required.contains(&name.as_str()) || self.rng.random_bool(chance),
                };
                if wanted {
                    out.insert(name.clone(), self.value(property, depth + 1));
                }
            }
        } else if schema["additionalProperties"].is_object() {
            let n = if depth > 4 {
                0
            } else {
                self.rng.random_range(0..=2)
            };
            for _ in 0..n {
                let keys = if self.careful { &KEYS[..4] } else { KEYS };
                let key = keys.choose(&mut self.rng).unwrap().to_string();
                let value = self.value(&schema["additionalProperties"], depth + 1);
                out.insert(key, value);
            }
        }
        Value::Object(out)
    }

    fn string(&mut self, schema: &Value) -> String {
        let max = schema["maxLength"].as_u64();
        if self.careful {
            let min = schema["minLength"].as_u64().unwrap_or(0) as usize;
            let pattern = schema["pattern"]
                .as_str()
                .map(|p| regex::Regex::new(p).expect("the CRD's patterns compile"));
            let fits: Vec<&str> = STRINGS
                .iter()
                .copied()
                .filter(|s| s.len() >= min && max.is_none_or(|m| s.len() as u64 <= m))
                .filter(|s| pattern.as_ref().is_none_or(|p| p.is_match(s)))
                .collect();
            return fits
                .choose(&mut self.rng)
                .copied()
                .unwrap_or("a")
                .to_string();
        }
        match self.rng.random_range(0..10) {
            // At the length limit and one past it.
            0 if max.is_some() => {
                let n = max.unwrap() as usize + usize::from(self.rng.random_bool(0.5));
                "a".repeat(n.min(5000))
            }
            _ => STRINGS.choose(&mut self.rng).unwrap().to_string(),
        }
    }

    fn integer(&mut self, schema: &Value) -> i64 {
        let bound = |key: &str| schema[key].as_f64().map(|v| v as i64);
        let (min, max) = (bound("minimum"), bound("maximum"));
        let mut candidates = vec![0, 1, 2, -1, i64::from(i32::MAX)];
        for bound in [min, max].into_iter().flatten() {
            candidates.extend([bound, bound - 1, bound + 1]);
        }
        // Mostly small valid numbers, so that many objects are accepted and run.
        if self.careful || self.rng.random_bool(0.6) {
            let low = min.unwrap_or(0).max(0);
            let high = max.unwrap_or(low + 4).min(low + 4).max(low);
            return self.rng.random_range(low..=high);
        }
        *candidates.choose(&mut self.rng).unwrap()
    }
}

fn spec_schema(kind: &str) -> Value {
    let crd = ringmaster::crdgen::all()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap();
    let schema = serde_json::to_value(
        &crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema,
    )
    .unwrap();
    schema["properties"]["spec"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_accepted_random_spec_gets_a_status_and_the_operator_never_panics() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "property").await;
    // A pod quota keeps the accepted jobs from filling the cluster; the refusals it causes
    // are part of what the operator must report.
    let quotas: Api<k8s_openapi::api::core::v1::ResourceQuota> =
        Api::namespaced(client.clone(), &ns.name);
    quotas
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "pods"}, "spec": {"hard": {"pods": "40"}}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    let operator = Operator::start(&client, &ns.name).await;

    let seed: u64 = std::env::var("PROPERTY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261122);
    let count: usize = std::env::var("PROPERTY_COUNT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let mut generator = Generator {
        rng: StdRng::seed_from_u64(seed),
        careful: false,
    };
    // (api, name, generation, whether its runPolicy lets the operator delete it when done)
    let mut accepted: Vec<(Api<DynamicObject>, String, i64, bool)> = Vec::new();
    let (mut refused, mut other_errors) = (0, Vec::new());
    let schemas = [spec_schema("TrainingJob"), spec_schema("DataStage")];
    for i in 0..count {
        let (kind, schema) = if i % 3 == 2 {
            ("DataStage", &schemas[1])
        } else {
            ("TrainingJob", &schemas[0])
        };
        generator.careful = i % 2 == 0;
        let name = format!("p{i}");
        let object = json!({
            "apiVersion": "ringmaster.dev/v1alpha1",
            "kind": kind,
            "metadata": {"name": name},
            "spec": generator.value(schema, 0),
        });
        let api = common::dynamic_api(&client, &object, &ns.name);
        let has_ttl = object["spec"]["runPolicy"]["ttlSecondsAfterFinished"].is_number();
        let object: DynamicObject = serde_json::from_value(object).unwrap();
        match api.create(&PostParams::default(), &object).await {
            Ok(created) => {
                let generation = created.metadata.generation.unwrap_or(1);
                accepted.push((api, name, generation, has_ttl));
            }
            Err(kube::Error::Api(status)) if status.code == 422 || status.code == 400 => {
                if std::env::var_os("PROPERTY_VERBOSE").is_some() {
                    eprintln!(
                        "refused {name} (careful: {}): {}",
                        generator.careful, status.message
                    );
                }
                refused += 1
            }
            Err(e) => other_errors.push(format!("{name}: {e}")),
        }
    }
    assert!(other_errors.is_empty(), "{other_errors:#?}");

    // Every accepted object gets a status for its generation.
    // Generous: the loop ends as soon as every object has its status, and the operator may be
    // backing off from refused pods when the last object is made.
    let wait = Duration::from_secs(90);
    let started = Instant::now();
    let mut missing: Vec<String> = Vec::new();
    let mut deleted;
    loop {
        missing.clear();
        deleted = 0;
        for (api, name, generation, has_ttl) in &accepted {
            match api.get_opt(name).await.unwrap() {
                Some(object)
                    if object.data["status"]["observedGeneration"] == json!(generation) => {}
                Some(object) => missing.push(format!(
                    "{name}: spec {} status {}",
                    object.data["spec"], object.data["status"]
                )),
                // A finished job whose runPolicy.ttlSecondsAfterFinished ran out is deleted by
                // the operator; nothing else deletes them here.
                None if *has_ttl => deleted += 1,
                None => missing.push(format!("{name} (deleted without a TTL)")),
            }
        }
        if missing.is_empty() || started.elapsed() > wait {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let settled = started.elapsed();
    let panics = PANICS.load(Ordering::SeqCst);
    let running = operator.is_running();
    let figures = format!(
        "property: seed {seed}: generated {count}, accepted {}, refused {refused}; finished and deleted by their TTL: {deleted}; accepted without a status after {:.1} s: {}; panics: {panics}; operator running: {running}\n",
        accepted.len(),
        settled.as_secs_f64(),
        missing.len()
    );
    // Straight to the process's stderr, past the test harness's capture: the figures show in
    // every `make test`, passing or not.
    std::io::Write::write_all(&mut std::io::stderr(), figures.as_bytes()).ok();
    assert!(
        accepted.len() >= count / 10 && refused >= count / 10,
        "the generator should produce both: {} accepted, {refused} refused",
        accepted.len()
    );
    assert!(
        missing.is_empty(),
        "accepted without a status for their generation after {wait:?}: {missing:?}"
    );
    assert_eq!(panics, 0, "the operator panicked");
    assert!(running, "the operator stopped");
}
