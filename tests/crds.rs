//! `crds/` must be what `ringmaster crd` prints today: run `make crds` after changing `src/api`.

#[path = "common/mod.rs"]
mod fixtures;

use ringmaster::crdgen;

#[test]
fn crds_folder_is_current() {
    let dir = fixtures::root().join("crds");
    let mut stale = Vec::new();
    for crd in crdgen::all() {
        let path = dir.join(crdgen::file_name(&crd));
        let want = crdgen::to_yaml(&crd).expect("CRD serializes");
        match std::fs::read_to_string(&path) {
            Ok(have) if have == want => {}
            Ok(_) => stale.push(format!("{} differs", path.display())),
            Err(e) => stale.push(format!("{}: {e}", path.display())),
        }
    }
    assert!(
        stale.is_empty(),
        "crds/ is stale; run `make crds`:\n{}",
        stale.join("\n")
    );
}

#[test]
fn the_api_reference_is_current() {
    let path = fixtures::root().join("docs/api.md");
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == ringmaster::apidocs::reference(),
        "docs/api.md is stale; run `make crds`"
    );
}

#[test]
fn crds_have_short_names_and_status() {
    for crd in crdgen::all() {
        let names = &crd.spec.names;
        let short = names.short_names.clone().unwrap_or_default();
        assert!(!short.is_empty(), "{} has no short name", names.kind);
        assert!(
            !short.contains(&"ds".to_string()),
            "ds is kubectl's DaemonSet"
        );
        let version = &crd.spec.versions[0];
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
        assert!(
            version
                .additional_printer_columns
                .as_ref()
                .is_some_and(|c| c.len() >= 3)
        );
    }
}

#[test]
fn every_spec_field_has_a_description() {
    // What `kubectl explain` shows: a field without a doc comment shows nothing.
    fn walk(path: &str, schema: &serde_json::Value, missing: &mut Vec<String>) {
        if let Some(props) = schema.get("properties").and_then(|p| p.as_object()) {
            for (name, child) in props {
                let child_path = format!("{path}.{name}");
                if child.get("description").is_none() {
                    missing.push(child_path.clone());
                }
                walk(&child_path, child, missing);
            }
        }
        if let Some(items) = schema.get("items") {
            walk(&format!("{path}[]"), items, missing);
        }
    }
    let mut missing = Vec::new();
    for crd in crdgen::all() {
        let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
        let root = &schema["openAPIV3Schema"]["properties"];
        walk(
            &format!("{}.spec", crd.spec.names.kind),
            &root["spec"],
            &mut missing,
        );
        walk(
            &format!("{}.status", crd.spec.names.kind),
            &root["status"],
            &mut missing,
        );
    }
    assert!(
        missing.is_empty(),
        "fields without a description:\n{}",
        missing.join("\n")
    );
}

/// Each CRD, as the API server stores it (compact JSON), stays well under etcd's limit on
/// one object (1.5 MiB): the pod-template fields embed Kubernetes' own schemas (containers,
/// affinity, volumes) twice, for the launcher and the workers, and the next embedded type
/// should be a choice, not an accident.
#[test]
fn each_crd_stays_well_under_etcds_object_limit() {
    const BUDGET: usize = 1024 * 1024;
    for crd in crdgen::all() {
        let stored = serde_json::to_vec(&crd).expect("CRD serializes").len();
        assert!(
            stored < BUDGET,
            "{} is {stored} bytes of JSON, over the {BUDGET} budget (etcd refuses 1.5 MiB)",
            crd.spec.names.kind
        );
    }
}

/// The chart (Helm installs `crds/` of a chart) and the kustomize base carry the same CRDs.
#[test]
fn chart_and_kustomize_crds_are_copies_of_crds() {
    let root = fixtures::root();
    for crd in crdgen::all() {
        let name = crdgen::file_name(&crd);
        let want = std::fs::read_to_string(root.join("crds").join(&name)).unwrap();
        for copy in ["charts/ringmaster/crds", "config/crd/bases"] {
            let have = std::fs::read_to_string(root.join(copy).join(&name))
                .unwrap_or_else(|e| panic!("{copy}/{name}: {e}; run `make crds`"));
            assert!(
                have == want,
                "{copy}/{name} differs from crds/{name}; run `make crds`"
            );
        }
    }
}

/// Each `Option<Enum>` field, its CRD, and the sentence of its doc comment that
/// `kubectl explain` must show. The enum's own doc comment used to replace the field's.
const OPTIONAL_ENUM_FIELDS: &[(&str, &str, &str)] = &[
    (
        "trainingjobs.ringmaster.dev",
        "spec.trainer.model",
        "Default: resnet50.",
    ),
    (
        "trainingjobs.ringmaster.dev",
        "spec.trainer.data",
        "Default: synthetic.",
    ),
    (
        "trainingjobs.ringmaster.dev",
        "spec.trainer.precision",
        "Default: bf16 on GPUs, fp32 on CPUs.",
    ),
    (
        "trainingjobs.ringmaster.dev",
        "spec.nodePool.gpuDriver",
        "Default: Install.",
    ),
];

/// The description of the field at a dotted path under the schema's root.
fn field_description<'a>(schema: &'a serde_json::Value, path: &str) -> Option<&'a str> {
    path.split('.')
        .try_fold(schema, |s, name| s.get("properties")?.get(name))?
        .get("description")?
        .as_str()
}

#[test]
fn optional_enum_fields_keep_their_own_description() {
    let root = fixtures::root();
    let mut wrong = Vec::new();
    for &(crd_name, path, sentence) in OPTIONAL_ENUM_FIELDS {
        let crd = crdgen::all()
            .into_iter()
            .find(|c| c.metadata.name.as_deref() == Some(crd_name))
            .unwrap_or_else(|| panic!("no CRD {crd_name}"));
        let file = format!("crds/{}", crdgen::file_name(&crd));
        let generated = serde_json::to_value(&crd).unwrap();
        let committed = fixtures::documents(&root.join(&file)).remove(0);
        for (what, crd) in [("generated", &generated), (file.as_str(), &committed)] {
            let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
            let description = field_description(schema, path);
            if !description.is_some_and(|d| d.contains(sentence)) {
                wrong.push(format!(
                    "{what}: {path} has description {description:?}, without {sentence:?}"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "fields lost their doc comment (after a fix in crdgen, run `make crds`):\n{}",
        wrong.join("\n")
    );
}

/// `crdgen` generates the schemas again to keep the fields' doc comments: everything but the
/// descriptions must still be what kube's derive makes.
#[test]
fn crdgen_changes_nothing_but_descriptions() {
    use kube::CustomResourceExt;
    use ringmaster::api::{DataStage, TrainingJob};

    fn without_descriptions(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                map.remove("description");
                map.values_mut().for_each(without_descriptions);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(without_descriptions),
            _ => {}
        }
    }
    let derived = [DataStage::crd(), TrainingJob::crd()];
    let generated = crdgen::all();
    assert_eq!(generated.len(), derived.len());
    for (generated, derived) in generated.iter().zip(&derived) {
        let mut generated = serde_json::to_value(generated).unwrap();
        let mut derived = serde_json::to_value(derived).unwrap();
        without_descriptions(&mut generated);
        without_descriptions(&mut derived);
        assert!(
            generated == derived,
            "{}: crdgen's schema differs from the derive's in more than descriptions",
            generated["metadata"]["name"]
        );
    }
}
