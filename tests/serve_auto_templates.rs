//! Templates that make themselves (`[templates] auto`; docs/api.md): an uploaded image
//! edited again becomes a template, on the native and the OpenAI routes, and an edit of
//! it equals the same edit of the image registered by hand, bit for bit.

mod common;

use common::*;
use denoised_models::pipeline::image::{encode_png, Rgb8};
use serde_json::{json, Value};

const AUTO: &str = "[templates]\nauto = true\n";

fn auto_of(v: &Value) -> (String, bool, bool) {
    let a = &v["auto_template"];
    (
        a["id"]
            .as_str()
            .unwrap_or_else(|| panic!("no auto_template in {v}"))
            .into(),
        a["hit"].as_bool().unwrap(),
        a["captured"].as_bool().unwrap(),
    )
}

fn counted(d: &Daemon, outcome: &str) -> f64 {
    let label = format!("outcome=\"{outcome}\"");
    d.metrics()
        .lines()
        .filter(|l| l.starts_with("denoised_auto_templates_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn edit(d: &Daemon, image: &str, boxes: [u32; 4], prompt: &str, seed: u64) -> Value {
    let (s, v) = d.post(
        "/v1/edits",
        &json!({"image": image, "boxes": [boxes], "prompt": prompt, "seed": seed, "steps": 3}),
    );
    assert_eq!(s, 200, "{v}");
    v
}

/// The first edit of an image runs in full (a miss); the second captures it and reads
/// the template; the third reads it (a hit), only its masked tokens computed, and gives
/// what the same edit of the image registered by hand with the second edit's prompt,
/// steps and seed gives, bit for bit. Metrics count each outcome.
#[test]
fn an_image_edited_again_becomes_a_template() {
    let (_dir, d) = Daemon::with_config(AUTO);
    let image = image_b64();
    let first = edit(&d, &image, [0, 0, 24, 24], "a cat", 1);
    let (id, hit, captured) = auto_of(&first);
    assert!(id.starts_with("auto_"), "{first}");
    assert!(!hit && !captured, "{first}");
    assert_eq!(first["active_tokens"], first["tokens"], "{first}");
    assert!(first.get("template_version").is_none(), "{first}");

    let second = edit(&d, &image, [8, 8, 40, 40], "a dog", 2);
    assert_eq!(auto_of(&second), (id.clone(), false, true), "{second}");
    let third = edit(&d, &image, [32, 16, 56, 48], "a bird", 3);
    assert_eq!(auto_of(&third), (id.clone(), true, false), "{third}");
    for v in [&second, &third] {
        assert!(
            v["active_tokens"].as_u64() < v["tokens"].as_u64(),
            "not a template edit: {v}"
        );
        assert!(v["template_version"].as_u64().is_some(), "{v}");
    }
    let (s, listed) = d.get("/v1/templates");
    assert_eq!(s, 200);
    let ids: Vec<&str> = listed["templates"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["id"].as_str())
        .collect();
    assert_eq!(ids, [id.as_str()], "{listed}");

    // By hand: the capture parameters of the edit that captured it.
    let (s, v) = d.post(
        "/v1/templates",
        &json!({"image": image, "id": "hand", "prompt": "a dog", "steps": 3, "seed": 2}),
    );
    assert_eq!(s, 201, "{v}");
    let (s, by_hand) = d.post(
        "/v1/edits",
        &json!({"template_id": "hand", "boxes": [[32, 16, 56, 48]], "prompt": "a bird", "seed": 3}),
    );
    assert_eq!(s, 200, "{by_hand}");
    assert!(by_hand.get("auto_template").is_none(), "{by_hand}");
    assert_eq!(
        png(&edit_image(&third)).data,
        png(&edit_image(&by_hand)).data,
        "the auto template's edit differs from the registered one's"
    );
    assert_eq!(
        (
            counted(&d, "miss"),
            counted(&d, "captured"),
            counted(&d, "hit")
        ),
        (1.0, 1.0, 1.0)
    );
}

/// `n` distinct images, each a copy of the fixture with one pixel changed.
fn distinct_images(n: usize) -> Vec<String> {
    let base = png(&unb64(&image_b64()));
    (0..n)
        .map(|i| {
            let mut img = Rgb8 {
                width: base.width,
                height: base.height,
                data: base.data.clone(),
            };
            img.data[i * 3] ^= 0x55;
            b64(&encode_png(&img).unwrap())
        })
        .collect()
}

/// A flood of images edited once each captures nothing, and an image in steady use
/// stays a template through it (the sightings table, 4 entries here, forgets the
/// flood; the template tiers never see it).
#[test]
fn a_flood_of_one_off_images_does_not_evict_a_template_in_use() {
    let (_dir, d) = Daemon::with_config(&format!("{AUTO}auto_track = 4\n"));
    let image = image_b64();
    edit(&d, &image, [0, 0, 24, 24], "a cat", 1);
    let (id, _, captured) = auto_of(&edit(&d, &image, [8, 8, 40, 40], "a dog", 2));
    assert!(captured);
    for (i, other) in distinct_images(12).iter().enumerate() {
        let v = edit(&d, other, [0, 0, 24, 24], "a cat", i as u64);
        let (other_id, hit, captured) = auto_of(&v);
        assert!(!hit && !captured && other_id != id, "{v}");
        // Edits of the template between them: in steady use.
        if i % 4 == 3 {
            let v = edit(&d, &image, [16, 16, 40, 40], "a fox", i as u64);
            assert_eq!(auto_of(&v), (id.clone(), true, false), "{v}");
        }
    }
    let (_, listed) = d.get("/v1/templates");
    assert_eq!(listed["templates"].as_array().unwrap().len(), 1, "{listed}");
    let v = edit(&d, &image, [16, 16, 40, 40], "a fox", 99);
    assert_eq!(auto_of(&v), (id, true, false), "{v}");
}

/// On OpenAI's route (multipart, a separate mask file): one request is one sighting
/// whatever its `n`; the second request captures, the third reads the template.
#[test]
fn openai_edits_of_one_image_become_template_edits() {
    openai_sightings(AUTO);
}

/// Likewise on a FLUX.1 Kontext model (its masked edits; a template of it caches the
/// reference tokens too).
#[test]
fn openai_edits_on_a_kontext_model_become_template_edits() {
    let model = common::cli::fixtures().join("flux-kontext-tiny");
    let toml = format!("[model]\nsource = \"{}\"\n{AUTO}", model.display());
    openai_sightings(&toml);
}

fn openai_sightings(toml: &str) {
    let (_dir, d) = Daemon::with_config(toml);
    let image = unb64(&image_b64());
    // OpenAI's mask: transparent where to edit (the fixture mask's white).
    let luma = image::load_from_memory(&unb64(&mask_b64()))
        .unwrap()
        .to_luma8();
    let rgba = image::RgbaImage::from_fn(luma.width(), luma.height(), |x, y| {
        let edit = luma.get_pixel(x, y)[0] > 127;
        image::Rgba([0, 0, 0, if edit { 0 } else { 255 }])
    });
    let mut mask = Vec::new();
    rgba.write_to(
        &mut std::io::Cursor::new(&mut mask),
        image::ImageFormat::Png,
    )
    .unwrap();
    let send = |n: u32, seed: u64| -> Value {
        let form = reqwest::blocking::multipart::Form::new()
            .part(
                "image",
                reqwest::blocking::multipart::Part::bytes(image.clone()).file_name("i.png"),
            )
            .part(
                "mask",
                reqwest::blocking::multipart::Part::bytes(mask.clone()).file_name("m.png"),
            )
            .text("prompt", "a hat")
            .text("n", n.to_string())
            .text("seed", seed.to_string())
            .text("steps", "3");
        let r = d
            .http
            .post(format!("{}/v1/images/edits", d.url))
            .multipart(form)
            .send()
            .unwrap();
        let status = r.status();
        let v: Value = r.json().unwrap();
        assert_eq!(status, 200, "{v}");
        v
    };
    let one = send(2, 1);
    for img in one["data"].as_array().unwrap() {
        let (_, hit, captured) = auto_of(img);
        assert!(!hit && !captured, "{one}");
    }
    let two = send(1, 2);
    let (id, hit, captured) = auto_of(&two["data"][0]);
    assert!(!hit && captured, "{two}");
    let three = send(1, 3);
    assert_eq!(auto_of(&three["data"][0]), (id, true, false), "{three}");
}

/// On by default; `[templates] auto = false` turns it off (every edit of an upload a
/// full run, with no `auto_template` in its reply), and so does a request's
/// `use_auto_template: false` under the default.
#[test]
fn auto_templates_are_on_by_default_and_turn_off() {
    let image = image_b64();
    let d = Daemon::start(&[]);
    edit(&d, &image, [0, 0, 24, 24], "a cat", 1);
    let (s, v) = d.post(
        "/v1/edits",
        &json!({"image": image, "boxes": [[8, 8, 40, 40]], "prompt": "a dog", "seed": 2,
                "steps": 3, "use_auto_template": false}),
    );
    assert_eq!(s, 200, "{v}");
    assert!(v.get("auto_template").is_none(), "{v}");
    assert_eq!(v["active_tokens"], v["tokens"], "{v}");
    let second = edit(&d, &image, [8, 8, 40, 40], "a dog", 2);
    assert!(
        auto_of(&second).2,
        "the default captures the second sighting: {second}"
    );
    drop(d);

    let (_dir, off) = Daemon::with_config("[templates]\nauto = false\n");
    for seed in 1..=3 {
        let v = edit(&off, &image, [8, 8, 40, 40], "a dog", seed);
        assert!(v.get("auto_template").is_none(), "{v}");
        assert_eq!(v["active_tokens"], v["tokens"], "{v}");
    }
}
