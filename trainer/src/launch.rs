//! `launch`: runs the MPI launcher (`mpirun …`), passes its output through, and writes rank
//! 0's JSON summary line to a file (the launcher pod's termination message, which the
//! operator turns into the TrainingJob's `status.result`), or, when the run failed, the
//! failing rank's own failure line (which the operator shows on the job in place of the
//! tail of `mpirun`'s log), and leaves with the trainer's exit code ([`exit`]) so the
//! operator can tell a lost peer from a verdict. A program that prints no failure line (a
//! user's own, such as a PyTorch script) is read on stderr instead: its exception's line
//! ([`crate::program_error`]). While the ranks run, their progress goes to the operator
//! ([`crate::report`]) when the launcher's environment names where.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use ringmaster_contract::trainer::{Failure, Line, exit};

use crate::program_error::ProgramError;

/// Errors running the launcher.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Nothing to run.
    #[error("no command given after --")]
    NoCommand,
    /// The command could not start.
    #[error("starting {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// Reading its output or writing the summary failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What the termination message gets from the ranks' output: the trainer's summary, else
/// the failure that caused the others ([`Failure::find_in`]), else nothing (the kubelet
/// then keeps the log's tail, where `mpirun` names a rank killed by a signal).
#[derive(Default)]
struct TerminationMessage {
    summary: Option<String>,
    failures: String,
}

impl TerminationMessage {
    fn read(&mut self, line: &str) {
        match serde_json::from_str::<Line>(line.trim()) {
            Ok(Line::Summary(_)) => self.summary = Some(line.trim().to_string()),
            Ok(Line::Failed(_)) => {
                self.failures.push_str(line.trim());
                self.failures.push('\n');
            }
            _ => {}
        }
    }

    /// The failure that caused the others, if a rank printed one.
    fn cause(&self) -> Option<Failure> {
        Failure::find_in(&self.failures)
    }

    /// The summary, else `cause`'s line.
    fn text(self, cause: Option<&Failure>) -> Option<String> {
        self.summary.or_else(|| cause.map(Failure::to_line))
    }

    /// Whether the program printed its summary.
    fn has_summary(&self) -> bool {
        self.summary.is_some()
    }
}

/// The code to leave with after the MPI launcher exited with `code` (`None`: it was killed
/// by `signal`). `mpirun` exits 128 + N when one of its ranks was killed by signal N (the
/// OOM killer, a worker pod that went away): the gang is incomplete, which is
/// [`exit::PEER_LOST`]. Codes below 128 are the trainer's own ([`exit`]) and pass through;
/// the launcher itself killed is 128 + its signal.
pub fn exit_code(code: Option<i32>, signal: Option<i32>) -> u8 {
    match code {
        Some(code) if (0..128).contains(&code) => code as u8,
        Some(_) => exit::PEER_LOST,
        None => 128u8.saturating_add(signal.unwrap_or(0).clamp(0, 127) as u8),
    }
}

/// The code to leave with when a rank printed the failure that caused the others: its own,
/// where `mpirun` reported a lost peer ([`exit::PEER_LOST`] itself, not a rank killed by a
/// signal). Which rank's exit `mpirun` reports is a race between the failing rank and the
/// peers it takes down; a program's failure must not become a restart of the gang.
pub fn exit_code_after(mpirun: Option<i32>, signal: Option<i32>, cause: Option<&Failure>) -> u8 {
    match cause {
        Some(cause) if mpirun == Some(i32::from(exit::PEER_LOST)) => cause.exit_code,
        _ => exit_code(mpirun, signal),
    }
}

