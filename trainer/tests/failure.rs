//! A rank's panic reaches `launch` as its failure line on stdout.

use std::process::Command;

use ringmaster_contract::trainer::{Failure, exit};

const CHILD: &str = "RINGMASTER_TEST_PANICKING_CHILD";

/// Runs itself again as a child process that reports panics as the trainer does and then
/// panics on a thread of its own, as a GPU error in the engine would: the child says why
/// and leaves with the panic's code from that thread.
#[test]
fn a_panic_prints_the_ranks_failure_line_before_the_usual_report() {
    if std::env::var_os(CHILD).is_some() {
        ringmaster_trainer::failure::set_rank(3);
        ringmaster_trainer::failure::report_panics();
        let mib = 64;
        let _ = std::thread::spawn(move || panic!("the CUDA arena ({mib} MiB) is full")).join();
        // Reached only if the hook let the thread unwind: an exit the parent tells apart.
        std::process::exit(0);
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_panic_prints_the_ranks_failure_line_before_the_usual_report",
            "--nocapture",
            // Not 1: libtest would then print the test's name on the line the child's
            // failure line goes to.
            "--test-threads=2",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(i32::from(exit::PANICKED)),
        "{stderr}"
    );
    let failure = Failure::find_in(&stdout).unwrap_or_else(|| panic!("no failure line: {stdout}"));
    assert_eq!((failure.rank, failure.exit_code), (Some(3), exit::PANICKED));
    assert!(
        failure
            .error
            .starts_with("the CUDA arena (64 MiB) is full (panicked at trainer/tests/failure.rs:"),
        "{}",
        failure.error
    );
    // The usual report still follows on stderr; the child ended in the hook, before its
    // test could fail or pass.
    assert!(
        stderr.contains("panicked at") && stderr.contains("the CUDA arena (64 MiB) is full"),
        "{stderr}"
    );
    assert!(!stdout.contains("test result"), "{stdout}");
}
