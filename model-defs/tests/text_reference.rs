//! The FLUX.1 text side against transformers on the reference fixtures
//! (`tests/fixtures/cases/text_encoders.safetensors`): both tokenizers exactly, both
//! encoders within `strict_atol`, and the loaders' errors on broken directories.

use std::path::{Path, PathBuf};
use std::time::Instant;

use denoised_models::text::{
    ClipTextConfig, ClipTextModel, ClipTokenizer, T5Config, T5Encoder, T5Tokenizer,
};
use denoised_runtime::fixtures::{tiny_model_dir, RefCase, Tier};
use denoised_runtime::weights::{write_safetensors, SafetensorsFile};
use denoised_runtime::{Error, Tensor};

const CLIP_LEN: usize = 77;
const T5_LEN: usize = 32;

fn case() -> RefCase {
    RefCase::open("text_encoders").expect("text_encoders fixture")
}

fn prompts(c: &RefCase) -> Vec<String> {
    c.params["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}

fn ids(c: &RefCase, name: &str) -> Vec<i64> {
    c.file().tensor_i64(name).unwrap()
}

fn rows(flat: &[i64], len: usize) -> Vec<&[i64]> {
    flat.chunks_exact(len).collect()
}

#[test]
fn clip_tokenizer_matches_transformers() {
    let c = case();
    let tok = ClipTokenizer::from_dir(tiny_model_dir().join("tokenizer")).unwrap();
    assert_eq!(tok.max_len(), CLIP_LEN);
    let want_ids = ids(&c, "clip_input_ids");
    let want_mask = ids(&c, "clip_attention_mask");
    let lens = c.params["untruncated_lengths_incl_specials"]
        .as_array()
        .unwrap();
    for (i, p) in prompts(&c).iter().enumerate() {
        let got = tok.encode(p).unwrap();
        assert_eq!(
            got.ids,
            rows(&want_ids, CLIP_LEN)[i],
            "CLIP ids, prompt {i}: {p:?}"
        );
        assert_eq!(
            got.attention_mask,
            rows(&want_mask, CLIP_LEN)[i],
            "CLIP mask, prompt {i}"
        );
        let untrunc = lens[i]["clip_untruncated_len"].as_u64().unwrap() as usize;
        assert_eq!(got.untruncated_len, untrunc, "CLIP length, prompt {i}");
        assert_eq!(got.truncated(), untrunc > CLIP_LEN, "prompt {i}");
    }
    // The long prompt (217 tokens) is the one that is cut.
    assert!(tok.encode(&prompts(&c)[3]).unwrap().truncated());
}

#[test]
fn t5_tokenizer_matches_transformers() {
    let c = case();
    let tok = T5Tokenizer::from_dir(tiny_model_dir().join("tokenizer_2")).unwrap();
    let want_ids = ids(&c, "t5_input_ids");
    let want_mask = ids(&c, "t5_attention_mask");
    let lens = c.params["untruncated_lengths_incl_specials"]
        .as_array()
        .unwrap();
    for (i, p) in prompts(&c).iter().enumerate() {
        let got = tok.encode(p, T5_LEN).unwrap();
        assert_eq!(
            got.ids,
            rows(&want_ids, T5_LEN)[i],
            "T5 ids, prompt {i}: {p:?}"
        );
        assert_eq!(
            got.attention_mask,
            rows(&want_mask, T5_LEN)[i],
            "T5 mask, prompt {i}"
        );
        let untrunc = lens[i]["t5_untruncated_len"].as_u64().unwrap() as usize;
        assert_eq!(got.untruncated_len, untrunc, "T5 length, prompt {i}");
        assert_eq!(got.truncated(), untrunc > T5_LEN, "prompt {i}");
    }
    // Padding to the production length keeps the same prefix.
    let long = tok.encode(&prompts(&c)[2], 512).unwrap();
    assert_eq!(long.ids.len(), 512);
    assert_eq!(&long.ids[..T5_LEN], rows(&want_ids, T5_LEN)[2]);
    assert!(tok.encode("x", 0).is_err());
}

#[test]
fn clip_text_model_matches_transformers() {
    let c = case();
    let model = ClipTextModel::load(tiny_model_dir().join("text_encoder")).unwrap();
    let all_ids = ids(&c, "clip_input_ids");
    let d = model.config().hidden_size;
    let (mut hidden, mut pooled) = (Vec::new(), Vec::new());
    for row in rows(&all_ids, CLIP_LEN) {
        let (h, p) = model.forward(row).unwrap();
        assert_eq!(h.shape(), [CLIP_LEN, d]);
        hidden.extend_from_slice(h.data());
        pooled.extend_from_slice(&p);
    }
    let hidden = Tensor::new([4, CLIP_LEN, d], hidden).unwrap();
    let pooled = Tensor::new([4, d], pooled).unwrap();
    let dh = c.assert_close("clip_last_hidden_state", &hidden, Tier::Strict);
    let dp = c.assert_close("clip_pooled", &pooled, Tier::Strict);
    eprintln!(
        "clip_last_hidden_state max abs diff {dh:.2e} (strict {:.0e}); clip_pooled {dp:.2e} (strict {:.0e})",
        c.atol("clip_last_hidden_state", Tier::Strict),
        c.atol("clip_pooled", Tier::Strict)
    );
}

#[test]
fn t5_encoder_matches_transformers() {
    let c = case();
    let model = T5Encoder::load(tiny_model_dir().join("text_encoder_2")).unwrap();
    let all_ids = ids(&c, "t5_input_ids");
    let d = model.config().d_model;
    let mut hidden = Vec::new();
    for row in rows(&all_ids, T5_LEN) {
        let h = model.forward(row).unwrap();
        assert_eq!(h.shape(), [T5_LEN, d]);
        hidden.extend_from_slice(h.data());
    }
    let hidden = Tensor::new([4, T5_LEN, d], hidden).unwrap();
    let diff = c.assert_close("t5_last_hidden_state", &hidden, Tier::Strict);
    eprintln!(
        "t5_last_hidden_state max abs diff {diff:.2e} (strict {:.0e})",
        c.atol("t5_last_hidden_state", Tier::Strict)
    );
}

/// Prompt text to embeddings, the way the pipeline does it, with timings.
#[test]
fn encode_one_prompt_end_to_end() {
    let c = case();
    let dir = tiny_model_dir();
    let t0 = Instant::now();
    let clip_tok = ClipTokenizer::from_dir(dir.join("tokenizer")).unwrap();
    let t5_tok = T5Tokenizer::from_dir(dir.join("tokenizer_2")).unwrap();
    let clip = ClipTextModel::load(dir.join("text_encoder")).unwrap();
    let t5 = T5Encoder::load(dir.join("text_encoder_2")).unwrap();
    let load = t0.elapsed();

    let prompt = &prompts(&c)[2];
    let runs = 20;
    let t1 = Instant::now();
    let mut out = None;
    for _ in 0..runs {
        let ct = clip_tok.encode(prompt).unwrap();
        let tt = t5_tok.encode(prompt, T5_LEN).unwrap();
        let (_, pooled) = clip.forward(&ct.ids).unwrap();
        let embeds = t5.forward(&tt.ids).unwrap();
        out = Some((pooled, embeds));
    }
    let per = t1.elapsed() / runs;
    eprintln!("tiny text side: load {load:?}, encode one prompt {per:?}");

    let (pooled, embeds) = out.unwrap();
    let want = c.tensor("clip_pooled");
    let d = pooled.len();
    let row = Tensor::new([d], want.data()[2 * d..3 * d].to_vec()).unwrap();
    let got = Tensor::new([d], pooled).unwrap();
    assert!(got.max_abs_diff(&row).unwrap() <= c.atol("clip_pooled", Tier::Strict));
    let want = c.tensor("t5_last_hidden_state");
    let n = embeds.len();
    let row = Tensor::new(embeds.shape().to_vec(), want.data()[2 * n..3 * n].to_vec()).unwrap();
    assert!(embeds.max_abs_diff(&row).unwrap() <= c.atol("t5_last_hidden_state", Tier::Strict));
}

#[test]
fn text_side_is_shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ClipTokenizer>();
    send_sync::<T5Tokenizer>();
    send_sync::<ClipTextModel>();
    send_sync::<T5Encoder>();
}

#[test]
fn t5_relative_buckets_follow_transformers() {
    let c = T5Config::t5_v1_1_xxl();
    // (key - query, bucket) for 32 buckets / max distance 128, bidirectional.
    // Keys before the query use buckets 0..15, keys after it 16..31; distances
    // 0..7 are exact, then log-spaced: 8..11 -> 8, 16 -> 10, 32 -> 12, 64 -> 14.
    for (rel, bucket) in [
        (0, 0),
        (-1, 1),
        (1, 17),
        (-7, 7),
        (-8, 8),
        (-11, 8),
        (-12, 9),
        (-16, 10),
        (16, 26),
        (-32, 12),
        (-64, 14),
        (-127, 15),
        (-128, 15),
        (-5000, 15),
        (5000, 31),
    ] {
        assert_eq!(c.relative_bucket(rel), bucket, "distance {rel}");
    }
}

#[test]
fn seeded_models_run_and_are_deterministic() {
    let dir = tiny_model_dir();
    let ccfg = ClipTextConfig::from_file(dir.join("text_encoder/config.json")).unwrap();
    let tcfg = T5Config::from_file(dir.join("text_encoder_2/config.json")).unwrap();
    let a = ClipTextModel::seeded(ccfg.clone(), 7).unwrap();
    let b = ClipTextModel::seeded(ccfg, 7).unwrap();
    let ids = [1434i64, 5, 9, 1435, 1435];
    let (ha, pa) = a.forward(&ids).unwrap();
    let (hb, pb) = b.forward(&ids).unwrap();
    assert_eq!((ha.data(), &pa), (hb.data(), &pb));
    assert!(pa.iter().all(|v| v.is_finite()));
    // Pooled = the first <|endoftext|> (position 3), after the final norm.
    assert_eq!(&pa[..], ha.row(3));

    let t = T5Encoder::seeded(tcfg.clone(), 7).unwrap();
    let out = t.forward(&[4, 8, 1, 0, 0]).unwrap();
    assert_eq!(out.shape(), [5, tcfg.d_model]);
    assert_eq!(
        out,
        T5Encoder::seeded(tcfg, 7)
            .unwrap()
            .forward(&[4, 8, 1, 0, 0])
            .unwrap()
    );
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let dir = tiny_model_dir();
    let clip = ClipTextModel::load(dir.join("text_encoder")).unwrap();
    assert!(clip.forward(&[]).is_err());
    assert!(clip.forward(&vec![1435; 78]).is_err());
    let e = clip.forward(&[1434, 99_999, 1435]).unwrap_err().to_string();
    assert!(e.contains("99999"), "{e}");
    assert!(clip.forward(&[1434, -1, 1435]).is_err());
    let t5 = T5Encoder::load(dir.join("text_encoder_2")).unwrap();
    assert!(t5.forward(&[]).is_err());
    // The embedding has 512 rows (more than the tokenizer's 451): 511 is fine.
    assert!(t5.forward(&[511, 1]).is_ok());
    assert!(t5.forward(&[512, 1]).is_err());
}

// ---- loading errors on broken copies of the tiny model ----

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

/// Rewrites a safetensors file through `edit` (f32 tensors only, as the fixtures).
fn rewrite(path: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    let f = SafetensorsFile::open(path).unwrap();
    let mut names = f.names();
    names.sort();
    let mut ts: Vec<(String, Tensor)> = names
        .into_iter()
        .map(|n| {
            let t = f.tensor_f32(&n).unwrap();
            (n, t)
        })
        .collect();
    drop(f);
    edit(&mut ts);
    let refs: Vec<(&str, &Tensor)> = ts.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_safetensors(path, &refs).unwrap();
}

fn edit_config(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn tmp_copy(component: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(component);
    copy_dir(&tiny_model_dir().join(component), &dir);
    (tmp, dir)
}

#[test]
fn clip_missing_tensor_is_named() {
    let (_t, dir) = tmp_copy("text_encoder");
    let name = "text_model.encoder.layers.1.mlp.fc2.bias";
    rewrite(&dir.join("model.safetensors"), |ts| {
        ts.retain(|(n, _)| n != name)
    });
    let err = ClipTextModel::load(&dir).err().expect("must fail");
    assert!(
        matches!(&err, Error::MissingTensor { name: n, .. } if n == name),
        "{err}"
    );
    assert!(err.to_string().contains(name));
}

#[test]
fn clip_wrong_shape_is_named() {
    let (_t, dir) = tmp_copy("text_encoder");
    let name = "text_model.encoder.layers.0.self_attn.k_proj.weight";
    rewrite(&dir.join("model.safetensors"), |ts| {
        let t = ts.iter_mut().find(|(n, _)| n == name).unwrap();
        t.1 = Tensor::zeros([32, 31]);
    });
    let err = ClipTextModel::load(&dir).err().expect("must fail");
    assert!(
        matches!(&err, Error::ShapeMismatch { name: n, actual, .. } if n == name && actual == &[32, 31]),
        "{err}"
    );
}

#[test]
fn clip_extra_tensor_and_unprefixed_keys() {
    // An unexpected tensor (e.g. a CLIPTextModelWithProjection checkpoint) is rejected.
    let (_t, dir) = tmp_copy("text_encoder");
    rewrite(&dir.join("model.safetensors"), |ts| {
        ts.push(("text_projection.weight".into(), Tensor::zeros([32, 32])))
    });
    let err = ClipTextModel::load(&dir).err().expect("must fail");
    assert!(err.to_string().contains("text_projection.weight"), "{err}");

    // Keys without the legacy `text_model.` prefix (transformers 5 output) load too,
    // and so does the old `position_ids` buffer.
    let (_t2, dir2) = tmp_copy("text_encoder");
    rewrite(&dir2.join("model.safetensors"), |ts| {
        for (n, _) in ts.iter_mut() {
            *n = n.trim_start_matches("text_model.").to_string();
        }
        ts.push(("embeddings.position_ids".into(), Tensor::zeros([1, 77])));
    });
    let a = ClipTextModel::load(&dir2).unwrap();
    let b = ClipTextModel::load(tiny_model_dir().join("text_encoder")).unwrap();
    let ids = [1434i64, 20, 30, 1435];
    assert_eq!(a.forward(&ids).unwrap(), b.forward(&ids).unwrap());
}

#[test]
fn clip_bad_config_names_the_file() {
    let (_t, dir) = tmp_copy("text_encoder");
    let cfg = dir.join("config.json");
    edit_config(&cfg, |v| v["hidden_act"] = "gelu".into());
    let err = ClipTextModel::load(&dir).err().expect("must fail");
    assert!(
        matches!(&err, Error::BadConfig { path, .. } if path == &cfg),
        "{err}"
    );
    assert!(err.to_string().contains("hidden_act"), "{err}");

    edit_config(&cfg, |v| {
        v["hidden_act"] = "quick_gelu".into();
        v["num_attention_heads"] = 5.into();
    });
    let err = ClipTextModel::load(&dir)
        .err()
        .expect("must fail")
        .to_string();
    assert!(err.contains("divisible"), "{err}");

    std::fs::write(&cfg, "{ not json").unwrap();
    let err = ClipTextModel::load(&dir).err().expect("must fail");
    assert!(
        matches!(&err, Error::BadConfig { path, .. } if path == &cfg),
        "{err}"
    );
}

#[test]
fn t5_missing_and_misshapen_tensors_are_named() {
    // Missing from the shard and from the index: the loader asks for it by name.
    let (_t, dir) = tmp_copy("text_encoder_2");
    let name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";
    rewrite(&dir.join("model-00001-of-00002.safetensors"), |ts| {
        ts.retain(|(n, _)| n != name)
    });
    edit_config(&dir.join("model.safetensors.index.json"), |v| {
        v["weight_map"].as_object_mut().unwrap().remove(name);
    });
    let err = T5Encoder::load(&dir).err().expect("must fail");
    assert!(
        matches!(&err, Error::MissingTensor { name: n, .. } if n == name),
        "{err}"
    );

    // Wrong shape in the second shard.
    let (_t2, dir2) = tmp_copy("text_encoder_2");
    let name = "encoder.block.1.layer.1.DenseReluDense.wo.weight";
    rewrite(&dir2.join("model-00002-of-00002.safetensors"), |ts| {
        let t = ts.iter_mut().find(|(n, _)| n == name).unwrap();
        t.1 = Tensor::zeros([64, 32]);
    });
    let err = T5Encoder::load(&dir2).err().expect("must fail");
    assert!(
        matches!(&err, Error::ShapeMismatch { name: n, expected, .. } if n == name && expected == &[32, 64]),
        "{err}"
    );
}

#[test]
fn t5_bad_config_names_the_file() {
    let (_t, dir) = tmp_copy("text_encoder_2");
    let cfg = dir.join("config.json");
    edit_config(&cfg, |v| v["feed_forward_proj"] = "relu".into());
    let err = T5Encoder::load(&dir).err().expect("must fail");
    assert!(
        matches!(&err, Error::BadConfig { path, .. } if path == &cfg),
        "{err}"
    );
    assert!(err.to_string().contains("feed_forward_proj"), "{err}");

    edit_config(&cfg, |v| {
        v["feed_forward_proj"] = "gated-gelu".into();
        v["model_type"] = "umt5".into();
    });
    let err = T5Encoder::load(&dir).err().expect("must fail").to_string();
    assert!(err.contains("umt5"), "{err}");

    edit_config(&cfg, |v| {
        v["model_type"] = "t5".into();
        v.as_object_mut().unwrap().remove("d_model");
    });
    let err = T5Encoder::load(&dir).err().expect("must fail").to_string();
    assert!(
        err.contains("d_model") && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn tokenizer_files_missing_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let err = ClipTokenizer::from_dir(tmp.path())
        .err()
        .expect("must fail")
        .to_string();
    assert!(err.contains("vocab.json"), "{err}");
    let err = T5Tokenizer::from_dir(tmp.path())
        .err()
        .expect("must fail")
        .to_string();
    assert!(err.contains("tokenizer.json"), "{err}");

    let (_t, dir) = tmp_copy("tokenizer");
    std::fs::write(dir.join("merges.txt"), "#version: 0.2\nonlyonetoken\n").unwrap();
    let err = ClipTokenizer::from_dir(&dir)
        .err()
        .expect("must fail")
        .to_string();
    assert!(err.contains("merges"), "{err}");
}
