//! Real multi-process runs under Debian's Open MPI (`make test` installs it).

use std::time::{Duration, Instant};

mod common;
use common::mpirun;
use ringmaster_contract::trainer::{Failure, RENDEZVOUS_KEY_FILE_ENV, exit};

#[test]
fn four_ranks_under_mpirun_sum_correctly() {
    let out = mpirun(
        4,
        &[
            "bench-allreduce",
            "--min-bytes",
            "4",
            "--max-bytes",
            "256K",
            "--step-factor",
            "8",
            "--iterations",
            "2",
            "--warmup",
            "1",
            "--check",
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("4 ranks, tcp-ring"), "{stdout}");
    let rows: Vec<&str> = stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 6, "{stdout}");
    assert!(
        rows.iter().all(|r| r.trim_end().ends_with(" 0")),
        "{stdout}"
    );
}

#[test]
fn killing_one_rank_makes_the_others_exit_with_an_error() {
    let start = Instant::now();
    let out = mpirun(
        3,
        &[
            "bench-allreduce",
            "--min-bytes",
            "1M",
            "--max-bytes",
            "1M",
            "--vanish-rank",
            "2",
        ],
        &[("RINGMASTER_COLLECTIVE_TIMEOUT", "10")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(i32::from(exit::PEER_LOST)),
        "the survivors exit with the lost-peer code, and mpirun passes it on: {stderr}"
    );
    assert!(
        stderr.contains("is gone") || stderr.contains("sent nothing"),
        "{stderr}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn rank_discovery_reads_open_mpi() {
    let out = mpirun(2, &["info"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let mut ranks: Vec<u64> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            assert_eq!(v["rankSource"], "Open MPI");
            assert_eq!(v["worldSize"], 2);
            v["rank"].as_u64().unwrap()
        })
        .collect();
    ranks.sort();
    assert_eq!(ranks, vec![0, 1]);
}

/// What the launcher pod runs: `ringmaster-trainer launch -- mpirun … ringmaster-trainer
/// train …`. A rank killed with SIGKILL mid-training makes mpirun abort the job; the launcher
/// leaves with the lost-peer code the operator restarts the gang on.
#[test]
fn a_rank_killed_under_mpirun_leaves_the_launcher_with_the_lost_peer_code() {
    let dir = std::env::temp_dir().join(format!("kill-rank-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let termination = dir.join("termination-log");
    let trainer = env!("CARGO_BIN_EXE_ringmaster-trainer");
    let mut child = std::process::Command::new(trainer)
        .arg("launch")
        .arg("--termination-message")
        .arg(&termination)
        .arg("--")
        .args(common::mpirun_command(3))
        .args([trainer, "train"])
        .args(common::TINY_RUN)
        .args(["--dataset-size=4096", "--steps=100000", "--log-every=1"])
        .envs(common::mpirun_env())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("launch starts");
    // Wait for training to be under way (a step line), then kill rank 2 (the last process
    // whose command line is the trainer's `train`).
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let started = Instant::now();
    loop {
        let line = lines
            .next()
            .expect("a step line before the output ends")
            .unwrap();
        if line.contains(r#""event":"step""#) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no step within 60 s"
        );
    }
    let ranks = common::processes_running_under(child.id(), trainer, "train");
    assert_eq!(ranks.len(), 3, "three ranks running: {ranks:?}");
    let victim = *ranks.iter().max().unwrap();
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", &victim.to_string()])
            .status()
            .unwrap()
            .success()
    );
    std::thread::spawn(move || lines.for_each(drop));
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(
        status.code(),
        Some(i32::from(exit::PEER_LOST)),
        "launch's exit code: {stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    // No summary for a run that did not finish, and no failure: the survivors only lost a
    // peer, so the kubelet keeps the log's tail, where mpirun names the rank it saw killed.
    assert!(
        !termination.exists(),
        "{:?}",
        std::fs::read_to_string(&termination)
    );
    std::fs::remove_dir_all(dir).ok();
}

/// A rank that fails (here on a broken JPEG its shard reaches) stops the gang, and the
/// termination message `launch` leaves holds that rank's own error: the first failure that
/// is not a lost peer, whatever the other ranks and `mpirun` print after it.
#[test]
fn the_failing_ranks_own_error_is_left_in_the_termination_message() {
    let dir = std::env::temp_dir().join(format!("failed-rank-{}", std::process::id()));
    let data = dir.join("data");
    ringmaster_trainer::engine::image_folder::write_learnable(&data, 2, 12, 16, 0).unwrap();
    std::fs::write(data.join("train/class-001/zz-broken.jpg"), b"not a JPEG").unwrap();
    let termination = dir.join("termination-log");
    let trainer = env!("CARGO_BIN_EXE_ringmaster-trainer");
    let out = std::process::Command::new(trainer)
        .arg("launch")
        .arg("--termination-message")
        .arg(&termination)
        .arg("--")
        .args(common::mpirun_command(3))
        .args([
            trainer,
            "train",
            "--model=cifar8",
            "--width=4",
            "--image-size=16",
        ])
        .args(["--batch-size=2", "--epochs=2", "--data-dir"])
        .arg(&data)
        .envs(common::mpirun_env())
        .env("RINGMASTER_COLLECTIVE_TIMEOUT", "20")
        .output()
        .expect("launch runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(i32::from(exit::FAILED)), "{stderr}");
    assert!(
        stderr.contains("mpirun"),
        "mpirun's own report follows: {stderr}"
    );
    let written = std::fs::read_to_string(&termination).expect("a termination message");
    assert_eq!(written.lines().count(), 1, "{written}");
    let failure = Failure::find_in(&written).expect("a failure line");
    assert_eq!(failure.exit_code, exit::FAILED, "{written}");
    assert!(failure.rank.is_some_and(|rank| rank < 3), "{written}");
    assert!(
        failure.error.starts_with("decoding ") && failure.error.contains("zz-broken.jpg"),
        "{written}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// The kubelet stops a pod with SIGTERM to its first process, `launch` in the launcher pod:
/// `launch` passes it to the MPI launcher (here a stand-in that records its pid and sleeps)
/// and leaves when it has exited, rather than ignoring it (as a container's first process
/// would) or dying alone and leaving it running.
#[test]
fn sigterm_to_launch_reaches_the_mpi_launcher_which_ends() {
    let dir = std::env::temp_dir().join(format!("sigterm-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pid_file = dir.join("launcher.pid");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ringmaster-trainer"))
        .arg("launch")
        .arg("--termination-message")
        .arg(dir.join("termination-log"))
        .args(["--", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 60", pid_file.display()))
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("launch starts");
    let started = Instant::now();
    let launcher: i32 = loop {
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            break pid;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "no pid file");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let status = child.wait().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "launch took {:?} to end",
        started.elapsed()
    );
    // The stand-in died of the SIGTERM: launch leaves with 128 + 15.
    assert_eq!(status.code(), Some(143));
    assert!(
        !std::path::Path::new(&format!("/proc/{launcher}")).exists(),
        "the MPI launcher {launcher} is still running"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A rendezvous key of 32 bytes in a file of its own (`name`), as the operator mounts one.
fn key_file(name: &str, byte: u8) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("rendezvous-key-{}-{name}", std::process::id()));
    std::fs::write(&path, [byte; 32]).unwrap();
    path
}

const SMALL_CHECKED_ALL_REDUCE: &[&str] = &[
    "bench-allreduce",
    "--min-bytes",
    "4",
    "--max-bytes",
    "64K",
    "--step-factor",
    "16",
    "--iterations",
    "1",
    "--warmup",
    "0",
    "--check",
];

/// Every rank holds the job's key (`RINGMASTER_RENDEZVOUS_KEY_FILE`, as the operator sets
/// it): the ranks sign their way in, and nobody is refused.
#[test]
fn four_ranks_with_the_jobs_rendezvous_key_sum_correctly_under_mpirun() {
    let key = key_file("shared", 0x42);
    let out = mpirun(
        4,
        SMALL_CHECKED_ALL_REDUCE,
        &[(RENDEZVOUS_KEY_FILE_ENV, key.to_str().unwrap())],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("4 ranks, tcp-ring"), "{stdout}");
    let rows: Vec<&str> = stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(
        !rows.is_empty() && rows.iter().all(|r| r.trim_end().ends_with(" 0")),
        "{stdout}"
    );
    assert!(!stderr.contains("refused"), "{stderr}");
    std::fs::remove_file(key).ok();
}

/// Under mpirun, a rank whose key is not the others' (rank 1 here) is refused at rank 0's
/// rendezvous, which logs it with its address; the refused rank says why, and the gang, a
/// rank short, ends as a lost peer after the collective timeout.
#[test]
fn a_rank_with_another_key_is_refused_under_mpirun() {
    let (ours, theirs) = (key_file("ours", 1), key_file("theirs", 2));
    let trainer = common::trainer_bin();
    let script = format!(
        "if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then export {RENDEZVOUS_KEY_FILE_ENV}={}; fi; exec \"$@\"",
        theirs.display()
    );
    let out = std::process::Command::new(&common::mpirun_command(2)[0])
        .args(&common::mpirun_command(2)[1..])
        .args(["sh", "-c", &script, "sh", &trainer])
        .args(SMALL_CHECKED_ALL_REDUCE)
        .envs(common::mpirun_env())
        .env(RENDEZVOUS_KEY_FILE_ENV, &ours)
        .env("RINGMASTER_COLLECTIVE_TIMEOUT", "5")
        .output()
        .expect("mpirun runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(i32::from(exit::PEER_LOST)),
        "{stderr}"
    );
    assert!(
        stderr.contains("rank 0 refused 127.0.0.1:")
            && stderr.contains("at the rendezvous: its signature is not the job's key's"),
        "{stderr}"
    );
    assert!(
        stderr.contains("it refused this rank's hello (is its rendezvous key another?)"),
        "{stderr}"
    );
    std::fs::remove_file(ours).ok();
    std::fs::remove_file(theirs).ok();
}

/// Two ranks as separate processes (`RANK`, `WORLD_SIZE`) with the job's key; between rank
/// 0's start and rank 1's, a stranger connects to the rendezvous and sends an unsigned hello
/// for rank 1. Rank 0 logs it on stderr, with the stranger's address, and closes on it; the
/// real rank 1 then takes its place and the all-reduce checks out.
#[test]
fn a_stranger_at_the_trainers_rendezvous_is_logged_and_the_ranks_go_on() {
    use std::io::{BufRead, Write};
    let key = key_file("processes", 7);
    let port = common::free_port();
    let rank = |rank: &str| {
        std::process::Command::new(common::trainer_bin())
            .args(SMALL_CHECKED_ALL_REDUCE)
            .env("RANK", rank)
            .env("WORLD_SIZE", "2")
            .env("RINGMASTER_RENDEZVOUS", format!("127.0.0.1:{port}"))
            .env(RENDEZVOUS_KEY_FILE_ENV, &key)
            .env("RINGMASTER_COLLECTIVE_TIMEOUT", "20")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("a rank starts")
    };
    let rank_0 = rank("0");
    let started = Instant::now();
    let mut stranger = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => break stream,
            Err(e) => assert!(started.elapsed() < Duration::from_secs(10), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    stranger
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut challenge = String::new();
    std::io::BufReader::new(&stranger)
        .read_line(&mut challenge)
        .unwrap();
    assert!(challenge.contains("nonce"), "{challenge}");
    stranger
        .write_all(b"{\"rank\":1,\"world\":2,\"addr\":\"127.0.0.1:9\"}\n")
        .unwrap();
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut stranger, &mut rest);
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    let stranger_addr = stranger.local_addr().unwrap();

    let rank_1 = rank("1").wait_with_output().unwrap();
    let rank_0 = rank_0.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&rank_0.stdout),
        String::from_utf8_lossy(&rank_0.stderr),
    );
    assert!(
        rank_0.status.success() && rank_1.status.success(),
        "{stdout}\n{stderr}\n{}",
        String::from_utf8_lossy(&rank_1.stderr)
    );
    assert!(stdout.contains("2 ranks, tcp-ring"), "{stdout}");
    assert!(
        stderr.contains(&format!(
            "ringmaster-trainer: rank 0 refused {stranger_addr} at the rendezvous: it is unsigned"
        )),
        "{stderr}"
    );
    std::fs::remove_file(key).ok();
}

/// The preflight's flags for a quick measurement: 4 MiB per rank, the threshold given.
fn preflight_run(min_bus_gbps: &str) -> Vec<String> {
    let mut args = vec!["train".to_string()];
    args.extend(common::TINY_RUN.iter().map(ToString::to_string));
    args.extend(
        [
            "--dataset-size=48",
            "--steps=2",
            "--log-every=1",
            "--preflight-bytes=4194304",
        ]
        .map(String::from),
    );
    args.push(format!("--preflight-min-bus-gbps={min_bus_gbps}"));
    args
}

/// The `preflight` line's links and slowest link, checked for what any measurement must
/// show: one link per rank from the rank before it, every figure a bandwidth, and the
/// slowest named with its hosts and the least of them.
fn check_links(preflight: &serde_json::Value, ranks: u64) -> (u64, u64, f64) {
    let links = preflight["links"].as_array().expect("links");
    assert_eq!(links.len() as u64, ranks, "{preflight}");
    for (to, link) in links.iter().enumerate() {
        assert_eq!(link["to"], to as u64, "{preflight}");
        assert_eq!(link["from"], (to as u64 + ranks - 1) % ranks, "{preflight}");
        let gbps = link["gbps"].as_f64().unwrap();
        assert!(gbps.is_finite() && gbps > 0.0, "{preflight}");
    }
    let least = links
        .iter()
        .map(|l| l["gbps"].as_f64().unwrap())
        .fold(f64::INFINITY, f64::min);
    let slowest = &preflight["slowest"];
    assert_eq!(slowest["gbps"].as_f64(), Some(least), "{preflight}");
    assert!(
        links
            .iter()
            .any(|l| l["from"] == slowest["from"] && l["to"] == slowest["to"]),
        "the slowest is a link of the ring: {preflight}"
    );
    let host = |key: &str| slowest[key].as_str().unwrap_or_default().to_string();
    assert!(
        !host("fromHost").is_empty() && !host("toHost").is_empty(),
        "{preflight}"
    );
    (
        slowest["from"].as_u64().unwrap(),
        slowest["to"].as_u64().unwrap(),
        least,
    )
}

#[test]
fn a_preflight_below_the_fabrics_speed_passes_and_training_goes_on() {
    let args = preflight_run("0.001");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = mpirun(3, &args, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = common::json_lines(&out.stdout);
    let at = |event: &str| lines.iter().position(|l| l["event"] == event);
    let preflight = &lines[at("preflight").expect("a preflight line")];
    assert_eq!(
        lines.iter().filter(|l| l["event"] == "preflight").count(),
        1,
        "rank 0 alone says it: {stdout}"
    );
    assert!(
        at("preflight") < at("step"),
        "measured before the first step: {stdout}"
    );
    assert_eq!(preflight["passed"], true, "{preflight}");
    assert_eq!(preflight["collective"], "tcp-ring", "{preflight}");
    assert_eq!(
        (preflight["worldSize"].as_u64(), preflight["bytes"].as_u64()),
        (Some(3), Some(4 << 20))
    );
    assert_eq!(preflight["minBusBandwidthGbps"].as_f64(), Some(0.001));
    let bus = preflight["busBandwidthGbps"].as_f64().unwrap();
    // Loopback TCP on this machine: above the threshold, far below memory's bandwidth.
    assert!((0.001..1000.0).contains(&bus), "{preflight}");
    check_links(preflight, 3);
    assert_eq!(common::summary(&out.stdout)["steps"], 2, "{stdout}");
}

#[test]
fn a_fabric_below_the_preflights_threshold_fails_every_rank_naming_the_slowest_pair() {
    let start = Instant::now();
    let dir = std::env::temp_dir().join(format!("preflight-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let termination = dir.join("termination-log");
    let trainer = env!("CARGO_BIN_EXE_ringmaster-trainer");
    let out = std::process::Command::new(trainer)
        .arg("launch")
        .arg("--termination-message")
        .arg(&termination)
        .arg("--")
        .args(common::mpirun_command(3))
        .arg(trainer)
        .args(preflight_run("1e6"))
        .envs(common::mpirun_env())
        .output()
        .expect("launch runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(i32::from(exit::FABRIC_TOO_SLOW)),
        "{stdout}\n{stderr}"
    );
    let lines = common::json_lines(&out.stdout);
    assert!(
        !lines.iter().any(|l| l["event"] == "step"),
        "no step trained: {stdout}"
    );
    let preflight = lines
        .iter()
        .find(|l| l["event"] == "preflight")
        .expect("rank 0's figures");
    assert_eq!(preflight["passed"], false, "{preflight}");
    let (from, to, least) = check_links(preflight, 3);
    let failed: Vec<Failure> = stdout.lines().filter_map(Failure::find_in).collect();
    assert_eq!(failed.len(), 3, "every rank says why: {stdout}");
    assert!(
        failed.iter().all(|f| f.exit_code == exit::FABRIC_TOO_SLOW),
        "{stdout}"
    );
    let written = std::fs::read_to_string(&termination).expect("a termination message");
    let failure = Failure::find_in(&written).expect("a failure line");
    assert_eq!(failure.exit_code, exit::FABRIC_TOO_SLOW, "{written}");
    let slowest = format!("slowest link is rank {from} → rank {to} (");
    for words in [
        "the fabric is too slow",
        "below the minimum of 1000000 GB/s",
        slowest.as_str(),
        &format!("at {least:.3} GB/s"),
    ] {
        assert!(failure.error.contains(words), "{words:?} in {written}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "failed fast, not after training: {:?}",
        start.elapsed()
    );
    std::fs::remove_dir_all(dir).ok();
}
