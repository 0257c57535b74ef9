//! The one-shot GPU script (benches/gpu/oneshot.sh) rehearsed on the emulator: every
//! part runs at small sizes, and its report names every figure a GPU run will produce.
//! A GPU is lent to this project rarely, for minutes; this test keeps the script that
//! uses those minutes working in between.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

#[test]
fn the_one_shot_gpu_script_runs_on_the_emulator() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    let status = Command::new("bash")
        .arg(root.join("benches/gpu/oneshot.sh"))
        .arg(out.path())
        .env("DENOISED_ONESHOT_DEVICE", "emu")
        .env("DENOISED_BIN", env!("CARGO_BIN_EXE_denoised"))
        .status()
        .unwrap();
    let log = std::fs::read_to_string(out.path().join("oneshot.log")).unwrap_or_default();
    assert!(status.success(), "oneshot.sh failed:\n{log}");
    let report: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("oneshot.json")).unwrap()).unwrap();

    // Every part ran and succeeded.
    for part in [
        "machine",
        "selftest",
        "attn",
        "step",
        "step_fa2w",
        "step_fp8",
        "edit",
        "kernels",
        "daemon_load",
        "load_fill_dev",
    ] {
        assert_eq!(
            report["parts"][part]["status"], "ok",
            "part {part}: {}\n{log}",
            report["parts"][part]
        );
    }
    // The self-test's checks all passed.
    let st = &report["selftest"];
    assert!(st["passed"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(st["failed"], 0, "{st}");
    // The attention table: both kernels at every mask ratio.
    let attn = report["attention"].as_array().unwrap();
    let ratios: Vec<f64> = attn
        .iter()
        .map(|a| a["mask_ratio"].as_f64().unwrap())
        .collect();
    assert_eq!(ratios, [0.1, 0.2, 0.4, 1.0]);
    for a in attn {
        for key in [
            "denoised_tflops",
            "wide_kernel_tflops",
            "first_kernel_tflops",
            "cudnn_tflops",
            "queries",
            "keys",
        ] {
            assert!(a[key].as_f64().is_some(), "{key} missing: {a}");
        }
        // The library path ran (the emulator's stand-in for cuDNN, as the script asks).
        assert_eq!(a["cudnn_status"], "ran", "{a}");
        // The PyTorch figures are there on a GPU machine; here torch may be absent.
        assert!(a.get("sdpa_tflops").is_some(), "{a}");
    }
    // The step figures, fp8 weights' beside bf16's.
    let step = &report["step"];
    for key in [
        "full_bf16_ms",
        "edit_m02_bf16_ms",
        "edit_m02_speedup",
        "full_bf16_wide_kernel_ms",
        "full_fp8_ms",
        "full_fp8_over_bf16",
    ] {
        assert!(step[key].as_f64().is_some(), "{key} missing: {step}");
    }
    for key in ["diffusers_full_bf16_ms"] {
        assert!(step.get(key).is_some(), "{key} not named: {step}");
    }
    // The template edit, timed by parts.
    let e = &report["edit"];
    assert!(e["total_s"].as_f64().is_some_and(|s| s > 0.0), "{e}");
    for part in [
        "encode_text_s",
        "vae_encode_s",
        "denoise_s",
        "vae_decode_s",
        "png_encode_s",
    ] {
        assert!(e["parts"][part].as_f64().is_some(), "{part} missing: {e}");
    }
    // The kernel tables of a full and an m = 0.2 step, GEMMs among their kernels.
    let k = report["kernels"].as_array().unwrap();
    let ratios: Vec<f64> = k
        .iter()
        .map(|t| t["mask_ratio"].as_f64().unwrap())
        .collect();
    assert_eq!(ratios, [1.0, 0.2], "{k:?}");
    for t in k {
        let top = t["top"].as_array().unwrap();
        assert!(top.iter().any(|e| e["name"] == "gemm"), "{t}");
        assert!(t["kernels_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{t}");
    }
    // The PyTorch references and Nsight Compute are named (they need a GPU machine).
    for a in attn {
        assert!(a["sdpa_backend_tflops"].is_object(), "{a}");
    }
    assert!(report["torch_gemm"].is_array());
    assert!(report["ncu"]["attention_default"].is_string());
    // The daemon served the load without errors.
    let d = &report["daemon"];
    assert_eq!(d["errors"], 0, "{d}");
    assert!(d["ok"].as_u64().unwrap() > 0, "{d}");
    // The Fill-dev-size load part, rehearsed on the built-in model.
    let f = &report["load_fill_dev"];
    assert_eq!(f["errors"], 0, "{f}");
    assert!(f["edits_per_s"].as_f64().is_some_and(|r| r > 0.0), "{f}");
    assert!(f["p95_s"].as_f64().is_some(), "{f}");
    // Targets are checked on a GPU only.
    assert_eq!(report["targets"]["checked"], false);
    assert!(out.path().join("summary.txt").exists());
}
