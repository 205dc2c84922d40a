//! Helpers the trainer's multi-process tests share.
#![allow(dead_code)] // each test binary uses a part of these

use std::process::Command;

use ringmaster_trainer::collective::{Collective, CollectiveError, ReduceOp};

/// The smallest network that trains: a 4-wide CIFAR ResNet-8 on 8×8 images of two
/// learnable classes, 4 images per rank (add `--dataset-size` and `--steps`).
pub const TINY_RUN: &[&str] = &[
    "--model=cifar8",
    "--width=4",
    "--image-size=8",
    "--batch-size=4",
    "--learnable-classes=2",
];

/// The trainer's binary: `RINGMASTER_TRAINER_BIN` where set (a GPU machine runs the tests
/// from a bundle, where the build machine's path does not exist), else Cargo's.
pub fn trainer_bin() -> String {
    std::env::var("RINGMASTER_TRAINER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_ringmaster-trainer").to_string())
}

/// `ringmaster-trainer ARGS…`, run to the end.
pub fn trainer(args: &[&str]) -> std::process::Output {
    Command::new(trainer_bin())
        .args(args)
        .output()
        .expect("trainer runs")
}

#[path = "../../../tests/support/ports.rs"]
mod ports;

/// A port on 127.0.0.1 that was free a moment ago, and that nobody else will be handed
/// ([`ports::free_port`]).
pub fn free_port() -> u16 {
    ports::free_port("127.0.0.1")
}

/// `mpirun -np N` with the settings for this machine (loopback only), up to the program.
pub fn mpirun_command(ranks: usize) -> Vec<String> {
    let mpirun = which("mpirun")
        .expect("mpirun is not installed: `make test` installs Debian's openmpi-bin");
    [
        mpirun.display().to_string().as_str(),
        "-np",
        &ranks.to_string(),
        "--oversubscribe",
        "--bind-to",
        "none",
        "--mca",
        "btl",
        "self,tcp",
        "--mca",
        "btl_tcp_if_include",
        "lo",
    ]
    .map(String::from)
    .to_vec()
}

/// The environment `mpirun_command` needs: root allowed, a free rendezvous port.
pub fn mpirun_env() -> Vec<(String, String)> {
    vec![
        ("OMPI_ALLOW_RUN_AS_ROOT".into(), "1".into()),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM".into(), "1".into()),
        (
            "RINGMASTER_RENDEZVOUS".into(),
            format!("127.0.0.1:{}", free_port()),
        ),
    ]
}

/// `mpirun -np N ringmaster-trainer ARGS…` on this machine.
pub fn mpirun(ranks: usize, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let (mpirun, options) = mpirun_command(ranks)
        .split_first()
        .map(|(m, o)| (m.clone(), o.to_vec()))
        .unwrap();
    let mut command = Command::new(mpirun);
    command
        .args(options)
        .arg(trainer_bin())
        .args(args)
        .envs(mpirun_env());
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("mpirun runs")
}

/// Process ids under `ancestor` (its children, theirs, …) whose command line is
/// `program SUBCOMMAND …` (read from /proc): another test's processes of the same program,
/// running beside it, are not counted.
pub fn processes_running_under(ancestor: u32, program: &str, subcommand: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| {
            let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let mut args = cmdline.split(|b| *b == 0).map(String::from_utf8_lossy);
            (args.next()? == program && args.next()? == subcommand && descends(pid, ancestor))
                .then_some(pid)
        })
        .collect()
}

/// Whether `ancestor` is among `pid`'s parents, grandparents, … (each read from /proc).
fn descends(mut pid: u32, ancestor: u32) -> bool {
    while pid > 1 {
        // `/proc/PID/stat`: "PID (COMM) STATE PPID …"; COMM may hold spaces and parentheses.
        let Some(parent) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let after_comm = &stat[stat.rfind(')')? + 1..];
                after_comm.split_whitespace().nth(1)?.parse::<u32>().ok()
            })
        else {
            return false;
        };
        if parent == ancestor {
            return true;
        }
        pid = parent;
    }
    false
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

/// The `{"event":"step",…}` lines of a trainer's output, in order.
pub fn steps(stdout: &[u8]) -> Vec<serde_json::Value> {
    json_lines(stdout)
        .into_iter()
        .filter(|v| v["event"] == "step")
        .collect()
}

/// Every JSON line of a trainer's output.
pub fn json_lines(stdout: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The flags the operator gives the flagship GPU sample (`fixtures/flagship-train-flags.txt`,
/// kept true by the operator's `training_job_build` test), with the data and output folders
/// moved to `data_dir` and `output_dir` and the run cut to `steps` steps. Later flags win.
pub fn flagship_flags(
    data_dir: &std::path::Path,
    output_dir: &std::path::Path,
    steps: usize,
) -> Vec<String> {
    // Relative first: the GPU tests run from `trainer/` on a machine where the build
    // machine's path may not exist.
    let name = "tests/fixtures/flagship-train-flags.txt";
    let fixture = std::fs::read_to_string(name)
        .or_else(|_| {
            std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(name))
        })
        .expect("the flagship fixture");
    let mut flags: Vec<String> = fixture
        .lines()
        // The replaced flags go (the trainer refuses a folder twice, and --steps with --epochs).
        .filter(|f| {
            !["--epochs", "--data-dir", "--output-dir"]
                .iter()
                .any(|r| f.starts_with(r))
        })
        .map(String::from)
        .collect();
    flags.extend([
        format!("--data-dir={}", data_dir.display()),
        format!("--output-dir={}", output_dir.display()),
        format!("--steps={steps}"),
        "--log-every=10".to_string(),
    ]);
    flags
}

/// One rank whose peer is lost at its `fails_at`-th all-reduce (counted from 1; one a step:
/// the loss), as a worker's death reaches the ranks left.
pub struct PeerLostAt {
    pub fails_at: usize,
    pub calls: usize,
}

impl Collective for PeerLostAt {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn name(&self) -> &'static str {
        "peer-lost-at"
    }
    fn all_reduce(&mut self, _data: &mut [f32], _op: ReduceOp) -> Result<(), CollectiveError> {
        self.calls += 1;
        if self.calls == self.fails_at {
            return Err(CollectiveError::PeerLost {
                peer: 1,
                direction: "from",
                source: std::io::ErrorKind::ConnectionReset.into(),
            });
        }
        Ok(())
    }
    fn broadcast(&mut self, _data: &mut [f32], _root: usize) -> Result<(), CollectiveError> {
        Ok(())
    }
}