/// Runs `command`, copies its stdout and stderr to ours, writes the last summary line (or
/// the failure that caused the others, else the exception a program raised) to
/// `termination_message` and returns the exit code to leave with ([`exit_code_after`]).
pub fn run(command: &[String], termination_message: &Path) -> Result<u8, LaunchError> {
    let (program, args) = command.split_first().ok_or(LaunchError::NoCommand)?;
    // Caught from before the spawn: a SIGTERM that arrives while the child starts waits for
    // it instead of killing `launch` (the default action) and leaving the child running.
    let signals = termination_signals()?;
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| LaunchError::Spawn {
            program: program.clone(),
            source,
        })?;
    forward_termination(signals, child.id());
    let stderr = child.stderr.take().expect("piped stderr");
    let stderr = std::thread::spawn(move || pass_stderr(stderr));
    let stdout = child.stdout.take().expect("piped stdout");
    let message = pass_stdout(stdout)?;
    let status = child.wait()?;
    let said_on_stderr = stderr.join().unwrap_or_default();
    use std::os::unix::process::ExitStatusExt;
    let cause = message.cause();
    let code = exit_code_after(status.code(), status.signal(), cause.as_ref());
    let cause = match cause {
        None if !message.has_summary() => said_on_stderr.failure(code),
        cause => cause,
    };
    if let Some(message) = message.text(cause.as_ref()) {
        // The termination message may be missing outside Kubernetes: that is not an error.
        if let Err(error) = std::fs::write(termination_message, message) {
            eprintln!(
                "ringmaster-trainer launch: writing {}: {error}",
                termination_message.display()
            );
        }
    }
    Ok(code)
}

/// Copies the ranks' stdout to ours, reading the contract's lines from it, and reports their
/// progress while it runs.
fn pass_stdout(stdout: impl std::io::Read) -> Result<TerminationMessage, LaunchError> {
    let mut message = TerminationMessage::default();
    let reporter = crate::report::Endpoint::from_env().and_then(crate::report::Reporter::start);
    let mut out = std::io::stdout().lock();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        writeln!(out, "{line}")?;
        message.read(&line);
        if let Some(reporter) = &reporter {
            reporter.line(&line);
        }
    }
    out.flush()?;
    if let Some(reporter) = reporter {
        reporter.finish();
    }
    Ok(message)
}

/// Copies the ranks' (and `mpirun`'s) stderr to ours, line by line as it comes, reading the
/// errors in it. Lines need not be UTF-8; a write that fails (our stderr closed) is no reason
/// to stop reading, which would block the ranks.
fn pass_stderr(stderr: impl std::io::Read) -> ProgramError {
    let mut said = ProgramError::default();
    let mut reader = BufReader::new(stderr);
    let mut line = Vec::new();
    while reader.read_until(b'\n', &mut line).unwrap_or(0) > 0 {
        let _ = std::io::stderr().write_all(&line);
        said.read(&String::from_utf8_lossy(&line));
        line.clear();
    }
    said
}

/// Passes SIGTERM and SIGINT on to the MPI launcher, which stops its ranks and exits, and
/// with it `launch`. As a container's first process, `launch` would otherwise ignore the
/// SIGTERM the kubelet sends when the pod is deleted and be killed only when the grace period
/// (30 s) ends: every gang restart and every deletion would wait for it.
fn forward_termination(mut signals: signal_hook::iterator::Signals, child: u32) {
    std::thread::spawn(move || {
        for signal in signals.forever() {
            // SAFETY: kill(2) takes any pid and signal number; the pid is our own child's.
            unsafe { libc::kill(child as libc::pid_t, signal) };
        }
    });
}

