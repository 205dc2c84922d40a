//! How a failing rank says why: its last line on stdout is the contract's failure line
//! ([`Failure`]), for an error it returns and for a panic alike, which `launch` writes to
//! the launcher's termination message.
//!
//! A failing rank leaves at once, with its collective still connected: the other ranks
//! then lose their peer only once it has exited, so `mpirun` reports its exit code (the
//! verdict), not the lost-peer code of the ranks it took down (a gang restart).

use std::io::Write;
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

/// Prints `failure`'s line on stdout in one write (so `mpirun` forwards it whole beside
/// other ranks' output), ignoring a closed stdout: a rank that cannot say why still leaves
/// with its code.
pub fn say(failure: &Failure) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(format!("{}\n", failure.to_line()).as_bytes());
    let _ = stdout.flush();
}

/// Says `failure` (its line on stdout, its words on stderr) and exits with its code, without
/// unwinding: what holds the other ranks' connections closes with the process.
pub fn leave(failure: &Failure) -> ! {
    say(failure);
    eprintln!("ringmaster-trainer: {failure}");
    std::process::exit(i32::from(failure.exit_code))
}

/// Makes every panic say its failure line ([`of_panic`]), give the usual report on stderr,
/// and leave with [`exit::PANICKED`] at once, from whichever thread panicked: a GPU error
/// the engine does not recover from, or a bug, then reaches the TrainingJob in the
/// trainer's own words and as the job's verdict. Only for `train`, where no panic is
/// recovered from.
pub fn report_panics() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let location = info.location().map(|at| (at.file(), at.line()));
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
        say(&of_panic(message, location));
        report(info);
        std::process::exit(i32::from(exit::PANICKED));
    }));
}
