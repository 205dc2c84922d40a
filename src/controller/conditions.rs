//! Conditions in the kstatus shape, and the Events their transitions emit.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::runtime::events::{Event, EventType};

/// The desired form of one condition; `lastTransitionTime` is filled in by [`set`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredCondition {
    /// The condition type, e.g. `Ready`.
    pub type_: &'static str,
    /// True or false.
    pub status: bool,
    /// A CamelCase reason from the kind's constants.
    pub reason: &'static str,
    /// Words for people.
    pub message: String,
}

impl DesiredCondition {
    /// A condition of `type_` with the given state.
    pub fn new(
        type_: &'static str,
        status: bool,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason,
            message: message.into(),
        }
    }
}

fn status_word(status: bool) -> &'static str {
    if status { "True" } else { "False" }
}

/// Puts `desired` into `conditions`, keeping the old `lastTransitionTime` unless the status
/// flips (kstatus and the API conventions), and stamping `observedGeneration`.
pub fn set(
    conditions: &mut Vec<Condition>,
    desired: DesiredCondition,
    generation: Option<i64>,
    now: &Time,
) {
    let status = status_word(desired.status).to_string();
    let transition = conditions
        .iter()
        .find(|c| c.type_ == desired.type_)
        .filter(|c| c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| now.clone());
    let condition = Condition {
        type_: desired.type_.to_string(),
        status,
        reason: desired.reason.to_string(),
        message: desired.message,
        observed_generation: generation,
        last_transition_time: transition,
    };
    match conditions.iter_mut().find(|c| c.type_ == condition.type_) {
        Some(existing) => *existing = condition,
        None => conditions.push(condition),
    }
}

/// The condition of `type_`, if there is one.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether a condition of `type_` is `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

/// One Event for each condition whose status or reason changed between `old` and `new`.
/// `warning` says which of the new states deserve a Warning rather than a Normal Event.
pub fn transition_events(
    old: &[Condition],
    new: &[Condition],
    warning: impl Fn(&Condition) -> bool,
) -> Vec<Event> {
    new.iter()
        .filter(|c| {
            !old.iter()
                .any(|o| o.type_ == c.type_ && o.status == c.status && o.reason == c.reason)
        })
        .map(|c| Event {
            type_: if warning(c) {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: c.reason.clone(),
            // Events carry at most 1 kB of note.
            note: Some(ringmaster_contract::shorten(
                &format!("{}={}: {}", c.type_, c.status, c.message),
                1000,
            )),
            action: "Reconcile".into(),
            secondary: None,
        })
        .collect()
}

/// The conditions of an object one of whose children the API server refused: Stalled=True
/// and Ready=False, reason ChildRejected, with `message` (the child's kind and name and the
/// API server's words).
pub fn child_rejected(message: &str) -> [DesiredCondition; 2] {
    use crate::api::{condition_reasons::CHILD_REJECTED, condition_types};
    [
        DesiredCondition::new(condition_types::STALLED, true, CHILD_REJECTED, message),
        DesiredCondition::new(condition_types::READY, false, CHILD_REJECTED, message),
    ]
}

/// The message of a ChildRejected Stalled condition among `conditions`, if there is one.
pub fn rejected_child(conditions: &[Condition]) -> Option<&str> {
    use crate::api::{condition_reasons::CHILD_REJECTED, condition_types};
    conditions
        .iter()
        .find(|c| {
            c.type_ == condition_types::STALLED && c.status == "True" && c.reason == CHILD_REJECTED
        })
        .map(|c| c.message.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap())
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let mut conditions = Vec::new();
        set(
            &mut conditions,
            DesiredCondition::new("Ready", false, "A", "a"),
            Some(1),
            &at(10),
        );
        set(
            &mut conditions,
            DesiredCondition::new("Ready", false, "B", "b"),
            Some(2),
            &at(20),
        );
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].last_transition_time, at(10));
        assert_eq!(conditions[0].reason, "B");
        assert_eq!(conditions[0].observed_generation, Some(2));
        set(
            &mut conditions,
            DesiredCondition::new("Ready", true, "C", "c"),
            Some(2),
            &at(30),
        );
        assert_eq!(conditions[0].last_transition_time, at(30));
        assert!(is_true(&conditions, "Ready"));
    }

    #[test]
    fn events_only_for_changes() {
        let mut old = Vec::new();
        set(
            &mut old,
            DesiredCondition::new("Ready", false, "Waiting", "w"),
            None,
            &at(1),
        );
        set(
            &mut old,
            DesiredCondition::new("SpecValid", true, "Valid", "ok"),
            None,
            &at(1),
        );
        let mut new = old.clone();
        set(
            &mut new,
            DesiredCondition::new("SpecValid", false, "InvalidSpec", "bad"),
            None,
            &at(2),
        );
        let events = transition_events(&old, &new, |c| {
            c.status == "False" && c.type_ == "SpecValid"
        });
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].reason, "InvalidSpec");
        assert_eq!(events[0].type_, EventType::Warning);
        assert!(transition_events(&new, &new, |_| true).is_empty());
    }

    #[test]
    fn long_notes_are_cut_on_a_char_boundary() {
        let mut new = Vec::new();
        set(
            &mut new,
            DesiredCondition::new("Failed", true, "LauncherFailed", "é".repeat(600)),
            None,
            &at(1),
        );
        let events = transition_events(&[], &new, |_| true);
        let note = events[0].note.as_deref().unwrap();
        assert!(
            note.len() <= 1000 && note.ends_with("..."),
            "{}",
            note.len()
        );
        assert!(note.starts_with("Failed=True: éé"), "{note}");
    }
}
