//! LoRA adapters through the real daemon (docs/design.md §Adapters): generations with
//! `loras` equal `denoised generate --lora ... --lora-mode unmerged` byte for byte, the
//! reply says when the set applied, `POST /v1/adapters` uploads (checked, immutable
//! names), bad names and files are refused with clear errors, the approximate cache
//! keeps adapted states apart, and a template captured with a LoRA serves only edits
//! with it.

mod common;

use std::process::Command;

use common::*;
use serde_json::{json, Value};

fn fixtures() -> std::path::PathBuf {
    case("..")
}

/// An adapters directory holding the fixture LoRA `style` (as diffusers saved it).
fn adapters_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("style")).unwrap();
    std::fs::copy(
        fixtures().join("loras/style/pytorch_lora_weights.safetensors"),
        d.path().join("style/pytorch_lora_weights.safetensors"),
    )
    .unwrap();
    d
}

fn generate(d: &Daemon, loras: Value, approx: &str) -> (u16, Value) {
    d.post(
        "/v1/generations",
        &json!({
            "prompt": "a red fox in the snow", "seed": 5, "steps": 6, "width": 64, "height": 64,
            "max_sequence_length": 32, "approx_cache": approx, "loras": loras,
        }),
    )
}

/// `denoised generate` of the requests above (`generate`'s prompt, seed, steps and size)
/// with `extra` flags: the PNG's pixels.
fn cli_generate(model: &str, extra: &[&str]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cli.png");
    let o = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args([
            "generate",
            "--model",
            model,
            "--prompt",
            "a red fox in the snow",
        ])
        .args([
            "--seed", "5", "--steps", "6", "--height", "64", "--width", "64",
        ])
        .args([
            "--max-sequence-length",
            "32",
            "--out",
            out.to_str().unwrap(),
        ])
        .args(extra)
        .env("DENOISED_LOG", "warn")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    png(&std::fs::read(&out).unwrap()).data
}

fn image(v: &Value) -> Vec<u8> {
    png(&unb64(v["image"].as_str().unwrap())).data
}

