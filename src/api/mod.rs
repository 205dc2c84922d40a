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
/// The served and stored version.
pub const VERSION: &str = "v1alpha1";
