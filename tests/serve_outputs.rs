//! How images come back (docs/api.md, "Output formats"): PNG, JPEG or WebP, on the
//! native routes (`format`, `Accept`) and OpenAI's (`output_format`), a JPEG's or
//! WebP's quality set by `output_compression`; and OpenAI's `response_format: "url"`,
//! served at `GET /v1/images/{id}` behind the API's token until it expires.

mod common;

use std::time::Duration;

use common::*;
use image::{Rgba, RgbaImage};
use reqwest::blocking::multipart::{Form, Part};
use serde_json::{json, Value};

/// A decoded reply's size: JPEG by `image`, WebP by libwebp (the format's own).
fn decoded_size(bytes: &[u8], mime: &str) -> (u32, u32) {
    match mime {
        "image/webp" => {
            let img = webp::Decoder::new(bytes).decode().expect("not a WebP file");
            (img.width(), img.height())
        }
        "image/jpeg" => {
            let img = image::load_from_memory_with_format(bytes, image::ImageFormat::Jpeg)
                .expect("not a JPEG file");
            (img.width(), img.height())
        }
        other => panic!("unexpected {other}"),
    }
}

/// JPEG and WebP replies are valid files of their type, smaller at a lower
/// `output_compression`, by `Accept` and by `format`; a bad format or compression is a
/// 400.
#[test]
fn jpeg_and_webp_replies_are_valid_and_smaller_at_a_lower_compression() {
    let d = Daemon::start(&[]);
    d.template("room", 4);
    let edit = |format: &str, compression: u8| {
        let body = json!({"template_id": "room", "mask": mask_b64(), "prompt": "a cat",
                          "seed": 5, "format": format, "output_compression": compression});
        let r = d
            .http
            .post(format!("{}/v1/edits", d.url))
            .header("accept", "image/*")
            .json(&body)
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let mime = r.headers()["content-type"].to_str().unwrap().to_string();
        (mime, r.bytes().unwrap().to_vec())
    };
    for (format, mime) in [("jpeg", "image/jpeg"), ("webp", "image/webp")] {
        let (m_hi, hi) = edit(format, 95);
        let (m_lo, lo) = edit(format, 10);
        assert_eq!((m_hi.as_str(), m_lo.as_str()), (mime, mime));
        assert_eq!(decoded_size(&hi, mime), (64, 64));
        assert_eq!(decoded_size(&lo, mime), (64, 64));
        assert!(
            lo.len() < hi.len(),
            "{format}: {} bytes at 10, {} at 95",
            lo.len(),
            hi.len()
        );
        eprintln!("{format}: {} bytes at 95, {} at 10", hi.len(), lo.len());
    }
    // `Accept: image/webp` makes a WebP whatever `format` says.
    let r = d
        .http
        .post(format!("{}/v1/edits", d.url))
        .header("accept", "image/webp")
        .json(&json!({"template_id": "room", "mask": mask_b64(), "prompt": "a cat"}))
        .send()
        .unwrap();
    assert_eq!(r.headers()["content-type"], "image/webp");
    let webp = r.bytes().unwrap();
    assert_eq!(decoded_size(&webp, "image/webp"), (64, 64));
    // An async job's image from `GET /v1/jobs/{id}` with `Accept`: its own bytes.
    let (s, v) = d.post(
        "/v1/edits",
        &json!({"template_id": "room", "mask": mask_b64(), "format": "webp", "async": true}),
    );
    assert_eq!(s, 202, "{v}");
    let done = wait_job(&d, v["id"].as_str().unwrap());
    let r = d
        .http
        .get(format!("{}/v1/jobs/{}", d.url, v["id"].as_str().unwrap()))
        .header("accept", "image/*")
        .send()
        .unwrap();
    assert_eq!(r.headers()["content-type"], "image/webp");
    assert_eq!(
        r.bytes().unwrap().to_vec(),
        unb64(done["result"]["image"].as_str().unwrap()),
        "the job's binary reply is not its JSON result's image"
    );
    for bad in [
        json!({"template_id": "room", "mask": mask_b64(), "output_compression": 101}),
        json!({"template_id": "room", "mask": mask_b64(), "format": "gif"}),
    ] {
        let (s, v) = d.post("/v1/edits", &bad);
        assert_eq!(s, 400, "{v}");
    }
}

/// The OpenAI route's form with an alpha mask (its top-left quarter to edit).
fn openai_form(extra: &[(&str, &str)]) -> Form {
    let input = std::fs::read(case("e2e_input.png")).unwrap();
    let mask = RgbaImage::from_fn(64, 64, |x, y| {
        Rgba([0, 0, 0, if x < 32 && y < 32 { 0 } else { 255 }])
    });
    let mut m = Vec::new();
    mask.write_to(&mut std::io::Cursor::new(&mut m), image::ImageFormat::Png)
        .unwrap();
    let mut f = Form::new()
        .part("image", Part::bytes(input).file_name("image.png"))
        .part("mask", Part::bytes(m).file_name("mask.png"))
        .text("prompt", "a red ball")
        .text("steps", "2");
    for (k, v) in extra {
        f = f.text(k.to_string(), v.to_string());
    }
    f
}

/// `response_format: "url"` gives a URL of this daemon that serves the image with the
/// token, 401 without, and 404 once it has expired; `output_format` and
/// `output_compression` apply to OpenAI's routes too.
#[test]
fn url_replies_serve_the_image_with_the_token_and_expire() {
    let cfg = "[server]\napi_token = \"s3cret\"\nimage_url_ttl_seconds = 3\n";
    let (_dir, d) = Daemon::with_config(cfg);
    let auth = |r: reqwest::blocking::RequestBuilder| r.bearer_auth("s3cret");
    let post = |extra: &[(&str, &str)]| -> (u16, Value) {
        let r = auth(d.http.post(format!("{}/v1/images/edits", d.url)))
            .multipart(openai_form(extra))
            .send()
            .unwrap();
        (r.status().as_u16(), r.json().unwrap())
    };
    let (s, v) = post(&[("response_format", "url"), ("output_format", "jpeg")]);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["output_format"], "jpeg");
    let entry = &v["data"][0];
    assert!(entry.get("b64_json").is_none(), "{v}");
    let url = entry["url"].as_str().unwrap();
    assert!(
        url.starts_with(&format!("{}/v1/images/img_", d.url)),
        "{url} is not this daemon's"
    );
    let r = auth(d.http.get(url)).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["content-type"], "image/jpeg");
    assert_eq!(decoded_size(&r.bytes().unwrap(), "image/jpeg"), (64, 64));
    let r = d.http.get(url).send().unwrap();
    assert_eq!(r.status().as_u16(), 401, "served without the token");

    // WebP by OpenAI's fields, as base64.
    let (s, v) = post(&[("output_format", "webp"), ("output_compression", "40")]);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["output_format"], "webp");
    let bytes = unb64(v["data"][0]["b64_json"].as_str().unwrap());
    assert_eq!(decoded_size(&bytes, "image/webp"), (64, 64));
    let (s, v) = post(&[("response_format", "file")]);
    assert_eq!(s, 400, "{v}");

    std::thread::sleep(Duration::from_millis(3500));
    let r = auth(d.http.get(url)).send().unwrap();
    assert_eq!(r.status().as_u16(), 404, "kept past image_url_ttl_seconds");
}
