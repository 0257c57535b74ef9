//! The Flux transformer against diffusers' `FluxTransformer2DModel` on the reference
//! fixtures: every case's output and, for case 1, every recorded intermediate.
//!
//! Tolerances are the fixtures' own (`cases.json`). The sinusoid frequencies here are
//! correctly rounded while torch's float32 `exp` is 1 ulp off for 3 of 128, so values
//! downstream of the timestep/guidance embedding use `suggested_atol`; values before it
//! use `strict_atol` (see tests/fixtures/REFERENCE.md, "Precision trap").

use std::collections::HashMap;

use denoised_models::flux::model::{FluxInputs, ForwardObserver, NoObserver};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase, Tier};
use denoised_runtime::{CpuBackend, Tensor};

fn model() -> FluxTransformer<CpuBackend> {
    FluxTransformer::load(CpuBackend::new(), tiny_model_dir().join("transformer"))
        .expect("load tiny model")
}

fn inputs(case: &RefCase) -> FluxInputs {
    FluxInputs::from_file(case.file()).unwrap()
}

#[test]
fn every_case_output_matches_diffusers() {
    let m = model();
    for key in [
        "transformer_case1",
        "transformer_case2",
        "transformer_case3",
        "transformer_case4_generic_ids",
    ] {
        let case = RefCase::open(key).unwrap();
        let out = m.forward_inputs(&inputs(&case), &mut NoObserver).unwrap();
        let diff = case.assert_close("output", &out, Tier::Suggested);
        println!(
            "{key}: output max abs diff {diff:.2e} (atol {:.1e})",
            case.atol("output", Tier::Suggested)
        );
    }
}

#[derive(Default)]
struct Recorder(HashMap<String, Tensor>);
impl<T> ForwardObserver<T> for Recorder {
    fn wants_hidden(&self) -> bool {
        true
    }
    fn hidden(&mut self, name: &str, t: Tensor) {
        self.0.insert(name.to_string(), t);
    }
}

#[test]
fn case1_intermediates_match_diffusers() {
    let m = model();
    let case = RefCase::open("transformer_case1").unwrap();
    let mut rec = Recorder::default();
    m.forward_inputs(&inputs(&case), &mut rec).unwrap();
    let strict = ["x_embedder", "context_embedder"];
    let mut names: Vec<String> = vec![
        "timestep_proj".into(),
        "guidance_proj".into(),
        "temb".into(),
        "norm_out".into(),
    ];
    names.extend(strict.iter().map(|s| s.to_string()));
    for b in 0..2 {
        for s in [
            "encoder_hidden_states",
            "hidden_states",
            "attn.hidden_states",
            "attn.encoder_hidden_states",
            "ff",
            "ff_context",
        ] {
            if b == 0 || !s.contains('.') && !s.starts_with("ff") {
                names.push(format!("double_block.{b}.{s}"));
            }
        }
    }
    for b in 0..3 {
        names.push(format!("single_block.{b}.encoder_hidden_states"));
        names.push(format!("single_block.{b}.hidden_states"));
    }
    names.push("single_block.0.attn".into());
    names.push("single_block.0.proj_mlp".into());
    for n in &names {
        let got = rec
            .0
            .get(n)
            .unwrap_or_else(|| panic!("forward did not report `{n}`"));
        let tier = if strict.contains(&n.as_str()) {
            Tier::Strict
        } else {
            Tier::Suggested
        };
        let diff = case.assert_close(&format!("intermediate.{n}"), got, tier);
        println!("{n}: {diff:.2e}");
    }
}

#[test]
fn rope_tables_match_diffusers() {
    let case = RefCase::open("transformer_case1").unwrap();
    let mut ids = case.tensor("txt_ids").into_data();
    ids.extend(case.tensor("img_ids").into_data());
    let (cos, sin) = denoised_models::flux::embed::rope_tables(&ids, &[4, 6, 6]);
    let n = ids.len() / 3;
    case.assert_close(
        "rope.cos",
        &Tensor::new([n, 16], cos).unwrap(),
        Tier::Strict,
    );
    case.assert_close(
        "rope.sin",
        &Tensor::new([n, 16], sin).unwrap(),
        Tier::Strict,
    );
}

#[test]
fn sinusoid_frequencies_are_within_an_ulp_of_torch() {
    let case = RefCase::open("transformer_case1").unwrap();
    let torch = case.tensor("time_proj_freqs");
    let ours = denoised_models::flux::embed::time_proj_freqs();
    for (a, b) in ours.iter().zip(torch.data()) {
        let ulps = (a.to_bits() as i64 - b.to_bits() as i64).abs();
        assert!(ulps <= 1, "{a} vs {b}");
    }
}

#[test]
fn with_torch_sinusoid_frequencies_outputs_meet_strict_tolerance() {
    let mut m = model();
    let case1 = RefCase::open("transformer_case1").unwrap();
    m.set_time_proj_freqs(case1.tensor("time_proj_freqs").into_data())
        .unwrap();
    for key in [
        "transformer_case1",
        "transformer_case2",
        "transformer_case3",
        "transformer_case4_generic_ids",
    ] {
        let case = RefCase::open(key).unwrap();
        let out = m.forward_inputs(&inputs(&case), &mut NoObserver).unwrap();
        let diff = case.assert_close("output", &out, Tier::Strict);
        println!("{key}: strict output max abs diff {diff:.2e}");
    }
}
