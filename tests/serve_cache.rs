//! The template cache's tiers against the real daemon: templates written through to
//! disk survive a kill -9 of the cache process (the index is rebuilt from disk and an
//! edit needs no new capture), a damaged slab on disk is detected and the template
//! reported missing, never used; host memory holds at most its capacity (the least
//! recently used templates wait on disk and come back when edited); the disk tier drops
//! the least recently used beyond its capacity; and an edit of a template on disk
//! loads it while the request is preprocessed.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn info(d: &Daemon, id: &str) -> (u16, Value) {
    d.get(&format!("/v1/templates/{id}"))
}

/// Waits until `id` is written to disk.
fn on_disk(d: &Daemon, id: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let (s, v) = info(d, id);
        assert_eq!(s, 200, "{v}");
        if v["tiers"]["disk"].as_u64().unwrap_or(0) > 0 {
            return v;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "never on disk: {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn edit(d: &Daemon, id: &str) -> (u16, Value) {
    d.post(
        "/v1/edits",
        &json!({"template_id": id, "mask": mask_b64(), "seed": 3}),
    )
}

/// Kills the cache process and waits until a new one answers.
fn kill_cache(d: &Daemon) {
    let victim = d.worker_pid("cache");
    // SAFETY: plain kill(2) of a child of the daemon.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    while d.worker_pid_opt("cache").is_none_or(|p| p == victim) || d.get("/v1/templates").0 != 200 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the cache never came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The version directory of `id` on disk.
fn version_dir(root: &Path, id: &str) -> PathBuf {
    for model in std::fs::read_dir(root).unwrap().flatten() {
        for e in std::fs::read_dir(model.path()).unwrap().flatten() {
            if e.file_name()
                .to_string_lossy()
                .starts_with(&format!("{id}@"))
            {
                return e.path();
            }
        }
    }
    panic!("no directory of {id} under {}", root.display());
}

#[test]
fn templates_survive_a_killed_cache_and_a_damaged_one_is_never_used() {
    let d = Daemon::start(&[]);
    d.template("a", 4);
    d.template("b", 4);
    let (s, want) = edit(&d, "a");
    assert_eq!(s, 200, "{want}");
    on_disk(&d, "a");
    on_disk(&d, "b");
    kill_cache(&d);
    // The index came back from disk: the templates are listed, on disk only.
    let (_, a) = info(&d, "a");
    println!("after the restart: {a}");
    assert_eq!(a["tiers"]["host"], 0, "{a}");
    assert!(a["tiers"]["disk"].as_u64().unwrap() > 0, "{a}");
    // An edit needs no new capture, and gives the same image as before.
    let (s, got) = edit(&d, "a");
    assert_eq!(s, 200, "{got}");
    assert_eq!(png(&edit_image(&got)), png(&edit_image(&want)));
    let (_, a) = info(&d, "a");
    assert!(a["tiers"]["host"].as_u64().unwrap() > 0, "loaded back: {a}");

    // Flip one byte of a slab of `b` on disk, then edit it from disk.
    kill_cache(&d);
    let dir = version_dir(&d.cache_dir, "b");
    let data = dir.join("cache.bin");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[1000] ^= 0x40;
    std::fs::write(&data, &bytes).unwrap();
    let (s, v) = edit(&d, "b");
    println!("edit of the damaged template: {s} {v}");
    assert_eq!(s, 404, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("damaged"),
        "{v}"
    );
    assert_eq!(info(&d, "b").0, 404);
    assert!(!dir.exists(), "the damaged template stayed on disk");
    // The other template is untouched, and the daemon serves on.
    assert_eq!(edit(&d, "a").0, 200);
}

#[test]
fn memory_holds_its_capacity_and_disk_drops_the_least_recently_used() {
    // A cache arena for about two templates of the built-in model at 4 steps (2.9 MB
    // each) and their images, and a disk tier for about three.
    let (_cfg, d) = Daemon::with_config(
        "[workers]\ncache_arena_bytes = 7000000\n[cache]\ndisk_bytes = 9500000\n",
    );
    for id in ["t0", "t1", "t2"] {
        d.template(id, 4);
        on_disk(&d, id);
    }
    let host = |d: &Daemon| -> Vec<(String, u64, u64)> {
        let (_, v) = d.get("/v1/templates");
        v["templates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["id"].as_str().unwrap().to_string(),
                    t["tiers"]["host"].as_u64().unwrap(),
                    t["tiers"]["disk"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let tiers = host(&d);
    println!("after 3 registrations: {tiers:?}");
    let in_memory: u64 = tiers.iter().map(|t| t.1).sum();
    assert!(in_memory <= 7_000_000, "{tiers:?}");
    // The least recently used left memory first.
    assert_eq!(tiers[0].1, 0, "t0 should have left memory: {tiers:?}");
    assert!(tiers.iter().all(|t| t.2 > 0), "{tiers:?}");
    // Editing it brings it back, and the least recently used other goes.
    assert_eq!(edit(&d, "t0").0, 200);
    let tiers = host(&d);
    println!("after editing t0: {tiers:?}");
    assert!(tiers[0].1 > 0 && tiers[1].1 == 0, "{tiers:?}");
    // A fourth template overflows the disk tier: the least recently used (t1) goes.
    d.template("t3", 4);
    on_disk(&d, "t3");
    let tiers = host(&d);
    println!("after a fourth: {tiers:?}");
    let ids: Vec<&str> = tiers.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(ids, ["t0", "t2", "t3"], "{tiers:?}");
    assert_eq!(edit(&d, "t1").0, 404);
    assert_eq!(edit(&d, "t2").0, 200);
}

#[test]
fn an_edit_of_a_template_on_disk_loads_it_during_preprocessing() {
    let d = Daemon::start(&[]);
    d.template("t", 4);
    on_disk(&d, "t");
    kill_cache(&d);
    let (s, v) = edit(&d, "t");
    assert_eq!(s, 200, "{v}");
    let metrics = d
        .http
        .get(format!("{}/metrics", d.url))
        .send()
        .unwrap()
        .text()
        .unwrap();
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {metrics}"))
    };
    let waits = value("denoised_template_load_wait_seconds_count");
    let waited = value("denoised_template_load_wait_seconds_sum");
    let preprocess = v["timings"]["preprocess_s"].as_f64().unwrap();
    println!(
        "edit of a template on disk: preprocessing {:.1} ms, then waited {:.1} ms for the rest of its load",
        preprocess * 1e3,
        waited * 1e3
    );
    assert_eq!(waits, 1.0, "{metrics}");
    let loaded = metrics
        .lines()
        .find(|l| {
            l.starts_with("denoised_template_cache_loaded_bytes_total")
                && l.contains("tier=\"host\"")
        })
        .unwrap();
    assert!(!loaded.ends_with(" 0"), "{loaded}");
}
