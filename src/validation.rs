//! Checks an object against its CRD's schema the way the API server does: the structural
//! OpenAPI constraints (types, required fields, ranges, patterns, enums, lengths) and the
//! CEL rules (`x-kubernetes-validations`), evaluated here with `kube-cel`.
//!
//! Each validate step runs this first, so a rule lives in one place (next to its field in
//! `src/api`) and the operator still refuses objects that reached it without passing the
//! rule: stored before the CRD was upgraded, or written with validation off.

use std::fmt;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use kube::core::cel::{CompiledSchema, Validator as CelValidator, compile_schema};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// One broken rule: the field (as `spec.nodePool.vmSize`) and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted path of the field, starting at the object's root (`spec.workers`).
    pub field: String,
    /// What is wrong, in words a user can act on.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

/// Every rule an object breaks, in a stable order. Never empty.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct FieldErrors(pub Vec<FieldError>);

impl fmt::Display for FieldErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&parts.join("; "))
    }
}

impl FieldErrors {
    /// One error.
    pub fn one(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self(vec![FieldError {
            field: field.into(),
            message: message.into(),
        }])
    }

    /// The paths of the fields named, for tests and metrics.
    pub fn fields(&self) -> Vec<&str> {
        self.0.iter().map(|e| e.field.as_str()).collect()
    }
}

/// The schema of one CRD version, compiled once: a JSON-Schema validator for the structural
/// part and the compiled CEL rules.
pub struct SchemaChecker {
    structural: jsonschema::Validator,
    cel_rules: CompiledSchema,
    cel: CelValidator,
}

impl SchemaChecker {
    /// Compiles the first version's schema of `crd`.
    ///
    /// Panics when the schema does not compile: it is generated from our own types, so that
    /// is a bug caught by the unit tests, not a user error.
    pub fn for_crd(crd: &CustomResourceDefinition) -> Self {
        let schema = crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .map(|s| serde_json::to_value(s).expect("schema serializes"))
            .expect("a derived CRD has an openAPIV3Schema");
        let structural = jsonschema::draft4::new(&strip_kubernetes_extensions(schema.clone()))
            .expect("the generated schema is valid JSON Schema");
        let cel_rules = compile_schema(&schema);
        Self {
            structural,
            cel_rules,
            cel: CelValidator::new(),
        }
    }

    /// Rules whose CEL did not compile, as messages (empty when all compile).
    pub fn compile_errors(&self) -> Vec<String> {
        fn walk(node: &CompiledSchema, path: &str, out: &mut Vec<String>) {
            out.extend(
                node.compilation_errors()
                    .iter()
                    .map(|e| format!("{path}: {e}")),
            );
            for (name, child) in &node.properties {
                walk(child, &format!("{path}.{name}"), out);
            }
            if let Some(items) = &node.items {
                walk(items, &format!("{path}[]"), out);
            }
            if let Some(values) = &node.additional_properties {
                walk(values, &format!("{path}{{}}"), out);
            }
        }
        let mut out = Vec::new();
        walk(&self.cel_rules, "", &mut out);
        out
    }

    /// Checks `object` (and, for an update, the transition rules against `old`).
    pub fn check(&self, object: &Value, old: Option<&Value>) -> Result<(), FieldErrors> {
        let mut errors: Vec<FieldError> = self
            .structural
            .iter_errors(object)
            .map(|e| {
                let path = pointer_to_path(e.instance_path().as_str());
                match e.kind() {
                    // Name the missing field itself, as the API server does.
                    jsonschema::error::ValidationErrorKind::Required { property } => FieldError {
                        field: join_path(&path, property.as_str().unwrap_or_default()),
                        message: "Required value".into(),
                    },
                    _ => FieldError {
                        field: path,
                        message: e.to_string(),
                    },
                }
            })
            .collect();
        // CEL rules assume a structurally valid object, as in the API server.
        if errors.is_empty()
            && let Err(cel_errors) = self.cel.validate_compiled(&self.cel_rules, object, old)
        {
            errors.extend(cel_errors.iter().map(|e| FieldError {
                field: e.field_path.clone(),
                message: e.message.clone(),
            }));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            errors.sort_by(|a, b| a.field.cmp(&b.field).then(a.message.cmp(&b.message)));
            errors.dedup();
            Err(FieldErrors(errors))
        }
    }
}

