//! Requests that are retried and jobs that call back (docs/api.md, "Idempotent
//! retries"): the same POST sent twice with one `Idempotency-Key` starts one job, also
//! after the router was killed; the key with another body is a 409.

mod common;

use std::time::{Duration, Instant};

use common::*;
use reqwest::blocking::multipart::{Form, Part};
use serde_json::{json, Value};

/// POSTs `body` to `path` with `key`: (status, request id, replayed, JSON).
fn post_keyed(d: &Daemon, path: &str, key: &str, body: &Value) -> (u16, String, bool, Value) {
    let r = d
        .http
        .post(format!("{}{path}", d.url))
        .header("idempotency-key", key)
        .json(body)
        .send()
        .unwrap();
    let h = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (id, replayed) = (h("x-request-id"), h("idempotent-replayed") == "true");
    (r.status().as_u16(), id, replayed, r.json().unwrap())
}

fn until_ready(d: &Daemon) {
    let t0 = Instant::now();
    while d.get("/readyz").0 != 200 {
        assert!(t0.elapsed() < Duration::from_secs(60), "not ready again");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_same_post_with_one_idempotency_key_starts_one_job() {
    let d = Daemon::start(&[]);
    d.template("room", 4);
    let body = json!({"template_id": "room", "mask": mask_b64(), "prompt": "a cat", "seed": 5});

    // Synchronous: the second answer is the first, byte for byte, and no new job.
    let (s1, id1, r1, v1) = post_keyed(&d, "/v1/edits", "sync-1", &body);
    assert_eq!((s1, r1), (200, false), "{}", v1["error"]);
    let (s2, id2, r2, v2) = post_keyed(&d, "/v1/edits", "sync-1", &body);
    assert_eq!((s2, r2), (200, true));
    assert_eq!(id2, id1, "a second job was started");
    assert_eq!(v2, v1);
    // The same key with another body: 409, and nothing runs.
    let other = json!({"template_id": "room", "mask": mask_b64(), "prompt": "a cat", "seed": 6});
    let (s, id, _, v) = post_keyed(&d, "/v1/edits", "sync-1", &other);
    assert_eq!(s, 409, "{v}");
    assert!(id.is_empty(), "a job was started for a conflicting key");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("another request"));
    // Without a key, the same body is a new job.
    let (s, v) = d.post("/v1/edits", &body);
    assert_eq!(s, 200);
    assert_ne!(v["id"], v1["id"]);

    // Async: the same 202 and job, also after the router is killed -9.
    let mut asynchronous = body.clone();
    asynchronous["async"] = json!(true);
    let (s, job, _, v) = post_keyed(&d, "/v1/edits", "async-1", &asynchronous);
    assert_eq!(s, 202, "{v}");
    let (s, again, replayed, _) = post_keyed(&d, "/v1/edits", "async-1", &asynchronous);
    assert_eq!((s, again.as_str(), replayed), (202, job.as_str(), true));
    wait_job(&d, &job);
    let router = d.worker_pid("router");
    // SAFETY: plain kill(2) of a child of the daemon.
    unsafe { libc::kill(router as i32, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(200));
    until_ready(&d);
    assert_ne!(d.worker_pid("router"), router);
    let (s, after, replayed, v) = post_keyed(&d, "/v1/edits", "async-1", &asynchronous);
    assert_eq!((s, replayed), (202, true), "{v}");
    assert_eq!(after, job, "the key forgot its job with the router");
    let (s, _, _, _) = post_keyed(&d, "/v1/edits", "async-1", &body);
    assert_eq!(s, 409, "another body after the restart");

    // OpenAI's multipart route: each upload draws its own boundary, the parts decide.
    let form = || {
        Form::new()
            .part(
                "image",
                Part::bytes(std::fs::read(case("e2e_input.png")).unwrap()).file_name("a.png"),
            )
            .part("mask", Part::bytes(alpha_mask()).file_name("m.png"))
            .text("prompt", "x")
            .text("template_id", "room")
    };
    let send = || {
        let r = d
            .http
            .post(format!("{}/v1/images/edits", d.url))
            .header("idempotency-key", "openai-1")
            .multipart(form())
            .send()
            .unwrap();
        let id = r
            .headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_string());
        (r.status().as_u16(), id, r.text().unwrap())
    };
    let (s1, id1, t1) = send();
    let (s2, id2, t2) = send();
    assert_eq!((s1, s2), (200, 200), "{t1}");
    assert!(id1.is_some() && id1 == id2, "{id1:?} then {id2:?}");
    assert_eq!(t1, t2);
}

/// OpenAI's mask: the top-left quarter transparent (to edit).
fn alpha_mask() -> Vec<u8> {
    let m = image::RgbaImage::from_fn(64, 64, |x, y| {
        image::Rgba([0, 0, 0, if x < 32 && y < 32 { 0 } else { 255 }])
    });
    let mut v = Vec::new();
    m.write_to(&mut std::io::Cursor::new(&mut v), image::ImageFormat::Png)
        .unwrap();
    v
}
