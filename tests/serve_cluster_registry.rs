//! Template identity kept in a real etcd (`[cluster] registry`; docs/cluster.md), with
//! three pods on this machine (tests/common/pods.rs) and an etcd of the test's own
//! (tests/common/etcd.rs): one identity per template across pods, deletes that stick
//! at any pod and across a pod's loss, and a pod cut off from the registry refusing
//! what it cannot confirm. Each test stops every daemon and etcd it starts.

mod common;

use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::pods::*;
use common::*;
use serde_json::{json, Value};

fn registry_keys(etcd: &Etcd, lease_s: f64) -> String {
    format!(
        "registry = [{:?}]\nregistry_lease_seconds = {lease_s}\n",
        etcd.endpoint()
    )
}

/// Registers template `id` at `d` from the test image with `seed` (`replace`).
fn create(d: &Daemon, id: &str, seed: u64, replace: bool) -> (u16, Value) {
    d.post(
        "/v1/templates",
        &json!({"image": image_b64(), "id": id, "steps": 4, "seed": seed,
                "prompt": "a room", "replace": replace}),
    )
}

/// Waits until `ok` holds, up to `limit`.
fn eventually(what: &str, limit: Duration, ok: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The versions of `id` in pod `p`'s own template list.
fn versions_at(p: &Pod, id: &str) -> Vec<u64> {
    let (_, v) = p.d().get("/v1/templates");
    v["templates"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["id"] == id)
        .map(|t| t["version"].as_u64().unwrap())
        .collect()
}

/// Without a registry each pod checks ids, replaces and deletes against its own
/// copies: a create at pod C of an id pod A holds answered 201, a replace at B left A
/// serving the old version, and a DELETE at a pod without the template answered 404
/// (each seen with `registry` left out of this test's configuration). With one:
/// - a create of an id the cluster holds is 409 at any pod;
/// - a replace supersedes every copy: after its 201, every pod's edit reads the new
///   version (its reply's `template_version`), and the old copies go;
/// - a DELETE works at any pod, and a pod killed (-9) while it happened comes back
///   without the template (it removes what the registry says is gone before it is
///   ready), and the id can be created again, with a newer version.
#[test]
fn template_identity_is_one_across_pods_with_a_registry() {
    let _one = one_cluster_at_a_time();
    let Some(etcd) = Etcd::start("template_identity_is_one_across_pods_with_a_registry") else {
        return;
    };
    let keys = registry_keys(&etcd, 1.0);
    let mut pods = start_three(&keys);
    let (a, b, c) = (0, 1, 2);

    let (s, v) = create(pods[a].d(), "room", 3, false);
    assert_eq!(s, 201, "{v}");
    let v1 = v["version"].as_u64().unwrap();
    let digest1 = v["digest"].as_str().unwrap().to_string();
    assert_eq!(digest1.len(), 64, "{v}");
    // C holds nothing of it, and still refuses the id.
    let (s, v) = create(pods[c].d(), "room", 4, false);
    assert_eq!(s, 409, "{v}");

    // Replaced at B (another image: another seed); every pod's edits read it.
    let (s, v) = create(pods[b].d(), "room", 5, true);
    assert_eq!(s, 201, "{v}");
    let v2 = v["version"].as_u64().unwrap();
    assert!(v2 > v1, "{v1} then {v2}");
    assert_ne!(v["digest"], digest1.as_str());
    let mut images = vec![];
    for p in &pods {
        let (s, e) = p.d().post("/v1/edits", &edit_body("room", 7));
        assert_eq!(s, 200, "pod {}: {e}", p.name);
        assert_eq!(e["template_version"], v2, "pod {}: {}", p.name, e["pod"]);
        images.push(edit_image(&e));
    }
    assert!(
        images.iter().all(|i| *i == images[0]),
        "the same edit differs between pods"
    );
    // A's copy of the old version goes.
    eventually("a drops version 1", Duration::from_secs(10), || {
        !versions_at(&pods[a], "room").contains(&v1)
    });

    // A is lost (-9) while C, which may not hold it, deletes the template.
    signal_all(pods[a].d(), libc::SIGKILL);
    pods[a].d = None;
    let (s, v) = pods[c].d().delete("/v1/templates/room");
    assert_eq!(s, 200, "{v}");
    for p in [b, c] {
        let (s, v) = pods[p].d().post("/v1/edits", &edit_body("room", 7));
        assert_eq!(s, 404, "pod {}: {v}", pods[p].name);
    }
    // A comes back: ready only once it removed what the registry says is gone.
    let all: Vec<String> = pods.iter().map(Pod::addr).collect();
    pods[a].start_with(&all, COOKIE, &keys);
    assert!(
        versions_at(&pods[a], "room").is_empty(),
        "a brought `room` back"
    );
    let (s, v) = pods[a].d().post("/v1/edits", &edit_body("room", 7));
    assert_eq!(s, 404, "{v}");
    let (s, v) = pods[a].d().get("/v1/templates/room");
    assert_eq!(s, 404, "{v}");
    // A second delete has nothing to delete.
    let (s, v) = pods[b].d().delete("/v1/templates/room");
    assert_eq!(s, 404, "{v}");
    // Created again: a newer version than any before.
    let (s, v) = create(pods[a].d(), "room", 3, false);
    assert_eq!(s, 201, "{v}");
    assert!(v["version"].as_u64().unwrap() > v2, "{v}");
    drop(pods);
}

/// A pod cut off from the registry (etcd killed) refuses identity changes at once
/// (503), serves edits of the versions it read for the lease it states (4 s here),
/// then refuses them (503) until the registry answers again; `/readyz` says so.
#[test]
fn a_pod_cut_off_from_the_registry_refuses_what_it_cannot_confirm() {
    let _one = one_cluster_at_a_time();
    let Some(mut etcd) =
        Etcd::start("a_pod_cut_off_from_the_registry_refuses_what_it_cannot_confirm")
    else {
        return;
    };
    let lease = 4.0;
    let pods = start_three(&registry_keys(&etcd, lease));
    let a = &pods[0];
    let (s, v) = create(a.d(), "room", 3, false);
    assert_eq!(s, 201, "{v}");
    // (A's view has read the template: its own edit confirms it from the view.)
    let (s, v) = a.d().post("/v1/edits", &edit_body("room", 7));
    assert_eq!(s, 200, "{v}");

    etcd.kill();
    let cut = Instant::now();
    let (s, v) = a.d().post("/v1/edits", &edit_body("room", 7));
    let within = cut.elapsed();
    println!("an edit {within:?} after the cut: {s}");
    assert!(
        within.as_secs_f64() < lease - 1.0,
        "the edit took {within:?}"
    );
    assert_eq!(s, 200, "within the lease: {v}");
    let (s, v) = create(a.d(), "hall", 3, false);
    assert_eq!(s, 503, "{v}");
    let (s, v) = pods[1].d().delete("/v1/templates/room");
    assert_eq!(s, 503, "{v}");
    // (The lease ran from a read sent before the cut.)
    let out = Duration::from_secs_f64(lease + 0.3);
    std::thread::sleep(out.saturating_sub(cut.elapsed()));
    let (s, v) = a.d().post("/v1/edits", &edit_body("room", 7));
    assert_eq!(s, 503, "after the lease: {v}");
    assert!(v.to_string().contains("registry"), "{v}");
    let (_, r) = a.d().get("/readyz");
    assert_eq!(r["registry"]["confirmed"], false, "{r}");

    etcd.restart();
    eventually("a confirms again", Duration::from_secs(15), || {
        a.d().get("/readyz").1["registry"]["confirmed"] == true
    });
    let (s, v) = a.d().post("/v1/edits", &edit_body("room", 7));
    assert_eq!(s, 200, "{v}");
    let (s, v) = create(pods[2].d(), "hall", 3, false);
    assert_eq!(s, 201, "{v}");
    drop(pods);
}
