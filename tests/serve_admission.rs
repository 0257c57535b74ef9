//! Admission holds on every route that starts work (issues 34, 47: template captures and
//! streamed edits too), against the real daemon
//! with `[server] max_queued_requests = 2`: a request of `n` images holds `n` slots
//! until its flows end, a client that disconnects keeps its slots until its flows end,
//! `n` above the limit is a 400, and `n` beyond the room left is a 429, not a hang.
//!
//! The flows are held, deterministically, by stopping the denoise worker (SIGSTOP):
//! every flow waits at its denoise stage, with its slot, until the test continues the
//! worker (SIGCONT; also when a test fails, so the daemon still stops). Whether a flow
//! has reached that stage is read from `denoised_routed_requests_total` (the router
//! counts each flow it sends to a denoise worker), so nothing here depends on timing:
//! only how soon a regression would show does.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const LIMIT: &str = "2";

/// A stopped worker process; continued when dropped.
struct Stopped(u32);

impl Stopped {
    fn denoise(d: &Daemon) -> Stopped {
        let pid = d.worker_pid("denoise");
        // SAFETY: plain kill(2) of a child of the daemon.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::kill(self.0 as i32, libc::SIGCONT) };
    }
}

/// The sum of a metric's series in the daemon's exposition.
fn metric(d: &Daemon, name: &str) -> f64 {
    d.metrics()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

fn routed(d: &Daemon) -> f64 {
    metric(d, "denoised_routed_requests_total")
}

fn in_flight(d: &Daemon) -> f64 {
    metric(d, "denoised_requests_in_flight")
}

/// Waits until `n` more flows than `before` have reached a denoise worker: they hold
/// their slots (a scrape takes the metrics deadline, 2 s, while the worker is stopped).
fn wait_routed(d: &Daemon, before: f64, n: f64) {
    let t0 = Instant::now();
    while routed(d) < before + n {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "{n} flows never reached the denoise worker (in flight: {})",
            in_flight(d)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until no flow holds a slot.
fn wait_idle(d: &Daemon) {
    let t0 = Instant::now();
    while in_flight(d) > 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(120), "slots never freed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the router has room for one more request, without starting any work: a
/// malformed body is refused with 400 once admitted, and with 429 when the router is
/// full. (It holds a slot for that instant: only probe while no request is arriving.)
fn probe(d: &Daemon) -> u16 {
    d.post_raw("/v1/edits", b"{".to_vec()).0
}

/// For a while after clients went away, the router stays full: the slots are their
/// flows', not their handlers'. (The window only bounds how soon a regression shows; a
/// correct router passes whatever the machine's speed, the flows being held.)
fn stays_full(d: &Daemon) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        assert_eq!(probe(d), 429, "a slot was freed while its flow still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        in_flight(d),
        2.0,
        "the flows of the gone clients hold their slots"
    );
    assert_eq!(probe(d), 429);
}

/// Sends a request on a connection of its own and returns the connection without
/// reading anything: dropping it disconnects the client mid-request.
fn send(d: &Daemon, path: &str, content_type: &str, body: &[u8]) -> TcpStream {
    let addr = d.url.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    s.flush().unwrap();
    s
}

fn disconnect(s: TcpStream) {
    let _ = s.shutdown(std::net::Shutdown::Both);
    drop(s);
}

fn generation(seed: u64) -> Value {
    json!({"prompt": "a red fox", "seed": seed, "steps": 2, "width": 32, "height": 32,
           "max_sequence_length": 16, "approx_cache": "off"})
}

fn images(n: u32) -> Value {
    json!({"prompt": "a red fox", "n": n, "steps": 2, "size": "32x32",
           "max_sequence_length": 16, "approx_cache": "off"})
}

/// Posts on another thread (a client waiting for its response).
fn post_in_background(
    d: &Daemon,
    path: &str,
    content_type: &'static str,
    body: Vec<u8>,
) -> std::thread::JoinHandle<(u16, Value)> {
    let (http, url) = (d.http.clone(), format!("{}{path}", d.url));
    std::thread::spawn(move || {
        let r = http
            .post(url)
            .header("content-type", content_type)
            .body(body)
            .send()
            .unwrap();
        (r.status().as_u16(), r.json().unwrap_or(Value::Null))
    })
}

/// A POST's status, its `Retry-After` header and its JSON body.
fn post_with_retry(d: &Daemon, path: &str, body: &Value) -> (u16, Option<String>, Value) {
    let r = d
        .http
        .post(format!("{}{path}", d.url))
        .json(body)
        .send()
        .unwrap();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (r.status().as_u16(), retry, r.json().unwrap_or(Value::Null))
}

#[test]
fn generations_hold_their_slots_until_their_flows_end() {
    let d = Daemon::start(&["--model", "builtin:t2i", "--max-queued-requests", LIMIT]);

    // An OpenAI request of two images holds both slots while it runs.
    let held = Stopped::denoise(&d);
    let r0 = routed(&d);
    let two = post_in_background(
        &d,
        "/v1/images/generations",
        "application/json",
        serde_json::to_vec(&images(2)).unwrap(),
    );
    wait_routed(&d, r0, 2.0);
    assert_eq!(in_flight(&d), 2.0, "n = 2 holds two slots");
    assert_eq!(probe(&d), 429);
    let (s, v) = d.post("/v1/generations", &generation(1));
    assert_eq!(s, 429, "{v}");
    let (s, retry, v) = post_with_retry(&d, "/v1/images/generations", &images(1));
    assert_eq!((s, retry.as_deref()), (429, Some("1")), "{v}");
    drop(held);
    let (s, v) = two.join().unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["data"].as_array().unwrap().len(), 2, "{v}");
    wait_idle(&d);

    // An async generation holds its slot until its flow ends; `n = 2` then has room
    // for one image only: 429 at once, not a wait.
    let held = Stopped::denoise(&d);
    let r0 = routed(&d);
    let mut body = generation(4);
    body["async"] = json!(true);
    let (s, v) = d.post("/v1/generations", &body);
    assert_eq!(s, 202, "{v}");
    let job = v["id"].as_str().unwrap().to_string();
    wait_routed(&d, r0, 1.0);
    assert_eq!(in_flight(&d), 1.0, "the async generation holds its slot");
    let (s, retry, v) = post_with_retry(&d, "/v1/images/generations", &images(2));
    assert_eq!((s, retry.as_deref()), (429, Some("1")), "{v}");
    assert_eq!(v["error"]["code"], "overloaded", "{v}");
    assert_eq!(in_flight(&d), 1.0, "the refused request released its slot");
    drop(held);
    assert_eq!(wait_job(&d, &job)["status"], "succeeded");
    wait_idle(&d);

    // Clients that disconnect mid-request (the native route and OpenAI's) keep their
    // slots until their flows end.
    let held = Stopped::denoise(&d);
    let r0 = routed(&d);
    let native = send(
        &d,
        "/v1/generations",
        "application/json",
        &serde_json::to_vec(&generation(2)).unwrap(),
    );
    let openai = send(
        &d,
        "/v1/images/generations",
        "application/json",
        &serde_json::to_vec(&images(1)).unwrap(),
    );
    wait_routed(&d, r0, 2.0);
    assert_eq!(probe(&d), 429);
    disconnect(native);
    disconnect(openai);
    stays_full(&d);
    drop(held);
    // The flows end, and their slots come back.
    wait_idle(&d);
    let (s, v) = d.post("/v1/generations", &generation(3));
    assert_eq!(s, 200, "{v}");

    // More images than the server ever runs at once: 400 with the reason, at once
    // (never admissible, so not a 429 to retry).
    let (s, v) = d.post("/v1/images/generations", &images(3));
    assert_eq!(s, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("max_queued_requests"), "{msg}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(in_flight(&d), 0.0, "a refused request holds no slot");
}

/// A multipart form: `(name, file name, bytes)`.
fn form(parts: &[(&str, Option<&str>, &[u8])]) -> (&'static str, Vec<u8>) {
    const BOUNDARY: &str = "denoised-admission-test";
    let mut b = Vec::new();
    for (name, file, data) in parts {
        write!(
            b,
            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\""
        )
        .unwrap();
        if let Some(f) = file {
            write!(b, "; filename=\"{f}\"\r\nContent-Type: image/png").unwrap();
        }
        b.extend_from_slice(b"\r\n\r\n");
        b.extend_from_slice(data);
        b.extend_from_slice(b"\r\n");
    }
    write!(b, "--{BOUNDARY}--\r\n").unwrap();
    ("multipart/form-data; boundary=denoised-admission-test", b)
}

#[test]
fn image_edits_hold_their_slots_until_their_flows_end() {
    let d = Daemon::start(&["--max-queued-requests", LIMIT]);
    let image = std::fs::read(case("e2e_input.png")).unwrap();
    let (w, h) = {
        let i = png(&image);
        (i.width as u32, i.height as u32)
    };
    // OpenAI's mask: the transparent pixels are the area to edit.
    let dir = tempfile::tempdir().unwrap();
    let mask_path = dir.path().join("mask.png");
    image::RgbaImage::from_fn(w, h, |x, y| {
        let edit = (16..40).contains(&x) && (20..44).contains(&y);
        image::Rgba([0, 0, 0, if edit { 0 } else { 255 }])
    })
    .save(&mask_path)
    .unwrap();
    let mask = std::fs::read(&mask_path).unwrap();
    // Full runs (no auto template): the flows reach the stopped worker at once, not
    // behind a capture of the image.
    let native_edit = json!({"image": image_b64(), "mask": mask_b64(), "steps": 2,
                             "max_sequence_length": 16, "use_auto_template": false});
    let edits = |n: &str| {
        form(&[
            ("image", Some("image.png"), &image),
            ("mask", Some("mask.png"), &mask),
            ("prompt", None, b"a red ball"),
            ("n", None, n.as_bytes()),
            ("steps", None, b"2"),
            ("max_sequence_length", None, b"16"),
            ("use_auto_template", None, b"false"),
        ])
    };

    // A request of two edits holds both slots while it runs.
    let held = Stopped::denoise(&d);
    let r0 = routed(&d);
    let (ct, body) = edits("2");
    let two = post_in_background(&d, "/v1/images/edits", ct, body);
    wait_routed(&d, r0, 2.0);
    assert_eq!(in_flight(&d), 2.0, "n = 2 holds two slots");
    assert_eq!(probe(&d), 429);
    let (s, v) = d.post("/v1/edits", &native_edit);
    assert_eq!(s, 429, "{v}");
    drop(held);
    let (s, v) = two.join().unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["data"].as_array().unwrap().len(), 2, "{v}");
    wait_idle(&d);

    // Clients that disconnect mid-request (OpenAI's route and the native one) keep
    // their slots until their flows end.
    let held = Stopped::denoise(&d);
    let r0 = routed(&d);
    let (ct, body) = edits("1");
    let openai = send(&d, "/v1/images/edits", ct, &body);
    let native = send(
        &d,
        "/v1/edits",
        "application/json",
        &serde_json::to_vec(&native_edit).unwrap(),
    );
    wait_routed(&d, r0, 2.0);
    assert_eq!(probe(&d), 429);
    disconnect(openai);
    disconnect(native);
    stays_full(&d);
    drop(held);
    wait_idle(&d);
    assert_eq!(probe(&d), 400, "the slots came back");

    // More images than the server ever runs at once: 400 with the reason.
    let (ct, body) = edits("3");
    let r = d
        .http
        .post(format!("{}/v1/images/edits", d.url))
        .header("content-type", ct)
        .body(body)
        .send()
        .unwrap();
    let s = r.status().as_u16();
    let v: Value = r.json().unwrap();
    assert_eq!(s, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("max_queued_requests"), "{msg}");
    assert_eq!(probe(&d), 400, "a refused request holds no slot");
}

/// A template capture (`POST /v1/templates`, async) and a streamed edit hold their slots
/// until their flows end: with both held at the denoise stage the router is full (429),
/// and once they finish their slots come back.
#[test]
fn template_captures_and_streamed_edits_hold_their_slots_until_their_flows_end() {
    let d = Daemon::start(&["--max-queued-requests", LIMIT]);
    d.template("room", 2);
    wait_idle(&d);

    let held = Stopped::denoise(&d);
    let r0 = routed(&d);
    let (s, v) = d.post(
        "/v1/templates",
        &json!({"image": image_b64(), "id": "hall", "steps": 2, "async": true}),
    );
    assert_eq!(s, 202, "{v}");
    let job = v["id"].as_str().unwrap().to_string();
    let mut streamed = json!({"template_id": "room", "prompt": "a cat", "mask": mask_b64()});
    streamed["stream"] = json!(true);
    let stream = post_in_background(
        &d,
        "/v1/edits",
        "application/json",
        serde_json::to_vec(&streamed).unwrap(),
    );
    wait_routed(&d, r0, 2.0);
    assert_eq!(
        in_flight(&d),
        2.0,
        "the capture and the streamed edit hold a slot each"
    );
    assert_eq!(probe(&d), 429);
    drop(held);
    let (s, _) = stream.join().unwrap();
    assert_eq!(s, 200);
    assert_eq!(wait_job(&d, &job)["status"], "succeeded");
    wait_idle(&d);
    let (s, v) = d.post("/v1/edits", &edit_body_of("hall"));
    assert_eq!(s, 200, "{v}");
}

fn edit_body_of(template: &str) -> Value {
    json!({"template_id": template, "prompt": "a cat", "mask": mask_b64()})
}