/// SIGTERM and SIGINT, caught from now on (and reset to their defaults in a spawned program).
fn termination_signals() -> std::io::Result<signal_hook::iterator::Signals> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `launch` over `sh -c script`.
    fn run_sh(script: &str, file: &Path) -> u8 {
        run(&["sh".into(), "-c".into(), script.into()], file).unwrap()
    }

    #[test]
    fn the_summary_line_is_written_and_the_exit_code_kept() {
        let dir = std::env::temp_dir().join(format!("launch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("termination-log");
        let script = r#"echo '{"event":"step","step":1,"loss":7.0,"accuracy":0.0,"learningRate":0.1,"imagesPerSecond":null}'; echo '{"event":"summary","imagesPerSecond":12.5,"steps":3,"finalLoss":0.5,"finalAccuracy":0.25,"worldSize":2,"globalBatch":8,"parameters":100,"seconds":1.0}'; exit 3"#;
        let code = run_sh(script, &file);
        assert_eq!(code, 3);
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(written["imagesPerSecond"], 12.5);
        let code = run_sh("kill -9 $$", &file);
        assert_eq!(code, 137, "the launcher itself killed");
        let code = run_sh("exit 137", &file);
        assert_eq!(code, exit::PEER_LOST, "mpirun saw a rank killed");
        let code = run_sh("exit 75", &file);
        assert_eq!(code, exit::PEER_LOST, "a rank saw its peer go");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn without_a_summary_the_failure_that_caused_the_others_is_written() {
        let dir = std::env::temp_dir().join(format!("launch-failed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("termination-log");
        // Rank 1 lost its peer, rank 0 had the error; then mpirun's banner.
        let script = r#"echo '{"event":"failed","rank":1,"error":"the ring lost rank 0","exitCode":75}'; echo '{"event":"failed","rank":0,"error":"decoding x.jpg: invalid JPEG","exitCode":1}'; echo 'mpirun detected that one or more processes exited with non-zero status'; exit 1"#;
        let code = run_sh(script, &file);
        assert_eq!(code, 1);
        let written = std::fs::read_to_string(&file).unwrap();
        let failure = Failure::find_in(&written).expect("a failure line");
        assert_eq!(failure.to_string(), "rank 0: decoding x.jpg: invalid JPEG");
        assert_eq!(written.lines().count(), 1, "{written}");
        // Only lost peers, or nothing typed: nothing written, and the kubelet keeps the
        // log's tail.
        std::fs::remove_file(&file).unwrap();
        let script = r#"echo '{"event":"failed","rank":1,"error":"rank 2 (next) is gone","exitCode":75}'; echo 'rank 2 exited on signal 9 (Killed)'; exit 75"#;
        let code = run_sh(script, &file);
        assert_eq!(code, exit::PEER_LOST);
        assert!(!file.exists());
        let code = run_sh("echo 'ssh: connect refused'; exit 1", &file);
        assert_eq!(code, 1);
        assert!(!file.exists());
        std::fs::remove_dir_all(dir).ok();
    }

    /// A program that prints no failure line (a Python script): the exception its traceback
    /// ends with, on stderr, is the termination message, and stderr still reaches ours.
    #[test]
    fn a_programs_python_exception_on_stderr_becomes_its_failure_line() {
        let dir = std::env::temp_dir().join(format!("launch-python-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("termination-log");
        let script = r#"printf 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: 3 classes, not 10\n' >&2; exit 1"#;
        assert_eq!(run_sh(script, &file), 1);
        let written = std::fs::read_to_string(&file).unwrap();
        let failure = Failure::find_in(&written).expect("a failure line");
        assert_eq!(
            (failure.error.as_str(), failure.exit_code),
            ("ValueError: 3 classes, not 10", 1)
        );
        // A summary wins, and a rank killed by a signal leaves the log's tail to the kubelet.
        std::fs::remove_file(&file).unwrap();
        let killed = r#"printf 'Traceback (most recent call last):\n  x\nRuntimeError: Connection closed by peer\n' >&2; exit 137"#;
        assert_eq!(run_sh(killed, &file), exit::PEER_LOST);
        assert!(!file.exists());
        std::fs::remove_dir_all(dir).ok();
    }

    /// `mpirun` reported a peer's lost-peer exit before the failing rank's own: the job
    /// still leaves with the cause's code (a verdict), not 75 (a restart).
    #[test]
    fn the_causes_code_wins_over_a_lost_peer_reported_first() {
        let dir = std::env::temp_dir().join(format!("launch-race-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("termination-log");
        let lines = r#"echo '{"event":"failed","rank":1,"error":"rank 0 (previous) is gone","exitCode":75}'; echo '{"event":"failed","rank":0,"error":"decoding x.jpg: invalid JPEG","exitCode":1}'"#;
        let code = run_sh(&format!("{lines}; exit 75"), &file);
        assert_eq!(code, 1, "the rank's own code");
        // A rank killed by a signal is what `mpirun` saw first: the gang is incomplete
        // whatever else a rank said.
        let code = run_sh(&format!("{lines}; exit 137"), &file);
        assert_eq!(code, exit::PEER_LOST);
        let only_lost = r#"echo '{"event":"failed","rank":1,"error":"rank 0 (previous) is gone","exitCode":75}'; exit 75"#;
        let code = run_sh(only_lost, &file);
        assert_eq!(code, exit::PEER_LOST);
        std::fs::remove_dir_all(dir).ok();
    }
}
