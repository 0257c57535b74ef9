//! The flow-match Euler schedule against diffusers' `retrieve_timesteps` for every
//! (steps, image_seq_len) pair of the fixtures: mu, sigmas and timesteps.

use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_runtime::fixtures::{tiny_model_dir, RefCase};

#[test]
fn schedules_match_diffusers_within_1e6() {
    let cfg = SchedulerConfig::from_file(tiny_model_dir().join("scheduler/scheduler_config.json"))
        .unwrap();
    assert_eq!(
        cfg,
        SchedulerConfig::default(),
        "the fixture config is Flux's default"
    );
    let case = RefCase::open("scheduler").unwrap();
    for (steps, seq) in [(4, 256), (28, 4096), (50, 4096), (8, 1024)] {
        let p = format!("steps{steps}_seq{seq}");
        let mu = case.file().tensor_f64(&format!("{p}.mu")).unwrap()[0];
        assert!(
            (cfg.mu(seq) - mu).abs() < 1e-12,
            "{p}: mu {} vs {mu}",
            cfg.mu(seq)
        );
        let s = FlowMatchEuler::new(&cfg, steps, seq).unwrap();
        let want_t = case.tensor(&format!("{p}.timesteps"));
        let want_s = case.tensor(&format!("{p}.sigmas"));
        assert_eq!(s.timesteps.len(), want_t.len());
        assert_eq!(s.sigmas.len(), want_s.len());
        for (a, b) in s.timesteps.iter().zip(want_t.data()) {
            assert!((a - b).abs() <= 1e-6, "{p}: timestep {a} vs {b}");
        }
        for (a, b) in s.sigmas.iter().zip(want_s.data()) {
            assert!((a - b).abs() <= 1e-6, "{p}: sigma {a} vs {b}");
        }
    }
}

#[test]
fn euler_step_matches_the_e2e_case() {
    // latents_{i+1} = latents_i + (sigma_{i+1} - sigma_i) * noise_pred_i, in float32.
    let case = RefCase::open("e2e").unwrap();
    let sig = case.tensor("sigmas").into_data();
    let s = FlowMatchEuler {
        timesteps: case.tensor("timesteps").into_data(),
        sigmas: sig,
    };
    let mut x = case.tensor("initial_latents").into_data();
    for i in 0..s.steps() {
        let v = case.tensor(&format!("step{i}.noise_pred"));
        s.step(i, &mut x, v.data());
        let want = case.tensor(&format!("step{i}.latents"));
        let worst = x
            .iter()
            .zip(want.data())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert_eq!(
            worst, 0.0,
            "step {i}: Euler update is not bit-exact ({worst})"
        );
    }
}
