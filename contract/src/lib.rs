//! The contracts between Ringmaster's programs, each defined once and used by both sides.
//!
//! * [`trainer`] — how the operator invokes `ringmaster-trainer train` (the typed
//!   [`trainer::TrainArgs`] that is also the trainer's own command line), what the trainer of
//!   this release can do ([`trainer::Capabilities`]), the settings check both sides run
//!   ([`trainer::TrainArgs::check`]), the JSON summary it leaves in the launcher's
//!   termination message ([`trainer::Summary`]), or a failing rank's error in its place
//!   ([`trainer::Failure`]), and its exit codes ([`trainer::exit`]).
//!
//! * [`progress`] — how a running job reports its progress to the operator.
//!
//! The crate depends on neither kube nor k8s-openapi, so the trainer stays free of them.

pub mod progress;
pub mod trainer;

/// `text` in at most `max_bytes`: whole, or cut at a character and ending in `...` (where
/// three bytes fit). For
/// messages that go where space is bounded (termination messages, Event notes).
pub fn shorten(text: &str, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text.to_string();
    }
    let ellipsis = if max_bytes >= 3 { "..." } else { "" };
    let mut end = max_bytes - ellipsis.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ellipsis}", &text[..end])
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_text_is_cut_at_a_character_within_the_bytes() {
        let text = "é".repeat(600);
        let cut = super::shorten(&text, 1000);
        assert!(cut.len() <= 1000 && cut.ends_with("..."), "{}", cut.len());
        assert!(text.starts_with(cut.trim_end_matches("...")));
        assert_eq!(super::shorten("short", 1000), "short");
        assert_eq!(super::shorten("abcdef", 4), "a...");
        assert_eq!(super::shorten("abcdef", 2), "ab");
    }
}
