//! Kubernetes' own rules for the pod fields a spec passes through (label keys and values,
//! tolerations, images), as CEL rules and patterns in the CRD, so `kubectl apply` refuses
//! what the API server would later refuse on the pod, instead of the operator meeting it.

use kube::core::Rule;

/// A label value: at most 63 characters (the schema's `maxLength`), alphanumerics at both
/// ends, `-`, `_` and `.` between. Also the pattern of node-selector values.
pub const LABEL_VALUE_PATTERN: &str = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$";

/// An object name that is a DNS subdomain (Secrets, claims, ServiceAccounts): lowercase
/// letters, digits, `-` and `.`, alphanumerics at both ends (at most 253, the `maxLength`).
pub const DNS_SUBDOMAIN_PATTERN: &str = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$";

/// A DNS label (a container's name): lowercase letters, digits and `-`, alphanumerics at both
/// ends (at most 63, the `maxLength`).
pub const DNS_LABEL_PATTERN: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";

/// A key of a Secret or ConfigMap: letters, digits, `-`, `_` and `.`.
pub const CONFIG_KEY_PATTERN: &str = r"^[-._a-zA-Z0-9]+$";

/// A qualified name (a label key): an optional DNS-subdomain prefix and `/`, then a name of at
/// most 63 characters, alphanumerics at both ends.
const QUALIFIED_NAME: &str =
    "^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$";

/// Every key of a map is a valid label key; `what` names the map in the message.
pub fn label_keys(what: &str) -> Rule {
    Rule::new(format!("self.all(k, k.matches('{QUALIFIED_NAME}'))")).message(
        kube::core::cel::Message::Message(format!(
            "every key of {what} must be a valid label key: an optional DNS-subdomain prefix and '/', then at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        )),
    )
}

/// The rules of a pod's tolerations that the API server checks on the pod.
pub fn tolerations() -> [Rule; 4] {
    let rule = |cel: &str, message: &str| {
        Rule::new(cel).message(kube::core::cel::Message::Message(message.into()))
    };
    [
        rule(
            "self.all(t, !has(t.operator) || t.operator in ['', 'Equal', 'Exists'])",
            "a toleration's operator is Equal or Exists",
        ),
        rule(
            "self.all(t, (has(t.key) && t.key != '') || (has(t.operator) && t.operator == 'Exists'))",
            "a toleration without a key must have operator Exists (it then tolerates every taint)",
        ),
        rule(
            "self.all(t, !has(t.operator) || t.operator != 'Exists' || !has(t.value) || t.value == '')",
            "a toleration with operator Exists has no value",
        ),
        rule(
            "self.all(t, (!has(t.effect) || t.effect in ['', 'NoSchedule', 'PreferNoSchedule', 'NoExecute']) && (!has(t.tolerationSeconds) || (has(t.effect) && t.effect == 'NoExecute')))",
            "a toleration's effect is NoSchedule, PreferNoSchedule or NoExecute, and only NoExecute takes tolerationSeconds",
        ),
    ]
}
