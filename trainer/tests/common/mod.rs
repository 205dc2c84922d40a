//! Helpers the trainer's multi-process tests share.
#![allow(dead_code)] // each test binary uses a part of these

use std::process::Command;

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `mpirun -np N ringmaster-trainer ARGS…` on this machine.
pub fn mpirun(ranks: usize, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mpirun = which("mpirun")
        .expect("mpirun is not installed: `make test` installs Debian's openmpi-bin");
    let mut command = Command::new(mpirun);
    command
        .args([
            "-np",
            &ranks.to_string(),
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .args([
            "--mca",
            "btl",
            "self,tcp",
            "--mca",
            "btl_tcp_if_include",
            "lo",
        ])
        .arg(env!("CARGO_BIN_EXE_ringmaster-trainer"))
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env(
            "RINGMASTER_RENDEZVOUS",
            format!("127.0.0.1:{}", free_port()),
        );
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("mpirun runs")
}

fn which(program: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| std::path::Path::new(dir).join(program))
        .find(|p| p.is_file())
}

/// The `{"event":"summary",…}` line of a trainer's output.
pub fn summary(stdout: &[u8]) -> serde_json::Value {
    json_lines(stdout)
        .into_iter()
        .find(|v| v["event"] == "summary")
        .expect("a summary line")
}

/// Every JSON line of a trainer's output.
pub fn json_lines(stdout: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}