#[test]
fn generations_with_loras_equal_the_cli_and_uploads_are_checked() {
    let model = fixtures().join("flux-dev-tiny");
    let model = model.to_str().unwrap();
    let dir = adapters_dir();
    let ad = dir.path().to_str().unwrap();
    // K = 0: every LoRA applies before the first step (synchronous loading), so the
    // image is exactly the CLI's.
    let d = Daemon::start(&[
        "--model",
        model,
        "--adapters-dir",
        ad,
        "--lora-patch-by-step",
        "0",
    ]);
    let (s, v) = d.get("/v1/adapters");
    assert_eq!(
        (s, &v["data"]),
        (
            200,
            &json!([{"id": "style", "bytes": std::fs::metadata(dir.path().join("style/pytorch_lora_weights.safetensors")).unwrap().len()}])
        ),
        "{v}"
    );

    let (s, plain) = generate(&d, json!([]), "off");
    assert_eq!(s, 200, "{plain}");
    assert_eq!(plain["loras"], json!([]));
    let (s, v) = generate(&d, json!([{"id": "style", "scale": 0.8}]), "off");
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["loras"],
        json!([{"id": "style", "scale": 0.8, "applied_at_step": 0}])
    );
    assert_ne!(image(&v), image(&plain), "the LoRA changes the image");
    let style = format!("{}:0.8", dir.path().join("style").display());
    assert_eq!(
        cli_generate(model, &["--lora", &style, "--lora-mode", "unmerged"]),
        image(&v),
        "daemon = CLI"
    );

    // The approximate cache keeps the adapted model's states apart: an `exact` repeat
    // with the LoRA hits, the same prompt and seed without it does not.
    let lora = json!([{"id": "style", "scale": 0.8}]);
    let (_, miss) = generate(&d, lora.clone(), "exact");
    assert_eq!(miss["approx_cache"]["hit"], false);
    let (_, hit) = generate(&d, lora, "exact");
    assert_eq!(hit["approx_cache"]["hit"], true, "{}", hit["approx_cache"]);
    assert_eq!(image(&hit), image(&v));
    let (_, base) = generate(&d, json!([]), "exact");
    assert_eq!(
        base["approx_cache"]["hit"], false,
        "no state of the adapted model"
    );
    assert_eq!(image(&base), image(&plain));

    // True CFG (negative_prompt, true_cfg_scale > 1): the daemon's image is the CLI's,
    // and its approximate-cache states are kept apart from unguided ones.
    let cfg = |approx: &str| {
        d.post(
            "/v1/generations",
            &json!({
                "prompt": "a red fox in the snow", "seed": 5, "steps": 6, "width": 64,
                "height": 64, "max_sequence_length": 32, "approx_cache": approx,
                "negative_prompt": "blurry", "true_cfg_scale": 4.0,
            }),
        )
    };
    let (s, guided) = cfg("off");
    assert_eq!(s, 200, "{guided}");
    assert_eq!(guided["true_cfg"], json!({"scale": 4.0, "split": false}));
    assert_ne!(image(&guided), image(&plain));
    assert_eq!(
        cli_generate(
            model,
            &["--negative-prompt", "blurry", "--true-cfg-scale", "4"]
        ),
        image(&guided),
        "true CFG: daemon = CLI"
    );
    let (_, miss) = cfg("exact");
    assert_eq!(
        miss["approx_cache"]["hit"], false,
        "no state of the guided run yet"
    );
    let (_, hit) = cfg("exact");
    assert_eq!(hit["approx_cache"]["hit"], true);
    assert_eq!(image(&hit), image(&guided));
    let (s, v) = d.post(
        "/v1/generations",
        &json!({"prompt": "a", "steps": 2, "width": 64, "height": 64, "true_cfg_scale": "x"}),
    );
    assert_eq!(s, 400, "{v}");

    // Uploads: checked against the served transformer, then immutable.
    let detail =
        std::fs::read(fixtures().join("loras/detail/pytorch_lora_weights.safetensors")).unwrap();
    let (s, v) = d.post_raw("/v1/adapters?name=detail-2", detail.clone());
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        (v["id"].as_str(), v["rank"].as_u64(), v["modules"].as_u64()),
        (Some("detail-2"), Some(8), Some(25))
    );
    let (s, v) = d.post_raw("/v1/adapters?name=detail-2", detail);
    assert_eq!(s, 409, "{v}");
    let (s, v) = generate(
        &d,
        json!([{"id": "detail-2", "scale": 1.3}, {"id": "style"}]),
        "off",
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["loras"][1],
        json!({"id": "style", "scale": 1.0, "applied_at_step": 0})
    );
    let (s, v) = d.post_raw("/v1/adapters?name=junk", b"not a safetensors file".to_vec());
    assert_eq!(s, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("junk"), "{msg}");
    // The kohya, XLabs and BFL layouts upload (and serve) like PEFT files; a file of
    // other tensors is refused with its keys named.
    let kohya = std::fs::read(fixtures().join("loras/formats/kohya.safetensors")).unwrap();
    let (s, v) = d.post_raw("/v1/adapters?name=kohya", kohya);
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        (v["rank"].as_u64(), v["modules"].as_u64()),
        (Some(6), Some(46))
    );
    let (s, v) = generate(&d, json!([{"id": "kohya", "scale": 0.8}]), "off");
    assert_eq!(s, 200, "{v}");
    let not_lora = std::fs::read(fixtures().join("cases/lora_formats_dev.safetensors")).unwrap();
    let (s, v) = d.post_raw("/v1/adapters?name=latents", not_lora);
    assert_eq!(s, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("are not PEFT/diffusers LoRA factors") && msg.contains("`initial_latents`"),
        "{msg}"
    );
    // A LoRA whose shapes do not fit the served model: refused by key and shape, and the
    // daemon keeps serving.
    let misfit = {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("misfit.safetensors");
        let p = "transformer.transformer_blocks.0.attn.to_q";
        let (a, b) = (
            denoised_runtime::Tensor::zeros(vec![4, 999]),
            denoised_runtime::Tensor::zeros(vec![64, 4]),
        );
        denoised_runtime::weights::write_safetensors(
            &path,
            &[
                (&format!("{p}.lora_A.weight"), &a),
                (&format!("{p}.lora_B.weight"), &b),
            ],
        )
        .unwrap();
        std::fs::read(&path).unwrap()
    };
    let (s, v) = d.post_raw("/v1/adapters?name=misfit", misfit);
    assert_eq!(s, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("misfit") && msg.contains("999"), "{msg}");
    let (s, v) = generate(&d, json!([{"id": "kohya"}]), "off");
    assert_eq!(s, 200, "after the refused uploads: {v}");
    let (_, list) = d.get("/v1/adapters");
    let names: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["detail-2", "kohya", "style"],
        "a refused upload leaves nothing"
    );

    for (loras, want) in [
        (json!([{"id": "nope"}]), "no adapter `nope`"),
        (json!([{"id": "../style"}]), "adapter name"),
        (
            json!([{"id": "style", "scale": 1, "x": 2}]),
            "unknown field",
        ),
        (
            json!([{"id": "style"}, {"id": "style"}, {"id": "style"}, {"id": "style"}, {"id": "style"}]),
            "at most 4",
        ),
    ] {
        let (s, v) = generate(&d, loras.clone(), "off");
        assert_eq!(s, 400, "{loras}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(want), "{loras}: {msg}");
    }
    let (s, v) = d.post_raw("/v1/adapters?name=.hidden", vec![]);
    assert_eq!(s, 400, "{v}");
}

