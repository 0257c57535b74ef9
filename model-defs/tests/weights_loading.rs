//! Loading diffusers transformer directories: whole and sharded files, bf16/f16
//! storage, and clear errors (never panics) for every kind of broken checkpoint.

use std::collections::BTreeMap;
use std::path::Path;

use denoised_models::flux::model::{FluxInputs, NoObserver};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase, Tier};
use denoised_runtime::weights::WeightStore;
use denoised_runtime::{CpuBackend, Tensor};
use safetensors::tensor::{Dtype, TensorView};

const STEM: &str = "diffusion_pytorch_model";

/// (dtype, shape, little-endian bytes) by tensor name.
type Raw = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn reference_tensors() -> Raw {
    let store = WeightStore::open(tiny_model_dir().join("transformer"), STEM).unwrap();
    let mut raw = Raw::new();
    for name in store.names() {
        let t = store.get(name, &shape_of(&store, name)).unwrap();
        raw.insert(
            name.to_string(),
            (
                Dtype::F32,
                t.shape().to_vec(),
                t.data().iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        );
    }
    raw
}

fn shape_of(store: &WeightStore, name: &str) -> Vec<usize> {
    // The store reports a mismatch with the actual shape; ask with an impossible
    // shape and read it back from the error.
    match store.get(name, &[usize::MAX]) {
        Err(denoised_runtime::Error::ShapeMismatch { actual, .. }) => actual,
        other => panic!("unexpected {other:?}"),
    }
}

fn write(path: &Path, tensors: &Raw) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (dt, s, b))| (n.clone(), TensorView::new(*dt, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Writes a model dir with the reference config and the given tensors in `shards` files.
fn model_dir(tensors: &Raw, shards: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        tiny_model_dir().join("transformer/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    if shards == 1 {
        write(&dir.path().join(format!("{STEM}.safetensors")), tensors);
    } else {
        let names: Vec<&String> = tensors.keys().collect();
        let per = names.len().div_ceil(shards);
        let mut map = serde_json::Map::new();
        for (i, chunk) in names.chunks(per).enumerate() {
            let file = format!("{STEM}-{:05}-of-{shards:05}.safetensors", i + 1);
            let part: Raw = chunk
                .iter()
                .map(|n| ((*n).clone(), tensors[*n].clone()))
                .collect();
            write(&dir.path().join(&file), &part);
            for n in chunk {
                map.insert((*n).clone(), serde_json::Value::String(file.clone()));
            }
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(
            dir.path().join(format!("{STEM}.safetensors.index.json")),
            index.to_string(),
        )
        .unwrap();
    }
    dir
}

fn case1_output(m: &FluxTransformer<CpuBackend>) -> Tensor {
    let case = RefCase::open("transformer_case1").unwrap();
    let x = FluxInputs::from_file(case.file()).unwrap();
    m.forward_inputs(&x, &mut NoObserver).unwrap()
}

fn load_err(dir: &Path) -> String {
    match FluxTransformer::load(CpuBackend::new(), dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn whole_and_resharded_copies_load_identically() {
    let raw = reference_tensors();
    let reference = case1_output(
        &FluxTransformer::load(CpuBackend::new(), tiny_model_dir().join("transformer")).unwrap(),
    );
    for shards in [1, 4, 7] {
        let dir = model_dir(&raw, shards);
        let m = FluxTransformer::load(CpuBackend::new(), dir.path()).unwrap();
        assert_eq!(case1_output(&m), reference, "{shards} shard(s)");
    }
}

#[test]
fn bf16_and_f16_checkpoints_load_and_stay_close() {
    let case = RefCase::open("transformer_case1").unwrap();
    let raw = reference_tensors();
    for dt in [Dtype::BF16, Dtype::F16] {
        let conv: Raw = raw
            .iter()
            .map(|(n, (_, s, b))| {
                let bytes = b
                    .chunks_exact(4)
                    .flat_map(|c| {
                        let v = f32::from_le_bytes(c.try_into().unwrap());
                        match dt {
                            Dtype::BF16 => half::bf16::from_f32(v).to_le_bytes(),
                            _ => half::f16::from_f32(v).to_le_bytes(),
                        }
                    })
                    .collect();
                (n.clone(), (dt, s.clone(), bytes))
            })
            .collect();
        let dir = model_dir(&conv, 2);
        let out = case1_output(&FluxTransformer::load(CpuBackend::new(), dir.path()).unwrap());
        let diff = out
            .max_abs_diff(&case.tensor("output").reshape(out.shape().to_vec()).unwrap())
            .unwrap();
        // Rounding weights to 8 (bf16) or 11 (f16) mantissa bits moves an output of
        // magnitude ~4.6 by a few percent at most; a wrong conversion moves it by O(1).
        let bound = if dt == Dtype::BF16 { 0.25 } else { 0.03 };
        assert!(diff < bound, "{dt:?}: max abs diff {diff}");
        assert!(
            diff > case.atol("output", Tier::Strict),
            "{dt:?}: rounding must be visible"
        );
    }
}

#[test]
fn missing_tensor_is_named() {
    let mut raw = reference_tensors();
    raw.remove("transformer_blocks.1.attn.to_k.weight");
    let dir = model_dir(&raw, 1);
    let e = load_err(dir.path());
    assert!(
        e.contains("transformer_blocks.1.attn.to_k.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_named_with_both_shapes() {
    let mut raw = reference_tensors();
    let (_, shape, bytes) = raw
        .get_mut("single_transformer_blocks.2.proj_mlp.weight")
        .unwrap();
    *shape = vec![shape[1], shape[0]];
    let _ = bytes;
    let dir = model_dir(&raw, 3);
    let e = load_err(dir.path());
    assert!(
        e.contains("single_transformer_blocks.2.proj_mlp.weight")
            && e.contains("[64, 256]")
            && e.contains("[256, 64]"),
        "{e}"
    );
}

#[test]
fn wrong_dtype_is_named() {
    let mut raw = reference_tensors();
    let (dt, _, _) = raw.get_mut("norm_out.linear.bias").unwrap();
    *dt = Dtype::I32;
    let dir = model_dir(&raw, 1);
    let e = load_err(dir.path());
    assert!(
        e.contains("norm_out.linear.bias") && e.contains("I32"),
        "{e}"
    );
}

#[test]
fn unexpected_tensor_is_reported() {
    let mut raw = reference_tensors();
    raw.insert(
        "transformer_blocks.9.attn.to_q.weight".into(),
        (Dtype::F32, vec![1], vec![0; 4]),
    );
    let dir = model_dir(&raw, 1);
    let e = load_err(dir.path());
    assert!(e.contains("transformer_blocks.9.attn.to_q.weight"), "{e}");
}

#[test]
fn truncated_file_names_file_and_tensor() {
    let raw = reference_tensors();
    for shards in [1, 3] {
        let dir = model_dir(&raw, shards);
        let victim = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .max()
            .unwrap();
        let len = std::fs::metadata(&victim).unwrap().len();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&victim)
            .unwrap();
        f.set_len(len - 1000).unwrap();
        let e = load_err(dir.path());
        let fname = victim.file_name().unwrap().to_string_lossy().to_string();
        assert!(
            e.contains("truncated") && e.contains(&fname) && e.contains("tensor `"),
            "{e}"
        );
    }
    // A file cut inside its header is also a clean error.
    let dir = model_dir(&raw, 1);
    let f = dir.path().join(format!("{STEM}.safetensors"));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(100)
        .unwrap();
    let e = load_err(dir.path());
    assert!(e.contains(&format!("{STEM}.safetensors")), "{e}");
}

#[test]
fn bad_config_is_named() {
    let raw = reference_tensors();
    let dir = model_dir(&raw, 1);
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, "{ \"in_channels\": 144, ").unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("config.json") && e.contains("bad config"), "{e}");

    let mut json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tiny_model_dir().join("transformer/config.json")).unwrap(),
    )
    .unwrap();
    json["axes_dims_rope"] = serde_json::json!([4, 6, 8]);
    std::fs::write(&cfg, json.to_string()).unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("config.json") && e.contains("axes_dims_rope"),
        "{e}"
    );

    // A config that disagrees with the weights: the shape check catches it.
    json["axes_dims_rope"] = serde_json::json!([4, 6, 6]);
    json["joint_attention_dim"] = serde_json::json!(48);
    std::fs::write(&cfg, json.to_string()).unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("context_embedder.weight") && e.contains("[64, 48]"),
        "{e}"
    );

    std::fs::remove_file(&cfg).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn missing_shard_is_named() {
    let raw = reference_tensors();
    let dir = model_dir(&raw, 3);
    std::fs::remove_file(
        dir.path()
            .join(format!("{STEM}-00002-of-00003.safetensors")),
    )
    .unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("00002-of-00003"), "{e}");
}
