//! `denoised profile` and `denoised bench step --cache-tier/--plan` as a user runs them:
//! the profile file is written and read back, its fits are reported, and bench step
//! prices its planner with it, timing the four runs of the loading benchmark.

use std::process::Command;

use denoised_models::profile::Profile;

fn try_denoised(args: &[&str]) -> Result<Vec<serde_json::Value>, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args(args)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect())
}

fn denoised(args: &[&str]) -> Vec<serde_json::Value> {
    try_denoised(args).unwrap_or_else(|e| panic!("denoised {args:?}: {e}"))
}

#[test]
fn profile_then_bench_step_from_the_disk_tier_with_every_plan() {
    // Under target/: a disk filesystem (the disk tier reads with O_DIRECT, which
    // tmpfs refuses).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("profile.json");
    let (p, d) = (path.to_str().unwrap(), dir.path().to_str().unwrap());
    let lines = denoised(&[
        "profile",
        "--device",
        "cpu",
        "--model",
        "flux-tiny",
        "--image-tokens",
        "256",
        "--text-tokens",
        "8",
        "--batch",
        "1,2",
        "--active",
        "0.25,0.5,1.0",
        "--iters",
        "1",
        "--load-mb",
        "1,2,4",
        "--output",
        p,
        "--disk-dir",
        d,
    ]);
    let r = &lines[0];
    println!("{r}");
    assert_eq!(r["points"], 6);
    for k in ["compute_r2", "load_host_r2", "load_disk_r2"] {
        let v = r[k].as_f64().unwrap();
        assert!(v.is_finite() && v <= 1.0, "{k} = {v}");
    }
    for k in [
        "held_out_measured_s",
        "held_out_predicted_s",
        "compute_gflops_per_s",
    ] {
        assert!(r[k].as_f64().unwrap() > 0.0, "{k}");
    }
    let profile = Profile::read(&path).unwrap();
    assert!(profile.fitted());
    assert_eq!(profile.model, "flux-tiny");
    assert_eq!(profile.compute.samples, 6);
    assert_eq!(profile.compute.r2, r["compute_r2"].as_f64().unwrap());

    let bench = |tier: &str| {
        let args = format!(
            "bench step --device cpu --config flux-tiny --image-tokens 256 --text-tokens 8 \
             --mask-ratio 0.25 --iters 2 --cache-tier {tier} --plan naive,pipelined,planner \
             --profile {p} --disk-dir {d}"
        );
        try_denoised(&args.split_whitespace().collect::<Vec<_>>())
    };
    let (tier, lines) = match bench("disk") {
        Ok(l) => ("disk", l),
        Err(e) if e.contains("does not allow O_DIRECT") => {
            println!("the disk tier is not timed here ({e}); timing the host tier instead");
            ("host", bench("host").unwrap())
        }
        Err(e) => panic!("bench step: {e}"),
    };
    let plans: Vec<&str> = lines
        .iter()
        .map(|l| l["plan"].as_str().unwrap_or("ideal"))
        .collect();
    assert_eq!(plans, ["ideal", "naive", "pipelined", "planner"]);
    for l in &lines[1..] {
        assert_eq!(l["cache_tier"], tier);
        assert!(l["bubble_s"].as_f64().unwrap() >= 0.0);
        assert!(l["ideal_median_s"].as_f64().unwrap() > 0.0);
    }
    // The naive run waits for its whole load; the planner's prediction is given.
    assert!(lines[1]["bubble_s"].as_f64().unwrap() > 0.0);
    assert!(lines[3]["predicted_s"].as_f64().unwrap() > 0.0);
    // Nothing is left behind in the disk directory but the profile.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "{left:?}");
}

#[test]
fn bad_profile_arguments_are_clear_errors() {
    for (args, says) in [
        (
            vec!["profile", "--device", "cpu", "--model", "no-such-model"],
            "neither a named config",
        ),
        (
            vec![
                "profile",
                "--device",
                "cpu",
                "--model",
                "flux-tiny",
                "--active",
                "1.5",
            ],
            "not in (0, 1]",
        ),
        (
            vec![
                "bench",
                "step",
                "--device",
                "cpu",
                "--config",
                "flux-tiny",
                "--cache-tier",
                "disk",
            ],
            "--mask-ratio below 1",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_denoised"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
}