#[test]
fn a_template_captured_with_a_lora_serves_only_edits_with_it() {
    // The attention-only `detail` LoRA fits the built-in Fill model.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixtures().join("loras/detail/pytorch_lora_weights.safetensors"),
        dir.path().join("detail.safetensors"),
    )
    .unwrap();
    let d = Daemon::start(&["--adapters-dir", dir.path().to_str().unwrap()]);
    let lora = json!([{"id": "detail", "scale": 0.5}]);
    let (s, v) = d.post(
        "/v1/templates",
        &json!({"image": image_b64(), "id": "t", "steps": 3, "prompt": "a room", "loras": lora}),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        v["loras"],
        json!([{"name": "detail", "scale": 0.5, "patch_by": 0, "merged": false}])
    );
    let edit = |loras: Value| {
        d.post(
            "/v1/edits",
            &json!({"template_id": "t", "mask": mask_b64(), "prompt": "a mug", "loras": loras}),
        )
    };
    // Without `loras` it runs with the template's, from its first step.
    let (s, v) = edit(json!([]));
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["loras"],
        json!([{"id": "detail", "scale": 0.5, "applied_at_step": 0}])
    );
    let (s, same) = edit(lora);
    assert_eq!(s, 200, "{same}");
    assert_eq!(edit_image(&same), edit_image(&v));
    let (s, v) = edit(json!([{"id": "detail", "scale": 0.6}]));
    assert_eq!(s, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("was captured with LoRAs [detail*0.5]"),
        "{msg}"
    );
}

