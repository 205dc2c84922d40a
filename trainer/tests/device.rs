//! `--device` and what `info` says about the GPUs, on any machine: `auto` computes where
//! `info`'s probe says it can, and says why not on the GPU; `info` lists what the trainer
//! can run (the contract's capabilities) and what the machine offers, consistently.

mod common;

use common::{TINY_RUN, trainer};
use ringmaster_contract::trainer::{Capabilities, Device, Line};

#[test]
fn info_prints_the_capabilities_and_the_gpu_probe() {
    let out = trainer(&["info", "--json"]);
    assert!(out.status.success());
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let capabilities: Capabilities = serde_json::from_value(info["capabilities"].clone()).unwrap();
    assert_eq!(capabilities, Capabilities::this_release());
    let gpu = &info["gpu"];
    // Whatever this machine has, the probe is consistent: no driver, no GPUs; a missing
    // piece is named unless every library the engine needs loads.
    if gpu["driver"].is_null() {
        assert_eq!(gpu["gpus"], serde_json::json!([]));
        assert!(
            gpu["missing"].as_str().unwrap().contains("CUDA driver"),
            "{gpu}"
        );
    }
    let complete = !gpu["gpus"].as_array().unwrap().is_empty()
        && ["cudnn", "cublas", "nvrtc"]
            .iter()
            .all(|l| gpu[l].is_string());
    assert_eq!(gpu["missing"].is_null(), complete, "{gpu}");
}

/// What `info`'s probe says is missing for the CUDA engine here, if anything.
fn missing_for_the_gpu() -> Option<String> {
    let out = trainer(&["info", "--json"]);
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    info["gpu"]["missing"].as_str().map(String::from)
}

#[test]
fn auto_computes_where_the_probe_says_and_says_why_not_on_the_gpu() {
    let args = [
        &["train"],
        TINY_RUN,
        &["--dataset-size=64", "--steps=2", "--device=auto"],
    ];
    let out = trainer(&args.concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap()
        .to_string();
    let missing = missing_for_the_gpu();
    match serde_json::from_str::<Line>(&first).unwrap() {
        Line::Device(choice) => {
            let want = if missing.is_some() {
                Device::Cpu
            } else {
                Device::Cuda
            };
            assert_eq!((choice.requested, choice.device), (Device::Auto, want));
            assert_eq!(
                choice.reason, missing,
                "the probe's reason, where it has one"
            );
        }
        other => panic!("the first line says where it computes, got {other:?}"),
    }
}

#[test]
fn bf16_on_auto_computes_on_the_gpu_or_is_refused_with_the_probes_reason() {
    let args = [
        &["train"],
        TINY_RUN,
        &[
            "--dataset-size=64",
            "--steps=2",
            "--device=auto",
            "--precision=bf16",
        ],
    ];
    let out = trainer(&args.concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    match missing_for_the_gpu() {
        Some(missing) => {
            assert_eq!(
                out.status.code(),
                Some(i32::from(
                    ringmaster_contract::trainer::exit::INVALID_SETTINGS
                )),
                "{stderr}"
            );
            assert!(
                stderr.contains("--precision bf16 computes on the CUDA engine only")
                    && stderr.contains(&missing),
                "{stderr}"
            );
        }
        None => assert!(out.status.success(), "{stderr}"),
    }
}
