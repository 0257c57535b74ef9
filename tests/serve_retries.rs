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
    // A client that times out and retries: the first request runs on, its retry gets
    // 409 while it does and then its reply, replayed (one job).
    let gone = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(30))
        .build()
        .unwrap()
        .post(format!("{}/v1/edits", d.url))
        .header("idempotency-key", "timed-out")
        .json(&body)
        .send();
    assert!(gone.is_err(), "the edit answered within 30 ms");
    let t0 = Instant::now();
    let (s, _, replayed, v) = loop {
        let r = post_keyed(&d, "/v1/edits", "timed-out", &body);
        if r.0 != 409 || t0.elapsed() > Duration::from_secs(30) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!((s, replayed), (200, true), "{}", v["error"]);
    assert_eq!(v["image"], v1["image"], "the same edit, replayed");
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

/// A webhook receiver on loopback: records each request (headers, body) and answers
/// the statuses of `answers` in turn (200 once they run out), closing each connection.
struct Receiver {
    port: u16,
    got: std::sync::Arc<std::sync::Mutex<Vec<(Instant, Vec<(String, String)>, String)>>>,
}

impl Receiver {
    fn start(answers: Vec<u16>) -> Receiver {
        use std::io::{BufRead, BufReader, Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let g = got.clone();
        std::thread::spawn(move || {
            let mut answers = answers.into_iter();
            for s in l.incoming().flatten() {
                let mut r = BufReader::new(s);
                let mut headers = Vec::new();
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                loop {
                    line.clear();
                    if r.read_line(&mut line).unwrap() == 0 || line.trim().is_empty() {
                        break;
                    }
                    let (k, v) = line.split_once(':').unwrap();
                    headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
                }
                let len: usize = headers
                    .iter()
                    .find(|(k, _)| k == "content-length")
                    .map_or(0, |(_, v)| v.parse().unwrap());
                let mut body = vec![0; len];
                r.read_exact(&mut body).unwrap();
                g.lock()
                    .unwrap()
                    .push((Instant::now(), headers, String::from_utf8(body).unwrap()));
                let status = answers.next().unwrap_or(200);
                let mut s = r.into_inner();
                let _ = write!(
                    s,
                    "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
            }
        });
        Receiver { port, got }
    }

    /// Waits until `n` requests came (or 30 s), then a little more for any extra.
    fn wait(&self, n: usize) -> Vec<(Instant, Vec<(String, String)>, String)> {
        let t0 = Instant::now();
        while self.got.lock().unwrap().len() < n && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(1500));
        self.got.lock().unwrap().clone()
    }
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> &'a str {
    h.iter()
        .find(|(k, _)| k == name)
        .map_or("", |(_, v)| v.as_str())
}

/// Standard Webhooks' check, written from the specification with the HMAC crate: the
/// signature is `v1,` and base64(HMAC-SHA256(secret, "{id}.{timestamp}.{body}")).
fn verify(secret: &[u8], h: &[(String, String)], body: &str) -> bool {
    use base64::Engine;
    use hmac::{KeyInit, Mac};
    let signed = format!(
        "{}.{}.{}",
        header(h, "webhook-id"),
        header(h, "webhook-timestamp"),
        body
    );
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
    mac.update(signed.as_bytes());
    let want = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    header(h, "webhook-signature")
        .split(' ')
        .any(|s| s == format!("v1,{want}"))
}

/// One signed delivery per job, verified with the secret; a receiver that fails twice
/// gets it on the third try (the same message id each time); a host off the allow-list
/// (or a webhook on a synchronous request) is refused when the job is submitted.
#[test]
fn webhooks_deliver_each_job_once_signed_and_retry_until_received() {
    use base64::Engine;
    let secret: Vec<u8> = (0u8..32)
        .map(|i| i.wrapping_mul(37).wrapping_add(11))
        .collect();
    let whsec = format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(&secret)
    );
    let cfg = format!("[webhooks]\nallowed_hosts = [\"127.0.0.1\"]\nsecret = \"{whsec}\"\n");
    let (_dir, d) = Daemon::with_config(&cfg);
    d.template("room", 4);
    let edit = |hook: &str, run_async: bool| {
        d.post(
            "/v1/edits",
            &json!({"template_id": "room", "mask": mask_b64(), "async": run_async,
                    "webhook": hook, "seed": 3}),
        )
    };

    let ok = Receiver::start(vec![]);
    let (s, v) = edit(&format!("http://127.0.0.1:{}/hook", ok.port), true);
    assert_eq!(s, 202, "{v}");
    let job = v["id"].as_str().unwrap().to_string();
    let got = ok.wait(1);
    assert_eq!(got.len(), 1, "one delivery per job");
    let (_, h, body) = &got[0];
    assert!(
        verify(&secret, h, body),
        "the signature does not verify: {h:?}"
    );
    assert!(!verify(b"another secret of 32 bytes......", h, body));
    assert_eq!(header(h, "webhook-id"), format!("msg_{job}"));
    let b: Value = serde_json::from_str(body).unwrap();
    assert_eq!(b["type"], "job.succeeded");
    assert_eq!(b["data"]["id"], job.as_str());
    assert!(b["data"]["result"]["image"].is_string(), "the job's result");

    let flaky = Receiver::start(vec![500, 503]);
    let (s, v) = edit(&format!("http://127.0.0.1:{}/hook", flaky.port), true);
    assert_eq!(s, 202, "{v}");
    let got = flaky.wait(3);
    assert_eq!(got.len(), 3, "two failures, then the delivery");
    let ids: Vec<&str> = got
        .iter()
        .map(|(_, h, _)| header(h, "webhook-id"))
        .collect();
    assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
    assert!(got.iter().all(|(_, h, b)| verify(&secret, h, b)));
    // Backoff: about 1 s, then 2 s.
    let gaps: Vec<f64> = got
        .windows(2)
        .map(|w| (w[1].0 - w[0].0).as_secs_f64())
        .collect();
    assert!(gaps[0] >= 0.9 && gaps[1] >= 1.9, "{gaps:?}");

    let (s, v) = edit("http://example.com/hook", true);
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("allowed_hosts"));
    let (s, v) = edit(&format!("http://127.0.0.1:{}/hook", ok.port), false);
    assert_eq!(s, 400, "{v}");
    assert_eq!(ok.got.lock().unwrap().len(), 1, "a refused job called back");
}