#[test]
fn a_daemon_with_a_merged_set_serves_that_adapted_model() {
    // `[adapters] merged`: every denoise worker merges `style` at 0.8 at start; the
    // image equals `denoised generate --lora style:0.8 --lora-mode merged` byte for
    // byte, with or without naming the set, and another set is refused.
    let dir = adapters_dir();
    let model = fixtures().join("flux-dev-tiny");
    let toml = format!(
        "[model]\nsource = {:?}\n[adapters]\ndir = {:?}\nmerged = [\"style:0.8\"]\n",
        model.to_str().unwrap(),
        dir.path().to_str().unwrap()
    );
    let (_cfg, d) = Daemon::with_config(&toml);
    let (s, named) = generate(&d, json!([{"id": "style", "scale": 0.8}]), "off");
    assert_eq!(s, 200, "{named}");
    assert_eq!(
        named["loras"],
        json!([{"id": "style", "scale": 0.8, "applied_at_step": 0}])
    );
    let (s, implicit) = generate(&d, json!([]), "off");
    assert_eq!(s, 200, "{implicit}");
    assert_eq!(
        implicit["loras"], named["loras"],
        "the merged set applies to every request"
    );
    assert_eq!(image(&implicit), image(&named));
    let style = format!("{}:0.8", dir.path().join("style").display());
    assert_eq!(
        cli_generate(
            model.to_str().unwrap(),
            &["--lora", &style, "--lora-mode", "merged"]
        ),
        image(&named),
        "daemon = CLI, merged"
    );
    let (s, v) = generate(&d, json!([{"id": "style", "scale": 0.5}]), "off");
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("merged into its weights"),
        "{v}"
    );
}

/// Two denoise workers with room: true CFG's branches run one on each, exchanging
/// velocities every step, and the image is the batched run's (the CLI's) within a
/// level (a forward of one request against one of two: the GEMMs' blocking differs;
/// the model-level comparison with diffusers and sequential execution is
/// model-defs/tests/cfg_reference.rs). With the LoRA the branches both run with it.
#[test]
fn true_cfg_splits_across_two_workers_with_room() {
    let model = fixtures().join("flux-dev-tiny");
    let model = model.to_str().unwrap();
    let dir = adapters_dir();
    let d = Daemon::start(&[
        "--model",
        model,
        "--denoise-workers",
        "2",
        "--adapters-dir",
        dir.path().to_str().unwrap(),
        "--lora-patch-by-step",
        "0",
    ]);
    for (loras, flags) in [
        (json!([]), vec![]),
        (json!([{"id": "style", "scale": 0.8}]), {
            let lora = dir.path().join("style");
            vec!["--lora".to_string(), format!("{}:0.8", lora.display())]
        }),
    ] {
        let (s, v) = d.post(
            "/v1/generations",
            &json!({
                "prompt": "a red fox in the snow", "seed": 5, "steps": 6, "width": 64,
                "height": 64, "max_sequence_length": 32, "approx_cache": "off",
                "negative_prompt": "blurry", "true_cfg_scale": 4.0, "loras": loras,
            }),
        );
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["true_cfg"], json!({"scale": 4.0, "split": true}), "{v}");
        let mut args = vec!["--negative-prompt", "blurry", "--true-cfg-scale", "4"];
        args.extend(flags.iter().map(String::as_str));
        if !flags.is_empty() {
            args.extend(["--lora-mode", "unmerged"]);
        }
        let cli = cli_generate(model, &args);
        let got = image(&v);
        let worst = got
            .iter()
            .zip(&cli)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        println!("split true CFG (loras {loras}): within {worst} levels of the batched CLI run");
        assert!(
            worst <= 1,
            "split true CFG: {worst} levels from the batched run"
        );
    }
}

