//! A cluster of pods on this machine (docs/cluster.md): daemons of the built-in model on
//! 127.0.0.2, .3, .4 (and .5 for an intruder), each with its own shared-memory and cache
//! directories, so nothing passes between them except through the cluster. Each test
//! stops every daemon it starts (dropping a `Daemon` stops it and waits).

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const COOKIE: &str = "pods-of-a-test";

/// A pod: its directory (config, shared memory, cache, log) and its daemon.
struct Pod {
    name: String,
    ip: String,
    port: u16,
    dir: tempfile::TempDir,
    d: Option<Daemon>,
}

/// A free port on `ip` for a pod's cluster listener.
fn free_port(ip: &str) -> u16 {
    TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Pod {
    fn new(name: &str, ip: &str) -> Pod {
        Pod {
            name: name.into(),
            ip: ip.into(),
            port: free_port(ip),
            dir: tempfile::tempdir().unwrap(),
            d: None,
        }
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.ip, self.port)
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join(format!("{}.log", self.name))
    }

    /// Starts (or restarts) its daemon with these peers and cookie.
    fn start(&mut self, peers: &[String], cookie: &str) {
        self.start_with(peers, cookie, "");
    }

    /// [`Pod::start`] with more `[cluster]` keys.
    fn start_with(&mut self, peers: &[String], cookie: &str, more: &str) {
        let (dir, cache, shm) = (
            self.dir.path(),
            self.dir.path().join("cache"),
            self.dir.path().join("shm"),
        );
        std::fs::create_dir_all(&shm).unwrap();
        let config = dir.join("config.toml");
        std::fs::write(
            &config,
            format!(
                "[cluster]\npod = {:?}\nlisten = {:?}\npeers = {:?}\ncookie = {:?}\nshm_dir = {:?}\n{more}",
                self.name,
                self.addr(),
                peers,
                cookie,
                shm.to_str().unwrap()
            ),
        )
        .unwrap();
        self.d = Some(Daemon::start_at(
            &format!("{}:0", self.ip),
            &["--config", config.to_str().unwrap()],
            &[("DENOISED_CACHE_DIR", cache.to_str().unwrap())],
            &self.log(),
        ));
    }

    fn d(&self) -> &Daemon {
        self.d.as_ref().expect("the pod runs")
    }

    /// The peers its `/readyz` lists, with their state.
    fn peers(&self) -> Vec<(String, String, u64)> {
        let (_, v) = self.d().get("/readyz");
        v["pods"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|p| {
                        (
                            p["pod"].as_str().unwrap().to_string(),
                            p["state"].as_str().unwrap().to_string(),
                            p["templates"].as_u64().unwrap(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits until `/readyz` satisfies `ok`, up to `limit`; the seconds it took.
    fn wait_for(
        &self,
        what: &str,
        limit: Duration,
        ok: impl Fn(&[(String, String, u64)]) -> bool,
    ) -> f64 {
        let t0 = Instant::now();
        loop {
            let peers = self.peers();
            if ok(&peers) {
                return t0.elapsed().as_secs_f64();
            }
            assert!(
                t0.elapsed() < limit,
                "pod {}: {what} not within {limit:?}: {peers:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }
}

fn up(peers: &[(String, String, u64)], name: &str) -> bool {
    peers.iter().any(|p| p.0 == name && p.1 == "up")
}

fn edit_body(template: &str, seed: u64) -> Value {
    json!({"template_id": template, "prompt": "a cat", "seed": seed, "mask": mask_b64()})
}

fn png_part(path: PathBuf) -> reqwest::blocking::multipart::Part {
    reqwest::blocking::multipart::Part::bytes(std::fs::read(path).unwrap())
        .file_name("image.png")
        .mime_str("image/png")
        .unwrap()
}

/// OpenAI's mask for the 64x64 template: a transparent square to edit, the rest opaque.
fn transparent_mask_part() -> reqwest::blocking::multipart::Part {
    let mask = image::RgbaImage::from_fn(64, 64, |x, y| {
        let edit = (16..40).contains(&x) && (20..44).contains(&y);
        image::Rgba([0, 0, 0, if edit { 0 } else { 255 }])
    });
    let mut png = std::io::Cursor::new(Vec::new());
    mask.write_to(&mut png, image::ImageFormat::Png).unwrap();
    reqwest::blocking::multipart::Part::bytes(png.into_inner())
        .file_name("mask.png")
        .mime_str("image/png")
        .unwrap()
}

fn counter(metrics: &str, name: &str, labels: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l.contains(labels))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0.0, |v| v.parse().unwrap())
}

/// Three pods on 127.0.0.2-4, with these more `[cluster]` keys, each seeing the others.
fn start_three(more: &str) -> Vec<Pod> {
    let mut pods = vec![
        Pod::new("a", "127.0.0.2"),
        Pod::new("b", "127.0.0.3"),
        Pod::new("c", "127.0.0.4"),
    ];
    let all: Vec<String> = pods.iter().map(Pod::addr).collect();
    for p in &mut pods {
        p.start_with(&all, COOKIE, more);
    }
    for p in &pods {
        let others: Vec<String> = pods
            .iter()
            .filter(|o| o.name != p.name)
            .map(|o| o.name.clone())
            .collect();
        p.wait_for("its peers up", Duration::from_secs(20), |v| {
            others.iter().all(|o| up(v, o))
        });
    }
    pods
}

#[test]
fn an_edit_runs_on_the_pod_holding_its_template_and_the_cluster_survives_that_pods_loss() {
    let mut pods = start_three("");
    let (a, b, c) = (0, 1, 2);
    // Each pod counts its own workers only (ractor_cluster mirrors process groups to
    // every node it connects; each pod's live in a scope of its own).
    for p in &pods {
        let (_, v) = p.d().get("/readyz");
        for (group, n) in v["workers"].as_object().unwrap() {
            assert_eq!(n["live"], n["want"], "pod {}: {group}: {n}", p.name);
        }
    }
    pods[a].d().template("room", 4);
    pods[a].d().template("lobby", 4);
    pods[b].d().template("hall", 4);
    pods[c].wait_for("a's and b's templates", Duration::from_secs(10), |v| {
        v.iter().map(|p| p.2).sum::<u64>() == 3
    });
    // C keeps the templates' recipes (to capture them again if their pods are lost).
    wait_metric(&pods[c], "denoised_pod_recipes", 3.0);
    let (s, lobby_on_a) = pods[a].d().post("/v1/edits", &edit_body("lobby", 7));
    assert_eq!(s, 200, "{lobby_on_a}");

    // Sent to pod C, run on pod A (which holds the template), the same image as sent
    // to A directly.
    let (s, via_c) = pods[c].d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!(s, 200, "{via_c}");
    assert_eq!(via_c["pod"], "a", "{via_c}");
    let (s, on_a) = pods[a].d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!(s, 200, "{on_a}");
    assert_eq!(on_a["pod"], "a");
    assert_eq!(edit_image(&via_c), edit_image(&on_a), "forwarded != direct");
    // (Once C's view of A is idle again: a holder that looks busy loses to a copy of
    // this test's 1 MB template, which costs next to nothing.)
    wait_idle(&pods[c], "a");
    // The OpenAI route forwards alike, and says where it ran.
    let form = reqwest::blocking::multipart::Form::new()
        .text("template_id", "room")
        .text("prompt", "a cat")
        .text("seed", "5")
        .part("image", png_part(case("e2e_input.png")))
        .part("mask", transparent_mask_part());
    let r = pods[c]
        .d()
        .http
        .post(format!("{}/v1/images/edits", pods[c].d().url))
        .multipart(form)
        .send()
        .unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["data"][0]["pod"], "a", "{}", v["data"][0]["timings"]);
    // A forwarded edit's events come back as they happen: streamed through C, the
    // edit A runs shows every step, its status changes and previews (once A's denoise
    // worker has fitted its preview factors, 2 s after it started).
    let mut streamed = edit_body("room", 5);
    streamed["stream"] = json!(true);
    streamed["preview_every"] = json!(2);
    let t0 = Instant::now();
    let mut events_runs = 0;
    let events = loop {
        wait_idle(&pods[c], "a");
        events_runs += 1;
        let r = pods[c]
            .d()
            .http
            .post(format!("{}/v1/edits", pods[c].d().url))
            .json(&streamed)
            .send()
            .unwrap();
        let events = read_events(r, None);
        if events.iter().any(|e| e.0 == "preview") {
            break events;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no previews: {events:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    println!("a forwarded edit's events through c: {names:?}");
    let steps: Vec<u64> = events
        .iter()
        .filter(|e| e.0 == "step")
        .map(|e| e.1["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4], "every step, in order: {names:?}");
    let previews: Vec<u64> = events
        .iter()
        .filter(|e| e.0 == "preview")
        .map(|e| e.1["step"].as_u64().unwrap())
        .collect();
    assert_eq!(previews, [2], "{names:?}");
    assert!(
        events
            .iter()
            .any(|e| e.0 == "status" && e.1["status"] == "denoising"),
        "{names:?}"
    );
    let (last, done) = events.last().unwrap();
    assert_eq!((last.as_str(), &done["pod"]), ("done", &json!("a")));
    assert_eq!(edit_image(done), edit_image(&on_a), "the streamed result");
    // Cancelled where it arrived, a forwarded edit stops where it runs.
    pods[a].d().template("long", 40);
    pods[c].wait_for("a's long template", Duration::from_secs(10), |v| {
        v.iter().any(|p| p.0 == "a" && p.2 == 3)
    });
    wait_idle(&pods[c], "a");
    let (tx, rx) = std::sync::mpsc::channel();
    let url = pods[c].d().url.clone();
    let mut long = edit_body("long", 1);
    long["stream"] = json!(true);
    let stream = std::thread::spawn(move || {
        let r = reqwest::blocking::Client::new()
            .post(format!("{url}/v1/edits"))
            .json(&long)
            .send()
            .unwrap();
        tx.send(r.headers()["x-request-id"].to_str().unwrap().to_string())
            .unwrap();
        read_events(r, None)
    });
    let id = rx.recv().unwrap();
    let t0 = Instant::now();
    while pods[c].d().get(&format!("/v1/jobs/{id}")).1["step"].as_u64() < Some(1) {
        assert!(t0.elapsed() < Duration::from_secs(20), "no step relayed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (s, v) = pods[c].d().delete(&format!("/v1/jobs/{id}"));
    assert_eq!(s, 202, "{v}");
    let events = stream.join().unwrap();
    let steps = events.iter().filter(|e| e.0 == "step").count();
    let (last, end) = events.last().unwrap();
    println!("a forwarded edit cancelled after {steps} of 40 steps: {last} {end}");
    assert_eq!(last, "error", "{end}");
    assert_eq!(end["error"]["code"], "cancelled", "{end}");
    assert!(steps < 40, "{steps}");
    // A template no pod holds is a 404.
    let (s, v) = pods[c].d().post("/v1/edits", &edit_body("nowhere", 1));
    assert_eq!(s, 404, "{v}");
    let m = pods[c].d().metrics();
    assert_eq!(
        counter(&m, "denoised_pod_forwards_total", "pod=\"a\",result=\"ok\""),
        (2 + events_runs) as f64,
        "{m}"
    );
    assert_eq!(
        counter(
            &pods[a].d().metrics(),
            "denoised_pod_forwarded_in_total",
            ""
        ),
        // And the long one, cancelled.
        (3 + events_runs) as f64
    );

    // kill -9 of pod A's supervisor under a load of edits of both templates through C:
    // every request ends, and succeeds: hall's on B; room's on A, then, its only copy
    // lost with A, on a pod that copied it from A while A drained, or captured it
    // again from its recipe.
    let url = pods[c].d().url.clone();
    let load = std::thread::spawn(move || {
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let mut out = vec![];
        for i in 0..24u64 {
            let t = if i % 2 == 0 { "room" } else { "hall" };
            let t0 = Instant::now();
            let r = http
                .post(format!("{url}/v1/edits"))
                .json(&edit_body(t, i))
                .send()
                .expect("every request gets an answer");
            let status = r.status().as_u16();
            let v: Value = r.json().unwrap_or(Value::Null);
            let pod = v["pod"].as_str().unwrap_or("").to_string();
            out.push((t, status, pod, t0.elapsed().as_secs_f64()));
        }
        out
    });
    std::thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    let mut sup = pods[a].d.take().unwrap();
    sup.child.kill().unwrap();
    sup.child.wait().unwrap();
    let results = load.join().unwrap();
    println!("edits through c while a died: {results:?}");
    assert!(results.iter().all(|r| r.1 == 200), "{results:?}");
    assert!(
        results.iter().any(|r| r.0 == "room" && r.2 != "a"),
        "{results:?}"
    );
    let down = pods[c].wait_for("a down", Duration::from_secs(10), |v| !up(v, "a"));
    println!(
        "c marked a down {down:.1} s after the wait began ({:.1} s after the kill)",
        killed.elapsed().as_secs_f64()
    );
    assert!(killed.elapsed() < Duration::from_secs(10));
    let (s, v) = pods[c].d().post("/v1/edits", &edit_body("hall", 99));
    assert_eq!((s, v["pod"].as_str()), (200, Some("b")), "{v}");
    let (s, v) = pods[c].d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!(s, 200, "{v}");
    assert_ne!(v["pod"], "a");
    assert_eq!(edit_image(&v), edit_image(&on_a), "room's edit differs");
    // Lobby, on A alone and gone with it: captured again from its recipe, and its edit
    // is the one A served, bit for bit.
    let recaptures = || -> f64 {
        [b, c]
            .iter()
            .map(|&i| {
                let m = pods[i].d().metrics();
                counter(&m, "denoised_template_recaptures_total", "result=\"ok\"")
            })
            .sum()
    };
    let before = recaptures();
    let t0 = Instant::now();
    let (s, v) = pods[c].d().post("/v1/edits", &edit_body("lobby", 7));
    assert_eq!(s, 200, "{v}");
    println!(
        "lobby captured again and edited on {} in {:.1} s",
        v["pod"],
        t0.elapsed().as_secs_f64()
    );
    assert_ne!(v["pod"], "a");
    assert_eq!(
        edit_image(&v),
        edit_image(&lobby_on_a),
        "the recaptured edit differs"
    );
    assert_eq!(recaptures(), before + 1.0, "one pod captured lobby again");
    drop(sup);

    // Pod A restarts (its disk kept its template) and rejoins.
    let all: Vec<String> = pods.iter().map(Pod::addr).collect();
    pods[a].start(&all, COOKIE);
    let back = pods[c].wait_for("a back with its templates", Duration::from_secs(15), |v| {
        v.iter().any(|p| p.0 == "a" && p.1 == "up" && p.2 == 3)
    });
    println!("a rejoined {back:.1} s after it was ready");
    let (s, v) = pods[a].d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!((s, v["pod"].as_str()), (200, Some("a")), "{v}");
    assert_eq!(
        edit_image(&v),
        edit_image(&on_a),
        "the same edit after the restart"
    );
}

/// Waits until pod `p`'s last report of peer `name` shows nothing in flight.
fn wait_idle(p: &Pod, name: &str) {
    let t0 = Instant::now();
    loop {
        let (_, v) = p.d().get("/readyz");
        let peers = v["pods"].as_array().cloned().unwrap_or_default();
        if peers
            .iter()
            .any(|x| x["pod"] == name && x["in_flight"] == 0)
        {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{name} busy: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until pod `p`'s metric `name` reaches `min`.
fn wait_metric(p: &Pod, name: &str, min: f64) {
    let t0 = Instant::now();
    loop {
        let m = p.d().metrics();
        if counter(&m, name, "") >= min {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{}: {name} < {min}:\n{m}",
            p.name
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pod policies, live: round_robin takes turns over the pods (those lacking the
/// template copy it from its pod first); template_aware sends a burst of edits of
/// one pod's template to that pod until its queue costs more than a copy elsewhere.
/// Every edit, wherever it ran, is the same image.
#[test]
fn pods_take_turns_under_round_robin_and_share_a_busy_template_under_template_aware() {
    let pods = start_three("policy = \"round_robin\"\n");
    let (a, c) = (0, 2);
    pods[a].d().template("room", 4);
    pods[c].wait_for("a's template", Duration::from_secs(10), |v| {
        v.iter().any(|p| p.0 == "a" && p.2 == 1)
    });
    let (s, on_a) = pods[a].d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!(s, 200, "{on_a}");
    let mut ran = vec![];
    for _ in 0..3 {
        let (s, v) = pods[c].d().post("/v1/edits", &edit_body("room", 5));
        assert_eq!(s, 200, "{v}");
        assert_eq!(edit_image(&v), edit_image(&on_a), "{}", v["pod"]);
        ran.push(v["pod"].as_str().unwrap().to_string());
    }
    // In turn: this pod first, then its peers by name.
    assert_eq!(ran, ["c", "a", "b"]);
    for p in [&pods[1], &pods[2]] {
        let m = p.d().metrics();
        let copies = counter(
            &m,
            "denoised_pod_transfers_total",
            "pod=\"a\",result=\"ok\"",
        );
        assert_eq!(copies, 1.0, "{}: {m}", p.name);
    }
    let m = pods[c].d().metrics();
    for pod in ["a", "b", "c"] {
        let label = format!("policy=\"round_robin\",pod=\"{pod}\"");
        assert_eq!(counter(&m, "denoised_pod_routes_total", &label), 1.0, "{m}");
    }
    // Deleted on A, the template goes from every pod, copies and recipes: an edit of
    // it is a 404 again, and stays one.
    let (s, v) = pods[a].d().delete("/v1/templates/room");
    assert_eq!(s, 200, "{v}");
    let t0 = Instant::now();
    while !holders(&pods, "room").is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{:?}",
            holders(&pods, "room")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(3));
    let (s, v) = pods[c].d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!(s, 404, "{v}");
    assert_eq!(
        counter(&pods[c].d().metrics(), "denoised_pod_recipes", ""),
        0.0
    );
    drop(pods);

    // template_aware (the default): an idle holder takes the edit; a burst spreads.
    let pods = start_three("");
    pods[a].d().template("room", 4);
    pods[c].wait_for("a's template", Duration::from_secs(10), |v| {
        v.iter().any(|p| p.0 == "a" && p.2 == 1)
    });
    let (s, v) = pods[c].d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!((s, v["pod"].as_str()), (200, Some("a")), "{v}");
    let url = pods[c].d().url.clone();
    let burst: Vec<_> = (0..9)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || {
                let http = reqwest::blocking::Client::builder()
                    .timeout(Duration::from_secs(60))
                    .build()
                    .unwrap();
                let r = http
                    .post(format!("{url}/v1/edits"))
                    .json(&edit_body("room", 5))
                    .send()
                    .unwrap();
                (r.status().as_u16(), r.json::<Value>().unwrap())
            })
        })
        .collect();
    let mut ran = std::collections::BTreeMap::new();
    for t in burst {
        let (s, v) = t.join().unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(edit_image(&v), edit_image(&on_a), "{}", v["pod"]);
        *ran.entry(v["pod"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    println!("a burst of 9 edits of a's template through c ran on {ran:?}");
    assert!(ran.len() >= 2 && ran.contains_key("a"), "{ran:?}");
}

#[test]
fn a_pod_with_another_cookie_is_refused() {
    let mut a = Pod::new("a", "127.0.0.2");
    let mut d = Pod::new("d", "127.0.0.5");
    a.start(&[a.addr(), d.addr()], COOKIE);
    d.start(&[a.addr()], "not-the-cluster-cookie");
    std::thread::sleep(Duration::from_secs(4));
    assert!(a.peers().iter().all(|p| p.0 != "d"), "{:?}", a.peers());
    assert!(d.peers().is_empty(), "{:?}", d.peers());
    let said = |p: &Pod, needle: &str| {
        let t0 = Instant::now();
        while !p.log_text().contains(needle) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{}: no {needle:?} in:\n{}",
                p.name,
                p.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    said(&a, "refused the peer at");
    said(&d, "refused this pod");
}

fn openssl(dir: &Path, args: &[&str]) {
    let s = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl (Debian's package) makes the test's certificates");
    assert!(s.success(), "openssl {args:?}");
}

/// A certificate authority `NAME.crt`/`NAME.key` in `dir`.
fn ca(dir: &Path, name: &str) {
    let (key, crt, subj) = (
        format!("{name}.key"),
        format!("{name}.crt"),
        format!("/CN={name}"),
    );
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &crt,
            "-days",
            "2",
            "-subj",
            &subj,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
        ],
    );
}

/// A pod's certificate for `ip`, signed by the authority `ca`: the `[cluster]` keys.
fn pod_cert(dir: &Path, ca: &str, trust: &str, name: &str, ip: &str) -> String {
    let ext = dir.join(format!("{name}.ext"));
    std::fs::write(
        &ext,
        format!("subjectAltName=IP:{ip}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"),
    )
    .unwrap();
    let (key, csr, crt) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
    );
    let subj = format!("/CN={name}");
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &subj,
        ],
    );
    let (ca_crt, ca_key) = (format!("{ca}.crt"), format!("{ca}.key"));
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_crt,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            ext.to_str().unwrap(),
        ],
    );
    let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
    format!(
        "tls_ca = {:?}\ntls_cert = {:?}\ntls_key = {:?}\n",
        p(&format!("{trust}.crt")),
        p(&crt),
        p(&key)
    )
}

#[test]
fn pods_speak_tls_and_refuse_a_certificate_the_cluster_ca_did_not_sign() {
    let certs = tempfile::tempdir().unwrap();
    let dir = certs.path();
    ca(dir, "cluster");
    ca(dir, "rogue");
    let mut a = Pod::new("a", "127.0.0.2");
    let mut b = Pod::new("b", "127.0.0.3");
    let mut d = Pod::new("d", "127.0.0.5");
    let all = [a.addr(), b.addr(), d.addr()];
    a.start_with(
        &all,
        COOKIE,
        &pod_cert(dir, "cluster", "cluster", "a", "127.0.0.2"),
    );
    b.start_with(
        &all,
        COOKIE,
        &pod_cert(dir, "cluster", "cluster", "b", "127.0.0.3"),
    );
    // The right cookie and the cluster's CA as its trust, but a certificate the rogue
    // authority signed.
    d.start_with(
        &all,
        COOKIE,
        &pod_cert(dir, "rogue", "cluster", "d", "127.0.0.5"),
    );
    a.wait_for("b up", Duration::from_secs(20), |v| up(v, "b"));
    b.wait_for("a up", Duration::from_secs(20), |v| up(v, "a"));
    a.d().template("room", 4);
    b.wait_for("a's template", Duration::from_secs(10), |v| {
        v.iter().any(|p| p.0 == "a" && p.2 == 1)
    });
    let (s, v) = b.d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!((s, v["pod"].as_str()), (200, Some("a")), "{v}");
    std::thread::sleep(Duration::from_secs(2));
    for p in [&a, &b] {
        assert!(p.peers().iter().all(|x| x.0 != "d"), "{:?}", p.peers());
    }
    assert!(d.peers().is_empty(), "{:?}", d.peers());
    let t0 = Instant::now();
    while !a.log_text().contains("refused a peer's certificate") {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "a logged no refusal:\n{}",
            a.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        d.log_text().contains("refused this pod"),
        "{}",
        d.log_text()
    );
}

/// The pods whose own template list has `id`.
fn holders(pods: &[Pod], id: &str) -> Vec<usize> {
    (0..pods.len())
        .filter(|&i| {
            pods[i].d.as_ref().is_some_and(|d| {
                let (_, v) = d.get("/v1/templates");
                v.to_string().contains(&format!("\"id\":\"{id}\""))
            })
        })
        .collect()
}

#[test]
fn a_template_is_copied_to_a_second_pod_which_serves_it_bit_for_bit_and_after_its_first_pod_dies() {
    let mut pods = start_three("template_replicas = 2\n");
    let a = 0;
    pods[a].d().template("room", 4);
    let t0 = Instant::now();
    let copy = loop {
        let h = holders(&pods, "room");
        if h.len() == 2 {
            break h[1];
        }
        assert!(h.len() < 3, "three copies: {h:?}");
        assert!(t0.elapsed() < Duration::from_secs(20), "no copy: {h:?}");
        std::thread::sleep(Duration::from_millis(200));
    };
    println!(
        "room copied to pod {} in {:.1} s",
        pods[copy].name,
        t0.elapsed().as_secs_f64()
    );
    // The edit, as A runs it and as the copy's pod does (there, or on A).
    let (s, on_a) = pods[a].d().post("/v1/edits", &edit_body("room", 15));
    assert_eq!((s, on_a["pod"].as_str()), (200, Some("a")), "{on_a}");
    let (s, v) = pods[copy].d().post("/v1/edits", &edit_body("room", 15));
    assert_eq!(s, 200, "{v}");
    assert_eq!(edit_image(&v), edit_image(&on_a), "ran on {}", v["pod"]);
    let m = pods[copy].d().metrics();
    assert_eq!(
        counter(
            &m,
            "denoised_pod_transfers_total",
            "pod=\"a\",result=\"ok\""
        ),
        1.0,
        "{m}"
    );
    assert!(
        counter(&m, "denoised_pod_transfer_bytes_total", "") > 1e6,
        "{m}"
    );
    // Still two copies a while later: nobody else copies it.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(holders(&pods, "room").len(), 2);

    // kill -9 of pod A's supervisor under edits through the third pod: all succeed,
    // on the copy once A is gone.
    let third = 3 - copy;
    let url = pods[third].d().url.clone();
    let load = std::thread::spawn(move || {
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        (0..16u64)
            .map(|i| {
                let r = http
                    .post(format!("{url}/v1/edits"))
                    .json(&edit_body("room", i))
                    .send()
                    .expect("every request gets an answer");
                let status = r.status().as_u16();
                let v: Value = r.json().unwrap_or(Value::Null);
                let image = v["image"].as_str().map(|_| edit_image(&v));
                (
                    status,
                    v["pod"].as_str().unwrap_or("").to_string(),
                    v["error"].to_string(),
                    image,
                )
            })
            .collect::<Vec<_>>()
    });
    std::thread::sleep(Duration::from_millis(500));
    let mut sup = pods[a].d.take().unwrap();
    sup.child.kill().unwrap();
    sup.child.wait().unwrap();
    let results = load.join().unwrap();
    let ran: Vec<_> = results.iter().map(|r| (r.0, r.1.as_str(), &r.2)).collect();
    println!(
        "edits of room through {} while a died: {ran:?}",
        pods[third].name
    );
    assert!(results.iter().all(|r| r.0 == 200), "{ran:?}");
    // The last ran on a copy, and is the edit A served, bit for bit.
    let last = results.last().unwrap();
    assert_ne!(last.1, "a");
    assert!(
        last.3.as_ref() == Some(&edit_image(&on_a)),
        "the copy's edit differs"
    );
    // The lost copy is made again: the two pods left both hold it.
    let t0 = Instant::now();
    while holders(&pods, "room").len() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(20), "not copied again");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(sup);
}
