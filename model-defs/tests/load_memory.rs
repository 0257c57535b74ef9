//! The loaded transformer holds its weights once (issue 34).
//!
//! A transformer keeps its checkpoint mapped, the pristine copy that LoRA-merged sites
//! are restored from. Reading the weights through the map makes its pages resident in
//! the process (RssFile), so unless they are released the process holds every weight
//! twice: the backend's copy and the mapped pages. On a diffusers flux-small directory
//! the CPU denoise worker was 1353 MB resident (659 MB of it mapped pages) for 643 MB of
//! weights (docs/operations.md, "What each process loads").
//!
//! The test writes an f32 checkpoint of 147 MB with the crate's own safetensors
//! writer (large enough that the process's own heap and threads are noise beside it),
//! then loads it in a fresh process (this test binary, run again for
//! [`measure_in_a_fresh_process`]) and reads that process's resident memory from
//! `/proc/self/status` (RssAnon + RssFile, as `benches/role_memory.sh` counts it):
//! after the load, and again after a LoRA merged on every Linear and unmerged (both
//! read the pristine weights again). Each growth must stay within
//! [`MAX_RATIO`] of the weights' bytes; a second copy makes it about 2.

use std::path::Path;
use std::process::Command;

use denoised_models::flux::lora::LoraFile;
use denoised_models::flux::weights::{param_specs, Seeded, SingleLinear, Site, Source};
use denoised_models::{FluxConfig, FluxTransformer};
use denoised_runtime::weights::write_safetensors;
use denoised_runtime::{CpuBackend, Tensor};

/// Resident growth over the loaded weights' bytes that the test allows: the weights
/// once, plus a quarter for the allocator and the load's transient buffers.
const MAX_RATIO: f64 = 1.25;
const DIR_VAR: &str = "DENOISED_TEST_LOAD_MEMORY_DIR";

/// Hidden 512 (8 heads of 64), 2 double and 4 single blocks: 35.7 M parameters.
fn config() -> FluxConfig {
    FluxConfig {
        patch_size: 1,
        in_channels: 64,
        out_channels: Some(64),
        num_layers: 2,
        num_single_layers: 4,
        attention_head_dim: 64,
        num_attention_heads: 8,
        joint_attention_dim: 512,
        pooled_projection_dim: 512,
        guidance_embeds: true,
        axes_dims_rope: vec![16, 24, 24],
    }
}

fn weight_bytes(c: &FluxConfig) -> u64 {
    let n: usize = param_specs(c)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    4 * n as u64
}

/// `dir/transformer/` (config.json and one f32 safetensors file, as diffusers writes
/// a small model) and `dir/lora.safetensors`: a rank-4 LoRA on every Linear, so that
/// merging it reads every weight from the pristine checkpoint again.
fn write_model(dir: &Path, c: &FluxConfig) {
    let t = dir.join("transformer");
    std::fs::create_dir(&t).unwrap();
    std::fs::write(t.join("config.json"), serde_json::to_string(c).unwrap()).unwrap();
    let src = Seeded { seed: 34 };
    let tensors: Vec<(String, Tensor)> = param_specs(c)
        .into_iter()
        .map(|(n, s)| {
            let v = src.get(&n, &s).unwrap();
            (n, v)
        })
        .collect();
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, v)| (n.as_str(), v)).collect();
    write_safetensors(t.join("diffusion_pytorch_model.safetensors"), &refs).unwrap();

    let r = 4;
    let mut lora: Vec<(String, Tensor)> = vec![];
    for site in Site::all(c) {
        let spec = site.spec(c);
        for (m, out) in spec.parts {
            let a = format!("transformer.{m}.lora_A.weight");
            let b = format!("transformer.{m}.lora_B.weight");
            lora.push((a.clone(), src.get(&a, &[r, spec.input]).unwrap()));
            lora.push((b.clone(), src.get(&b, &[out, r]).unwrap()));
        }
    }
    let refs: Vec<(&str, &Tensor)> = lora.iter().map(|(n, v)| (n.as_str(), v)).collect();
    write_safetensors(dir.join("lora.safetensors"), &refs).unwrap();
}

/// RssAnon + RssFile of this process, in bytes.
fn resident() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in /proc/self/status"))
    };
    1024 * (kb("RssAnon:") + kb("RssFile:"))
}

/// Returns the allocator's free memory to the system (glibc's `malloc_trim`).
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: glibc's malloc_trim only releases free memory; any thread may call it.
        unsafe {
            malloc_trim(0);
        }
    }
}

#[test]
fn loading_holds_the_weights_once() {
    let c = config();
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &c);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "measure_in_a_fresh_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(DIR_VAR, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the measuring process failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let figure = |key: &str| -> u64 {
        stdout
            .lines()
            .find_map(|l| l.split(key).nth(1))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no `{key}` in the measuring process's output: {stdout}"))
    };
    let weights = weight_bytes(&c) as f64;
    let mb = |b: f64| b / 1e6;
    for key in ["loaded:", "merged_and_unmerged:"] {
        let growth = figure(key) as f64;
        let ratio = growth / weights;
        eprintln!(
            "{key} resident growth {:.1} MB for {:.1} MB of weights = {ratio:.2}x",
            mb(growth),
            mb(weights)
        );
        assert!(
            ratio <= MAX_RATIO,
            "{key} the process grew by {:.1} MB for {:.1} MB of weights ({ratio:.2}x > {MAX_RATIO}x): \
             a second copy of the weights stays resident (the mapped checkpoint's pages?)",
            mb(growth),
            mb(weights)
        );
    }
}

/// The measuring half of [`loading_holds_the_weights_once`]: does nothing unless that
/// test runs it in its own process, where nothing else has touched memory.
#[test]
fn measure_in_a_fresh_process() {
    let Some(dir) = std::env::var_os(DIR_VAR) else {
        return;
    };
    let dir = Path::new(&dir);
    // The compute threads exist before the baseline, as in a worker.
    rayon::broadcast(|_| ());
    let before = resident();
    let m = FluxTransformer::load(CpuBackend::new(), dir.join("transformer")).unwrap();
    println!("loaded: {}", resident().saturating_sub(before));

    // A merged LoRA reads its sites from the pristine checkpoint, and unmerging reads
    // them again: neither may leave those pages resident either, and the restore is
    // bit for bit. Replacing every weight leaves free blocks inside the heap that the
    // allocator keeps; they are no copy of anything and are returned before this
    // reading (the load's figure above is taken as it is, as a worker's would be).
    let site = Site::Single(0, SingleLinear::QkvMlp);
    let loaded = m.site_weight(site).unwrap();
    let lora = LoraFile::open(dir.join("lora.safetensors"), &m.config).unwrap();
    assert_eq!(
        m.merge_loras(&[(&lora, 1.0)]).unwrap(),
        Site::all(&m.config).len()
    );
    assert_ne!(m.site_weight(site).unwrap().data(), loaded.data());
    m.unmerge().unwrap();
    assert_eq!(m.site_weight(site).unwrap().data(), loaded.data());
    drop((lora, loaded));
    trim_heap();
    println!("merged_and_unmerged: {}", resident().saturating_sub(before));
}