/// A split generation whose workers die under it (each panics before its third step)
/// is retried and gives the image of an undisturbed split run.
#[test]
fn a_split_true_cfg_survives_its_workers_dying() {
    let model = fixtures().join("flux-dev-tiny");
    let model = model.to_str().unwrap();
    let body = json!({
        "prompt": "a red fox in the snow", "seed": 5, "steps": 6, "width": 64,
        "height": 64, "max_sequence_length": 32, "approx_cache": "off",
        "negative_prompt": "blurry", "true_cfg_scale": 4.0,
    });
    let args = ["--model", model, "--denoise-workers", "2"];
    let d = Daemon::start_with_env(&args, &[("DENOISED_FAULT", "denoise:panic_at_step=2")]);
    let (s, v) = d.post("/v1/generations", &body);
    assert_eq!(s, 200, "{v}");
    assert!(v["attempts"].as_u64().unwrap() >= 2, "{v}");
    drop(d);
    let d = Daemon::start(&args);
    let (s, clean) = d.post("/v1/generations", &body);
    assert_eq!(s, 200, "{clean}");
    assert_eq!(clean["true_cfg"]["split"], true, "{clean}");
    // The retry ran split again or batched (as the restarted workers had room): the
    // same image, or one within a level of it.
    let worst = image(&v)
        .iter()
        .zip(&image(&clean))
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .unwrap();
    println!(
        "retried after {} attempts ({}): within {worst} levels of the undisturbed run",
        v["attempts"], v["true_cfg"]
    );
    assert!(worst <= 1, "{worst} levels");
    if v["true_cfg"]["split"] == true {
        assert_eq!(worst, 0, "a split retry gives the split image");
    }
}

/// True CFG on edits (`negative_prompt`, `true_cfg_scale` > 1): a template edit's
/// negative branch computes its active tokens against the same template, batched in
/// its worker; an inline image's edit runs both branches over every token. Both equal
/// `denoised edit --negative-prompt ... --true-cfg-scale ...` byte for byte
/// (model-defs/tests/cfg_edit.rs checks the model's invariants).
#[test]
fn edits_with_true_cfg_equal_the_cli() {
    let model = fixtures().join("flux-fill-tiny");
    let d = Daemon::start(&["--model", model.to_str().unwrap()]);
    d.template("room", 4);
    let edit = |source: Value, extra: Value| {
        let mut body = json!({"mask": mask_b64(), "prompt": "a cat", "seed": 5, "steps": 4});
        for (k, v) in source
            .as_object()
            .unwrap()
            .iter()
            .chain(extra.as_object().unwrap())
        {
            body[k] = v.clone();
        }
        d.post("/v1/edits", &body)
    };
    let cfg = json!({"negative_prompt": "blurry", "true_cfg_scale": 4.0});
    let tpl = json!({"template_id": "room"});
    let (s, plain) = edit(tpl.clone(), json!({}));
    assert_eq!(s, 200, "{plain}");
    assert_eq!(plain["true_cfg"], Value::Null);
    let (s, v) = edit(tpl.clone(), cfg.clone());
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["true_cfg"], json!({"scale": 4.0, "split": false}));
    assert!(v["active_tokens"].as_u64().unwrap() < v["tokens"].as_u64().unwrap());
    assert_ne!(image(&v), image(&plain), "true CFG changes the edit");
    // A scale of 1 (or no negative prompt) is no true CFG.
    let (_, off) = edit(
        tpl.clone(),
        json!({"negative_prompt": "blurry", "true_cfg_scale": 1.0}),
    );
    assert_eq!(image(&off), image(&plain));
    assert_eq!(off["true_cfg"], Value::Null);

    let dir = tempfile::tempdir().unwrap();
    let tdir = dir.path().join("tpl");
    cli::capture_room(&model, &tdir);
    let args = |a: &[&str]| -> Vec<String> {
        a.iter()
            .chain(&["--negative-prompt", "blurry", "--true-cfg-scale", "4"])
            .map(|s| s.to_string())
            .collect()
    };
    let cli = cli::edit_cat(&model, &args(&["--template", cli::s(&tdir)]));
    assert!(
        image(&v) == cli,
        "template edit: the daemon differs from the CLI"
    );

    let (s, v) = edit(json!({"image": image_b64()}), cfg.clone());
    assert_eq!(s, 200, "{v}");
    let input = case("e2e_input.png");
    let cli = cli::edit_cat(&model, &args(&["--image", cli::s(&input), "--steps", "4"]));
    assert!(
        image(&v) == cli,
        "image edit: the daemon differs from the CLI"
    );

    let (s, v) = edit(tpl, json!({"true_cfg_scale": "x"}));
    assert_eq!(s, 400, "{v}");
}
