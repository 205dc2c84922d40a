//! The custom resources users write: `TrainingJob` and `DataStage` (group `ringmaster.dev`).
//!
//! Field doc comments are the schema descriptions `kubectl explain` shows; ranges and
//! patterns come from schemars attributes, cross-field and transition rules are CEL
//! (`x-kubernetes-validations`) declared next to the fields they guard. The operator's
//! validate step evaluates the very same schema, so a rule is written once.

pub mod common;
pub mod data_stage;
pub mod kubernetes_rules;
pub mod training_job;
pub mod vm_sizes;

pub use common::*;
pub use data_stage::*;
pub use training_job::*;

/// The API group of every Ringmaster resource.
pub const GROUP: &str = "ringmaster.dev";

/// Whether an `apiVersion` (of an owner reference, say) is of [`GROUP`]: `ringmaster.dev/…`,
/// not a group that only starts with those letters.
pub fn in_group(api_version: &str) -> bool {
    api_version
        .strip_prefix(GROUP)
        .is_some_and(|version| version.starts_with('/'))
}

/// The served and stored version.
pub const VERSION: &str = "v1alpha1";
