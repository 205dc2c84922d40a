//! Helpers the trainer's multi-process tests share.
#![allow(dead_code)] // each test binary uses a part of these

use std::process::Command;

fn free_port() -> u16 {
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
