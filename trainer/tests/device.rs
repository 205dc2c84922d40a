//! `--device` and what `info` says about the GPUs, on any machine: this release has no CUDA
//! engine, so `auto` computes on the CPU and says why; `info` lists what the trainer can run
//! (the contract's capabilities) and what the machine offers, consistently.

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

#[test]
fn auto_computes_on_the_cpu_and_says_why() {
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
    match serde_json::from_str::<Line>(&first).unwrap() {
        Line::Device(choice) => {
            assert_eq!(
                (choice.requested, choice.device),
                (Device::Auto, Device::Cpu)
            );
            assert!(
                choice.reason.unwrap().contains("no CUDA engine"),
                "this release has none"
            );
        }
        other => panic!("the first line says where it computes, got {other:?}"),
    }
}
