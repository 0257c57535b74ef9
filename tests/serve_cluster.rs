//! A cluster of pods on this machine (docs/cluster.md; the pods: tests/common/pods.rs):
//! routing between pods, forwarding with events and cancel, template copies, recapture,
//! and a pod's loss and return. Each test stops every daemon it starts.

mod common;

use std::time::{Duration, Instant};

use common::pods::*;
use common::*;
use serde_json::{json, Value};

#[test]
fn an_edit_runs_on_the_pod_holding_its_template_and_the_cluster_survives_that_pods_loss() {
    let _one = one_cluster_at_a_time();
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
    // to A directly (once C's view of A is idle after the edit above: see below).
    wait_idle(&pods[c], "a");
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
    let relayed = |p: &Pod, d: &str| {
        let m = p.d().metrics();
        counter(
            &m,
            "denoised_pod_events_total",
            &format!("direction=\"{d}\""),
        )
    };
    assert!(
        relayed(&pods[c], "in") >= 5.0,
        "4 steps and a preview at least"
    );
    assert_eq!(relayed(&pods[a], "out"), relayed(&pods[c], "in"));
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
    let start = Instant::now();
    let load = std::thread::spawn(move || {
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let mut out = vec![];
        for i in 0..24u64 {
            let t = if i % 2 == 0 { "room" } else { "hall" };
            let r = http
                .post(format!("{url}/v1/edits"))
                .json(&edit_body(t, i))
                .send()
                .expect("every request gets an answer");
            let status = r.status().as_u16();
            let v: Value = r.json().unwrap_or(Value::Null);
            let pod = v["pod"].as_str().unwrap_or("").to_string();
            // When it ended, in seconds from the load's start.
            out.push((t, status, pod, start.elapsed().as_secs_f64()));
        }
        out
    });
    std::thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    let killed_at = start.elapsed().as_secs_f64();
    let mut sup = pods[a].d.take().unwrap();
    sup.child.kill().unwrap();
    sup.child.wait().unwrap();
    let results = load.join().unwrap();
    println!("edits through c while a died (a killed at {killed_at:.1} s): {results:?}");
    assert!(results.iter().all(|r| r.1 == 200), "{results:?}");
    // Served again within 10 s: the first of room's edits after the kill that ran
    // elsewhere.
    let again = results
        .iter()
        .find(|r| r.0 == "room" && r.2 != "a")
        .map(|r| r.3 - killed_at);
    println!("room served again {again:?} s after the kill");
    assert!(again.is_some_and(|s| s < 10.0), "{results:?}");
    let down = pods[c].wait_for("a down", Duration::from_secs(10), |v| !up(v, "a"));
    println!(
        "c marked a down {down:.1} s after the wait began ({:.1} s after the kill)",
        killed.elapsed().as_secs_f64()
    );
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

/// The pod policies, live: round_robin takes turns over the pods (those lacking the
/// template copy it from its pod first); template_aware sends a burst of edits of
/// one pod's template to that pod until its queue costs more than a copy elsewhere.
/// Every edit, wherever it ran, is the same image.
#[test]
fn pods_take_turns_under_round_robin_and_share_a_busy_template_under_template_aware() {
    let _one = one_cluster_at_a_time();
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
    // A template registered on A a moment ago, edited through C at once (before C's
    // next report of A, most often): C asks its peers again rather than answer 404.
    pods[a].d().template("fresh", 4);
    let (s, v) = pods[c].d().post("/v1/edits", &edit_body("fresh", 2));
    assert_eq!(s, 200, "{v}");
    let (s, fresh_on_a) = pods[a].d().post("/v1/edits", &edit_body("fresh", 2));
    assert_eq!(s, 200, "{fresh_on_a}");
    assert_eq!(
        edit_image(&v),
        edit_image(&fresh_on_a),
        "ran on {}",
        v["pod"]
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
fn a_template_is_copied_to_a_second_pod_which_serves_it_bit_for_bit_and_after_its_first_pod_dies() {
    let _one = one_cluster_at_a_time();
    // (Copies are made again at once when a holder is lost: no grace period.)
    let mut pods = start_three("template_replicas = 2\nreplicate_after_seconds = 0\n");
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

/// Generations go between pods too (they read no template: the pods' loads decide):
/// under round_robin, three sent to pod C run on C, A and B in turn, each the image the
/// same generation makes on A alone (the approximate cache off), and each reply names
/// its pod.
#[test]
fn generations_are_routed_between_pods() {
    let _one = one_cluster_at_a_time();
    let pods = start_three_of(Some("builtin:t2i"), "policy = \"round_robin\"\n");
    let body = json!({
        "prompt": "a red fox in the snow", "seed": 3, "steps": 4, "width": 32, "height": 32,
        "max_sequence_length": 32, "approx_cache": "off",
    });
    // A's own router takes its own turn first.
    let (s, on_a) = pods[0].d().post("/v1/generations", &body);
    assert_eq!((s, on_a["pod"].as_str()), (200, Some("a")), "{on_a}");
    let mut ran = vec![];
    for _ in 0..3 {
        let (s, v) = pods[2].d().post("/v1/generations", &body);
        assert_eq!(s, 200, "{v}");
        assert_eq!(edit_image(&v), edit_image(&on_a), "ran on {}", v["pod"]);
        ran.push(v["pod"].as_str().unwrap().to_string());
    }
    assert_eq!(ran, ["c", "a", "b"]);
    let m = pods[0].d().metrics();
    assert_eq!(
        counter(&m, "denoised_pod_forwarded_in_total", ""),
        1.0,
        "{m}"
    );
}

/// A pod that stops without closing its connections (every process paused, as a host
/// that hangs looks to its peers: no TCP reset) is marked down once it has not reported
/// for `DOWN_AFTER` (3 s), and an edit a peer forwarded to it ends then, with a 503 that
/// names it, instead of waiting out the forward's timeout (three stage timeouts: 30
/// minutes by default, 60 s here, where without the down check the edit ends after 60 s
/// with another error, as seen). Resumed, the pod serves again.
#[test]
fn an_edit_forwarded_to_a_pod_that_stops_ends_when_that_pod_is_marked_down() {
    let _one = one_cluster_at_a_time();
    let pods = start_three("[server]\nstage_timeout_seconds = 20\n");
    let (a, b) = (0, 1);
    pods[a].d().template("room", 40);
    pods[b].wait_for("a's template", Duration::from_secs(10), |v| {
        v.iter().any(|p| p.0 == "a" && p.2 == 1)
    });
    wait_idle(&pods[b], "a");
    let t0 = Instant::now();
    let edit = std::thread::scope(|s| {
        let sent = s.spawn(|| pods[b].d().post("/v1/edits", &edit_body("room", 5)));
        // Once the edit runs on A (its 40 steps take seconds there), A stops.
        let m0 = Instant::now();
        while counter(
            &pods[a].d().metrics(),
            "denoised_pod_forwarded_in_total",
            "",
        ) < 1.0
        {
            assert!(
                m0.elapsed() < Duration::from_secs(20),
                "the edit never reached pod a"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        signal_all(pods[a].d(), libc::SIGSTOP);
        sent.join().unwrap()
    });
    let took = t0.elapsed();
    signal_all(pods[a].d(), libc::SIGCONT);
    let (s, v) = edit;
    println!("the forwarded edit ended after {took:?}: {s} {v}");
    assert_eq!(s, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("pod a"),
        "{v}"
    );
    assert!(took < Duration::from_secs(20), "{took:?}");
    // Resumed, A reports again and serves its template through B.
    pods[b].wait_for("a up again", Duration::from_secs(30), |v| up(v, "a"));
    let (s, v) = pods[b].d().post("/v1/edits", &edit_body("room", 6));
    assert_eq!(s, 200, "{v}");
}

/// Recipes on need: with `recipe_copies = 1` one pod besides a template's holder keeps
/// its recipe and the third does not (each of the three would before: every pod kept
/// every recipe). Once the holder is gone, an edit sent to the third is captured there
/// from the recipe it asks the keeper for, and equals the holder's edit bit for bit
/// (without the ask it has no recipe: a 503, as seen).
#[test]
fn a_pod_asks_for_a_recipe_it_does_not_keep_when_it_needs_it() {
    let _one = one_cluster_at_a_time();
    let mut pods = start_three("recipe_copies = 1\n");
    let (a, b, c) = (0, 1, 2);
    pods[a].d().template("room", 4);
    let recipes = |p: &Pod| counter(&p.d().metrics(), "denoised_pod_recipes", "");
    let t0 = Instant::now();
    while recipes(&pods[b]) + recipes(&pods[c]) < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no pod kept the recipe"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A few rounds of recipe learning later, still one keeper.
    std::thread::sleep(Duration::from_secs(3));
    let (keeper, other) = match (recipes(&pods[b]), recipes(&pods[c])) {
        (1.0, 0.0) => (b, c),
        (0.0, 1.0) => (c, b),
        kept => panic!("recipes kept by b and c: {kept:?}"),
    };
    println!(
        "{} keeps the recipe, {} does not",
        pods[keeper].name, pods[other].name
    );
    let (s, on_a) = pods[a].d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!(s, 200, "{on_a}");
    let mut sup = pods[a].d.take().unwrap();
    sup.child.kill().unwrap();
    sup.child.wait().unwrap();
    pods[other].wait_for("a down", Duration::from_secs(10), |v| !up(v, "a"));
    let (s, v) = pods[other].d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["pod"].as_str(), Some(pods[other].name.as_str()), "{v}");
    assert_eq!(
        edit_image(&v),
        edit_image(&on_a),
        "the recaptured edit differs"
    );
    let m = pods[other].d().metrics();
    assert_eq!(
        counter(&m, "denoised_template_recaptures_total", "result=\"ok\""),
        1.0,
        "{m}"
    );
    // Kept once asked for (the gauge follows at the next round of recipe learning).
    wait_metric(&pods[other], "denoised_pod_recipes", 1.0);
    drop(sup);
}
