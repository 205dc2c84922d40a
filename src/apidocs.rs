//! The API reference (`docs/api.md`), generated from the CRDs' schemas (`make crds`): every
//! field of both kinds with its type, its doc comment (what `kubectl explain` shows), its
//! default and bounds, and the CEL rules with their messages. A test keeps it fresh.

use std::fmt::Write;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, ValidationRule,
};

use crate::crdgen;

/// Fields whose schema is a Kubernetes core type: named, not expanded (`kubectl explain`
/// and the Kubernetes API reference describe them).
const KUBERNETES_TYPES: &[(&str, &str)] = &[
    ("affinity", "Affinity"),
    ("containerSecurityContext", "SecurityContext"),
    ("containers", "Container"),
    ("env", "EnvVar"),
    ("imagePullSecrets", "LocalObjectReference"),
    ("initContainers", "Container"),
    ("ports", "ContainerPort"),
    ("resources", "ResourceRequirements"),
    ("securityContext", "PodSecurityContext"),
    ("tolerations", "Toleration"),
    ("topologySpreadConstraints", "TopologySpreadConstraint"),
    ("volumeMounts", "VolumeMount"),
    ("volumes", "Volume"),
    ("conditions", "Condition"),
];

/// The whole reference, in Markdown.
pub fn reference() -> String {
    let mut out = String::from(
        "# API reference\n\nGenerated from the CRDs by `make crds` (`ringmaster crd --api-reference`); \
         do not edit. `kubectl explain trainingjob.spec` shows the same descriptions.\n",
    );
    for crd in crdgen::all() {
        kind_section(&mut out, &crd);
    }
    out
}

fn kind_section(out: &mut String, crd: &CustomResourceDefinition) {
    let names = &crd.spec.names;
    let version = &crd.spec.versions[0];
    let _ = write!(
        out,
        "\n## {} (`{}/{}`)\n\nShort names: {}.\n",
        names.kind,
        crd.spec.group,
        version.name,
        names.short_names.clone().unwrap_or_default().join(", ")
    );
    if let Some(columns) = &version.additional_printer_columns {
        out.push_str("\n`kubectl get` columns (`-o wide` adds those of priority 1):\n\n| column | from | priority |\n|---|---|---|\n");
        for c in columns {
            let _ = writeln!(
                out,
                "| {} | `{}` | {} |",
                c.name,
                c.json_path,
                c.priority.unwrap_or(0)
            );
        }
    }
    let root = version
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref());
    for part in ["spec", "status"] {
        if let Some(schema) = root.and_then(|r| r.properties.as_ref()?.get(part)) {
            let _ = write!(out, "\n### {part}\n\n");
            rules(out, part, schema);
            out.push_str("| field | type | description |\n|---|---|---|\n");
            fields(out, part, schema);
        }
    }
}

/// The object's CEL rules, when it has any.
fn rules(out: &mut String, path: &str, schema: &JSONSchemaProps) {
    let Some(rules) = &schema.x_kubernetes_validations else {
        return;
    };
    let _ = writeln!(out, "Rules on `{path}`:\n");
    for (message, rule) in rules.iter().map(rule_text) {
        let _ = writeln!(out, "- {message} — `{rule}`");
    }
    out.push('\n');
}

fn fields(out: &mut String, path: &str, schema: &JSONSchemaProps) {
    let Some(properties) = &schema.properties else {
        return;
    };
    let required = schema.required.clone().unwrap_or_default();
    for (name, field) in properties {
        let here = format!("{path}.{name}");
        let kubernetes = KUBERNETES_TYPES
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| *t);
        let mut kind = type_of(field, kubernetes);
        if required.contains(name) {
            kind.push_str(", required");
        }
        let _ = writeln!(out, "| `{here}` | {kind} | {} |", describe(field));
        if kubernetes.is_some() {
            continue;
        }
        let inner = field.items.as_ref().and_then(|items| match items {
            k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrArray::Schema(s) => Some(s.as_ref()),
            _ => None,
        });
        let (object, at) = match inner {
            Some(item) => (item, format!("{here}[]")),
            None => (field, here),
        };
        if object.properties.is_some() {
            nested_rules(out, &at, object);
            fields(out, &at, object);
        }
    }
}

/// A nested object's rules, as rows of their own.
fn nested_rules(out: &mut String, path: &str, schema: &JSONSchemaProps) {
    for (message, rule) in schema
        .x_kubernetes_validations
        .iter()
        .flatten()
        .map(rule_text)
    {
        let _ = writeln!(out, "| `{path}` | rule | {message} (`{rule}`) |");
    }
}

/// A CEL rule's message and expression, escaped for a Markdown table.
fn rule_text(rule: &ValidationRule) -> (String, String) {
    let message = rule.message.as_deref().unwrap_or("(no message)");
    (cell(message), rule.rule.replace('|', "\\|"))
}

fn type_of(field: &JSONSchemaProps, kubernetes: Option<&str>) -> String {
    let base = field.type_.clone().unwrap_or_else(|| {
        if field.x_kubernetes_int_or_string == Some(true) {
            "int or string".into()
        } else {
            "any".into()
        }
    });
    match (kubernetes, base.as_str()) {
        (Some(t), "array") => format!("[]{t}"),
        (Some(t), _) => t.to_string(),
        _ => base,
    }
}

/// The description, then the default, the enum and the bounds.
fn describe(field: &JSONSchemaProps) -> String {
    let mut text = field.description.clone().unwrap_or_default();
    let mut extra = Vec::new();
    if let Some(default) = &field.default {
        extra.push(format!("default `{}`", default.0));
    }
    if let Some(values) = &field.enum_ {
        let values: Vec<String> = values.iter().map(|v| format!("`{}`", v.0)).collect();
        extra.push(format!("one of {}", values.join(", ")));
    }
    let bounds = [
        ("≥", field.minimum.map(|m| m.to_string())),
        ("≤", field.maximum.map(|m| m.to_string())),
        ("length ≥", field.min_length.map(|m| m.to_string())),
        ("length ≤", field.max_length.map(|m| m.to_string())),
        ("items ≤", field.max_items.map(|m| m.to_string())),
    ];
    for (word, value) in bounds {
        if let Some(value) = value {
            extra.push(format!("{word} {value}"));
        }
    }
    if let Some(pattern) = &field.pattern {
        extra.push(format!("pattern `{pattern}`"));
    }
    if !extra.is_empty() {
        let _ = write!(text, " ({})", extra.join("; "));
    }
    cell(&text)
}

/// Text fit for a table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// Writes the reference to `path`.
pub fn write(path: &std::path::Path) -> std::io::Result<()> {
    std::fs::write(path, reference())
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_field_the_crd_has_is_in_the_reference_and_kubernetes_types_are_named() {
        let doc = super::reference();
        for field in [
            "`spec.trainer.steps`",
            "`spec.infiniband.preflight.minBusBandwidthGbps`",
            "`status.progress.timeRemaining`",
            "`spec.worker.containers`",
        ] {
            assert!(doc.contains(field), "{field}");
        }
        assert!(doc.contains("[]Container"));
        assert!(
            !doc.contains("`spec.worker.containers[].image`"),
            "Kubernetes types not expanded"
        );
        assert!(doc.contains("| Progress | `.status.progress.percentDone` | 0 |"));
        assert!(
            doc.contains("metadata.name must be a DNS label") || doc.contains("Rules on `spec`")
        );
    }
}
