//! How a failing rank says why: its last line on stdout is the contract's failure line
//! ([`Failure`]), for an error it returns and for a panic alike, which `launch` writes to
//! the launcher's termination message.

use std::sync::OnceLock;

use ringmaster_contract::trainer::{Failure, exit};

/// This process's rank, once known: what a panic's failure line names.
static RANK: OnceLock<usize> = OnceLock::new();

/// Names `rank` in the failure lines of later panics (the first call wins).
pub fn set_rank(rank: usize) {
    RANK.set(rank).ok();
}

/// The failure line of a panic with `message` at `location` (file, line), on this rank.
pub fn of_panic(message: Option<&str>, location: Option<(&str, u32)>) -> Failure {
    let message = message.unwrap_or("a panic without a message");
    Failure {
        rank: RANK.get().map(|&rank| rank as u64),
        error: match location {
            Some((file, line)) => format!("{message} (panicked at {file}:{line})"),
            None => message.to_string(),
        },
        exit_code: exit::PANICKED,
    }
}

/// Makes every panic print its failure line on stdout ([`of_panic`]) before the usual
/// report on stderr: a GPU error the engine does not recover from, or a bug, then reaches
/// the TrainingJob in the trainer's own words rather than as the tail of `mpirun`'s log.
pub fn report_panics() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let location = info.location().map(|at| (at.file(), at.line()));
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
        println!("{}", of_panic(message, location).to_line());
        report(info);
    }));
}
