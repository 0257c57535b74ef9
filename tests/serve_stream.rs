//! Streaming over real HTTP: a job's events (`GET /v1/jobs/{id}/events`, and
//! `"stream": true` on the native routes) with previews, read as a client reads
//! Server-Sent Events, against the daemon on the built-in model.

mod common;

use std::time::{Duration, Instant};

use common::*;
use denoised_models::pipeline::image::{decode_image, ImageLimits};
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

/// A streamed template edit with previews every 2 of 6 steps: its status changes,
/// every step in order, previews after steps 2 and 4 (JPEGs of the image's shape), and
/// last `done` with the same image as the same edit not streamed.
#[test]
fn a_streamed_edit_sees_every_step_previews_and_the_same_result() {
    let d = Daemon::start(&[]);
    d.template("t", 6);
    let body = json!({"template_id": "t", "mask": mask_b64(), "prompt": "a cat", "seed": 2});
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["preview_every"] = json!(2);
    // The denoise worker fits its preview factors in the background after it starts
    // (2 s for the built-in VAE here): previews begin once they are ready.
    let t0 = Instant::now();
    loop {
        let r = client()
            .post(format!("{}/v1/edits", d.url))
            .json(&streamed)
            .send()
            .unwrap();
        if read_events(r, None).iter().any(|e| e.0 == "preview") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no previews after a minute"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    println!(
        "previews began {:.1} s after the template",
        t0.elapsed().as_secs_f64()
    );
    let r = client()
        .post(format!("{}/v1/edits", d.url))
        .json(&streamed)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    assert!(r.headers().contains_key("x-request-id"));
    let events = read_events(r, None);
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    println!("events: {names:?}");
    let steps: Vec<u64> = events
        .iter()
        .filter(|e| e.0 == "step")
        .map(|e| e.1["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6], "every step, in order");
    // Each preview right after its step.
    for (i, e) in events.iter().enumerate().filter(|(_, e)| e.0 == "preview") {
        let prev = &events[i - 1];
        assert_eq!(
            (prev.0.as_str(), &prev.1["step"]),
            ("step", &e.1["step"]),
            "{names:?}"
        );
    }
    assert!(events
        .iter()
        .filter(|e| e.0 == "step")
        .all(|e| e.1["steps"] == 6));
    let previews: Vec<&Value> = events
        .iter()
        .filter(|e| e.0 == "preview")
        .map(|e| &e.1)
        .collect();
    let at: Vec<u64> = previews
        .iter()
        .map(|p| p["step"].as_u64().unwrap())
        .collect();
    assert_eq!(at, [2, 4], "a preview every 2 steps, none after the last");
    let limits = ImageLimits {
        max_pixels: 1 << 22,
        multiple_of: 1,
    };
    let mut images = vec![];
    for p in &previews {
        assert_eq!(p["format"], "jpeg");
        let img = decode_image(&unb64(p["image"].as_str().unwrap()), &limits).unwrap();
        assert_eq!(img.width, img.height, "the square input's shape");
        images.push(img.data);
    }
    assert_ne!(
        images[0], images[1],
        "the preview changes as the image denoises"
    );
    let statuses: Vec<&str> = events
        .iter()
        .filter(|e| e.0 == "status")
        .map(|e| e.1["status"].as_str().unwrap())
        .collect();
    assert!(statuses.contains(&"denoising"), "{statuses:?}");
    let (last, done) = events.last().unwrap();
    assert_eq!(last, "done", "{names:?}");
    // The same edit, not streamed: the same image.
    let (s, plain) = d.post("/v1/edits", &body);
    assert_eq!(s, 200, "{plain}");
    assert_eq!(
        done["image"], plain["image"],
        "the streamed result is the plain one"
    );
    assert_eq!(
        (&done["width"], &done["height"]),
        (&plain["width"], &plain["height"])
    );
}

/// `GET /v1/jobs/{id}/events` of an async job, and a client that goes away mid-stream:
/// the job runs to its end, and the daemon's shared memory returns to where it was.
#[test]
fn a_client_that_leaves_a_stream_leaves_nothing_behind() {
    let d = Daemon::start_with_env(&[], &[("DENOISED_FAULT", "denoise:slow_step_ms=150")]);
    d.template("t", 8);
    let mut body = json!({"template_id": "t", "mask": mask_b64(), "seed": 4});
    assert_eq!(d.post("/v1/edits", &body).0, 200);
    // Releases are messages: the baseline is taken once they have settled.
    let baseline = d.shm_settled();
    body["async"] = json!(true);
    body["preview_every"] = json!(1);
    let (s, job) = d.post("/v1/edits", &body);
    assert_eq!(s, 202, "{job}");
    let id = job["id"].as_str().unwrap().to_string();
    let r = client()
        .get(format!("{}/v1/jobs/{id}/events", d.url))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = read_events(r, Some("step"));
    assert_eq!(seen.last().unwrap().0, "step", "{seen:?}");
    // The response is dropped here: the client is gone.
    let t0 = Instant::now();
    loop {
        let (_, v) = d.get(&format!("/v1/jobs/{id}"));
        if v["status"] == "succeeded" {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{v}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let t0 = Instant::now();
    while d.shm_live() != baseline {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "shared memory {:?}, baseline {baseline:?}",
            d.shm_live()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A stream of a job that has ended is its end at once.
    let r = client()
        .get(format!("{}/v1/jobs/{id}/events", d.url))
        .send()
        .unwrap();
    let events = read_events(r, None);
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(names, ["status", "done"], "{events:?}");
    assert!(
        events[1].1["image"].is_string(),
        "an async job keeps its image"
    );
    assert_eq!(
        client()
            .get(format!("{}/v1/jobs/job_ffffffffffffffff/events", d.url))
            .send()
            .unwrap()
            .status(),
        404
    );
}
