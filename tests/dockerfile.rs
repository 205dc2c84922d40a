//! No Docker engine here: the Dockerfile is checked as far as text allows — both targets
//! exist, every `COPY --from` names an earlier stage, the binaries it builds are the
//! workspace's, and the operator image runs as non-root.

#[path = "common/mod.rs"]
mod fixtures;

#[test]
fn dockerfile_targets_stages_and_binaries_are_consistent() {
    let text = std::fs::read_to_string(fixtures::root().join("Dockerfile")).unwrap();
    let mut stages: Vec<String> = Vec::new();
    let mut current = String::new();
    let mut users = std::collections::HashMap::new();
    for line in text.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["FROM", _, "AS", name] => {
                current = name.to_string();
                stages.push(current.clone());
            }
            ["FROM", ..] => panic!("every stage is named: {line}"),
            ["COPY", from, ..] if from.starts_with("--from=") => {
                let stage = &from["--from=".len()..];
                assert!(
                    stages.iter().any(|s| s == stage),
                    "COPY from unknown stage {stage}"
                );
            }
            ["USER", user] => {
                users.insert(current.clone(), user.to_string());
            }
            _ => {}
        }
    }
    for target in ["build", "operator", "trainer"] {
        assert!(stages.iter().any(|s| s == target), "no stage {target}");
    }
    assert_eq!(
        users.get("operator").map(String::as_str),
        Some("65532:65532")
    );
    assert_eq!(users.get("trainer").map(String::as_str), Some("1000:1000"));
    // The binaries built are the workspace's.
    assert!(text.contains("-p ringmaster --bin ringmaster"));
    assert!(text.contains("-p ringmaster-trainer --bin ringmaster-trainer"));
    let trainer_manifest =
        std::fs::read_to_string(fixtures::root().join("trainer/Cargo.toml")).unwrap();
    assert!(trainer_manifest.contains("name = \"ringmaster-trainer\""));
    // The trainer image is set up by the same script the local cluster's real node builds its
    // image with (e2e/tools/image.sh), so the e2e tests run the published recipe.
    assert!(text.contains("COPY trainer/image/setup.sh"));
    let image_script =
        std::fs::read_to_string(fixtures::root().join("e2e/tools/image.sh")).unwrap();
    assert!(image_script.contains("setup=\"$root/trainer/image/setup.sh\""));
    // It installs what NCCL's InfiniBand transport loads: libibverbs and the mlx5 provider.
    let setup = std::fs::read_to_string(fixtures::root().join("trainer/image/setup.sh")).unwrap();
    let mut install = String::new();
    for line in setup.lines().skip_while(|l| !l.contains("apt-get install")) {
        install.push_str(line.trim_end().trim_end_matches('\\'));
        install.push(' ');
        if !line.trim_end().ends_with('\\') {
            break;
        }
    }
    let installed: Vec<&str> = install.split_whitespace().collect();
    for package in ["rdma-core", "libibverbs1", "ibverbs-providers"] {
        assert!(installed.contains(&package), "{package} in {installed:?}");
    }
    // The chart runs the operator image's entrypoint with `run`.
    let deployment = std::fs::read_to_string(
        fixtures::root().join("charts/ringmaster/templates/deployment.yaml"),
    )
    .unwrap();
    assert!(
        deployment.contains("- run\n")
            && text.contains("ENTRYPOINT [\"/usr/local/bin/ringmaster\"]")
    );
}