thread_local! {
    /// Compiled checkers by CRD name, one set per thread (the CEL programs are not `Sync`).
    static CHECKERS: RefCell<HashMap<String, Rc<SchemaChecker>>> = RefCell::new(HashMap::new());
}

/// The schema checker of kind `K` on this thread, compiled on first use.
pub fn checker<K: CustomResourceExt>() -> Rc<SchemaChecker> {
    CHECKERS.with(|checkers| {
        checkers
            .borrow_mut()
            .entry(K::crd_name().to_string())
            .or_insert_with(|| Rc::new(SchemaChecker::for_crd(&K::crd())))
            .clone()
    })
}

/// Checks a typed object (as the operator received it) against its kind's schema.
pub fn check_object<K: CustomResourceExt + Serialize>(object: &K) -> Result<(), FieldErrors> {
    let value = serde_json::to_value(object)
        .map_err(|e| FieldErrors::one("", format!("does not serialize: {e}")))?;
    checker::<K>().check(&value, None)
}

/// Checks a raw object as a user wrote it (and, for an update, against `old`), then
/// deserializes it.
pub fn parse_object<K: CustomResourceExt + DeserializeOwned>(
    value: &Value,
    old: Option<&Value>,
) -> Result<K, FieldErrors> {
    checker::<K>().parse(value, old)
}

impl SchemaChecker {
    /// Checks a raw object, then deserializes it: the path from YAML a user wrote to a typed
    /// object, with every rule's message on the way.
    pub fn parse<K: serde::de::DeserializeOwned>(
        &self,
        object: &Value,
        old: Option<&Value>,
    ) -> Result<K, FieldErrors> {
        self.check(object, old)?;
        serde_json::from_value(object.clone())
            .map_err(|e| FieldErrors::one("", format!("does not deserialize: {e}")))
    }
}

fn join_path(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        child.to_string()
    } else {
        format!("{parent}.{child}")
    }
}

/// `/spec/nodePool/vmSize` → `spec.nodePool.vmSize`; array indices as `[0]`.
fn pointer_to_path(pointer: &str) -> String {
    let mut path = String::new();
    for segment in pointer.split('/').skip(1) {
        let segment = segment.replace("~1", "/").replace("~0", "~");
        if segment.chars().all(|c| c.is_ascii_digit()) && !segment.is_empty() {
            path.push_str(&format!("[{segment}]"));
        } else {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(&segment);
        }
    }
    path
}

/// OpenAPI's `nullable` has no JSON-Schema draft 4 equivalent and Kubernetes' `x-` keys mean
/// nothing to a JSON-Schema validator; int-or-string fields carry no `type`. Removing
/// `nullable` keeps objects that omit optional fields valid, which is what the API server does.
fn strip_kubernetes_extensions(mut schema: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(map) => {
                map.remove("nullable");
                map.retain(|k, _| !k.starts_with("x-kubernetes-"));
                map.values_mut().for_each(walk);
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut schema);
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_become_dotted_paths() {
        assert_eq!(
            pointer_to_path("/spec/nodePool/vmSize"),
            "spec.nodePool.vmSize"
        );
        assert_eq!(
            pointer_to_path("/spec/worker/env/3/name"),
            "spec.worker.env[3].name"
        );
        assert_eq!(pointer_to_path(""), "");
        assert_eq!(
            pointer_to_path("/metadata/labels/a~1b"),
            "metadata.labels.a/b"
        );
    }

    #[test]
    fn errors_join_with_their_fields() {
        let errors = FieldErrors(vec![
            FieldError {
                field: "spec.workers".into(),
                message: "must be at least 1".into(),
            },
            FieldError {
                field: String::new(),
                message: "whole object".into(),
            },
        ]);
        assert_eq!(
            errors.to_string(),
            "spec.workers: must be at least 1; whole object"
        );
    }
}
