//! The template cache's tiers against the real daemon: templates written through to
//! disk survive a kill -9 of the cache process (the index is rebuilt from disk and an
//! edit needs no new capture), a damaged slab on disk is detected and the template
//! reported missing, never used; host memory holds at most its capacity (the least
//! recently used templates wait on disk and come back when edited); the disk tier drops
//! the least recently used beyond its capacity; an edit of a template on disk loads it
//! while the request is preprocessed; and a Y-mode template (block outputs cached) is
//! about half the bytes, edits, and survives a restart with its mode. A template's VAE
//! traces (the sparse VAE's) are stored, loaded and checked with it. A template whose
//! registration was answered survives a kill -9 of the cache process before it is on
//! disk.

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

/// Whether `id` has a complete version directory on disk (a write in progress is a
/// `.tmp` directory, renamed when complete).
fn written(root: &Path, id: &str) -> bool {
    let Ok(models) = std::fs::read_dir(root) else {
        return false;
    };
    models.flatten().any(|model| {
        std::fs::read_dir(model.path()).is_ok_and(|rd| {
            rd.flatten().any(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                name.starts_with(&format!("{id}@")) && !name.ends_with(".tmp")
            })
        })
    })
}

/// Whether process `pid` is gone (or a zombie, not yet reaped).
fn dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
        Err(_) => true,
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

/// The sparse VAE's traces are part of the template: stored in both tiers (counted in
/// its size), loaded back from disk with its cache after a killed cache process, and a
/// damaged trace on disk is caught like a damaged slab.
#[test]
fn vae_traces_are_stored_loaded_and_checked_with_the_template() {
    let d = Daemon::start(&[]);
    for id in ["v", "w"] {
        let body = json!({"image": doubled_image_b64(), "id": id, "steps": 3, "seed": 3});
        let (s, v) = d.post("/v1/templates", &body);
        assert_eq!(s, 201, "{v}");
    }
    let v = on_disk(&d, "v");
    on_disk(&d, "w");
    let (cache, traces) = (
        v["cache_bytes"].as_u64().unwrap(),
        v["vae_trace_bytes"].as_u64().unwrap(),
    );
    assert!(traces > 0, "{v}");
    assert_eq!(v["tiers"]["host"].as_u64(), Some(cache + traces), "{v}");
    let vae_bin = |id: &str| version_dir(&d.cache_dir, id).join("vae.bin");
    // An 8x8-pixel box of the 128x128 image: the passes run sparse.
    let edit = |d: &Daemon, id: &str| {
        d.post(
            "/v1/edits",
            &json!({"template_id": id, "boxes": [[48, 40, 8, 8]], "seed": 3}),
        )
    };
    assert_eq!(std::fs::metadata(vae_bin("v")).unwrap().len(), traces);
    let (s, want) = edit(&d, "v");
    assert_eq!(s, 200, "{want}");
    assert_eq!(
        want["timings"]["vae_decode"], "sparse",
        "{}",
        want["timings"]
    );
    kill_cache(&d);
    let (_, v) = info(&d, "v");
    assert_eq!(v["tiers"]["host"], 0, "{v}");
    let (s, got) = edit(&d, "v");
    assert_eq!(s, 200, "{got}");
    assert_eq!(png(&edit_image(&got)), png(&edit_image(&want)));
    let (_, v) = info(&d, "v");
    assert_eq!(
        v["tiers"]["host"].as_u64(),
        Some(cache + traces),
        "loaded back with its traces: {v}"
    );
    // One flipped byte in a trace on disk: the template is dropped, never used.
    kill_cache(&d);
    let mut bytes = std::fs::read(vae_bin("w")).unwrap();
    let n = bytes.len();
    bytes[n - 1000] ^= 0x40;
    std::fs::write(vae_bin("w"), &bytes).unwrap();
    let (s, v) = edit(&d, "w");
    assert_eq!(s, 404, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("damaged"),
        "{v}"
    );
    assert_eq!(edit(&d, "v").0, 200, "the other template serves on");

    // Workers whose shared memory cannot hold a trace (the tiny model's are 24 MB and
    // 34 MB at 128x128) capture the template without it, and its edits trace it.
    let (_cfg, small) = Daemon::with_config("[workers]\narena_bytes = 30000000\n");
    let body = json!({"image": doubled_image_b64(), "id": "v", "steps": 3, "seed": 3});
    let (s, v) = small.post("/v1/templates", &body);
    assert_eq!(s, 201, "{v}");
    assert!(v["vae_trace_bytes"].as_u64().unwrap() < traces, "{v}");
    let (s, got) = edit(&small, "v");
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["timings"]["vae_decode"], "sparse_traced", "{got}");
}

/// A registration is answered once its template is on disk: its files and directory
/// synced, then renamed into place. With every write to disk slowed by 1.5 s
/// (`cache:slow_write_ms`), the version's directory is complete when the 201 comes
/// (seen to fail when the answer is sent before the write), and a kill -9 of the cache process right after it loses
/// nothing (its replacement finds the template on disk). The edit then equals the edit
/// of the same template registered without a kill, VAE traces included. (The answer
/// used to come once the template was in the cache process's memory, and the test
/// relied on a kill winning a race against the write.)
#[test]
fn a_registration_is_answered_once_its_template_is_on_disk() {
    const SLOW_WRITE_MS: u64 = 1500;
    let fault = format!("cache:slow_write_ms={SLOW_WRITE_MS}");
    let d = Daemon::start_with_env(&[], &[("DENOISED_FAULT", fault.as_str())]);
    let register = |id: &str| {
        let body = json!({"image": doubled_image_b64(), "id": id, "steps": 3, "seed": 3});
        let (s, v) = d.post("/v1/templates", &body);
        assert_eq!(s, 201, "{v}");
        // The write takes at least 1.5 s after the copy into memory: an answer that did
        // not wait for it comes before the directory exists.
        assert!(
            written(&d.cache_dir, id),
            "`{id}` acknowledged and not on disk"
        );
        assert!(v["tiers"]["disk"].as_u64().unwrap() > 0, "{v}");
    };
    // An 8x8-pixel box of the 128x128 image: the VAE passes run sparse, from the
    // template's stored traces.
    let edit = |id: &str| {
        let (s, v) = d.post(
            "/v1/edits",
            &json!({"template_id": id, "boxes": [[48, 40, 8, 8]], "seed": 3}),
        );
        assert_eq!(s, 200, "edit of `{id}`: {v}");
        assert_eq!(v["timings"]["vae_decode"], "sparse", "{}", v["timings"]);
        png(&edit_image(&v))
    };
    register("reference");
    let want = edit("reference");
    let victim = d.worker_pid("cache");
    register("t0");
    // SAFETY: plain kill(2) of a child of the daemon.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    while !dead(victim) {
        assert!(t0.elapsed() < Duration::from_secs(10), "{victim} lives on");
        std::thread::sleep(Duration::from_millis(1));
    }
    while d.worker_pid_opt("cache").is_none_or(|p| p == victim) || d.get("/v1/templates").0 != 200 {
        assert!(t0.elapsed() < Duration::from_secs(30), "no cache again");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (s, v) = info(&d, "t0");
    assert_eq!(s, 200, "`t0` was lost with the cache process: {v}");
    assert!(v["tiers"]["disk"].as_u64().unwrap() > 0, "{v}");
    assert!(
        edit("t0") == want,
        "the edit of `t0` differs from the reference's"
    );
    assert!(edit("reference") == want);
}

/// A DELETE is durable when it is answered: the version is marked deleted on disk
/// first, so a crash of the cache process while an edit still reads the template (its
/// directory stays until the edit is done) does not bring it back. Here the edit's
/// steps are slowed (`denoise:slow_step_ms`) so that it holds the template through the
/// DELETE and the kill; without the marker the restarted cache serves it again (seen).
#[test]
fn a_deleted_template_stays_deleted_across_a_crash_while_an_edit_reads_it() {
    let d = Daemon::start_with_env(&[], &[("DENOISED_FAULT", "denoise:slow_step_ms=400")]);
    d.template("gone", 8);
    std::thread::scope(|s| {
        let edit = s.spawn(|| edit(&d, "gone"));
        // Once the edit is denoising (it holds the template), delete and crash.
        let t0 = Instant::now();
        let running = |m: &str| {
            m.lines()
                .filter(|l| l.starts_with("denoised_denoise_running_requests"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
        };
        while running(&d.metrics()) < 1.0 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the edit never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (s, v) = d.delete("/v1/templates/gone");
        assert_eq!(s, 200, "{v}");
        kill_cache(&d);
        let _ = edit.join();
    });
    let (s, v) = info(&d, "gone");
    assert_eq!(s, 404, "the deleted template came back: {v}");
    assert!(
        !written(&d.cache_dir, "gone"),
        "its directory is still on disk"
    );
}

#[test]
fn a_y_mode_template_is_half_the_bytes_and_survives_a_restart() {
    let d = Daemon::start(&[]);
    d.template("kv", 4);
    let body = |mode: &str| {
        json!({"image": image_b64(), "id": format!("y-{mode}"), "steps": 4, "seed": 3,
               "prompt": "a room", "cache_mode": mode})
    };
    let (s, v) = d.post("/v1/templates", &body("y"));
    assert_eq!(s, 201, "{v}");
    let (s, v) = d.post("/v1/templates", &body("z"));
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cache mode `z`"),
        "{v}"
    );
    let (_, kv) = info(&d, "kv");
    let (_, y) = info(&d, "y-y");
    println!("kv: {kv}\ny: {y}");
    assert_eq!(
        (kv["cache_mode"].as_str(), y["cache_mode"].as_str()),
        (Some("kv"), Some("y"))
    );
    let ratio = y["cache_bytes"].as_f64().unwrap() / kv["cache_bytes"].as_f64().unwrap();
    assert!(ratio < 0.6, "Y-mode bytes / KV-mode bytes = {ratio}");
    let (s, want) = edit(&d, "y-y");
    assert_eq!(s, 200, "{want}");
    assert_eq!(edit(&d, "kv").0, 200);
    on_disk(&d, "y-y");
    kill_cache(&d);
    let (_, y) = info(&d, "y-y");
    assert_eq!(
        (y["cache_mode"].as_str(), &y["tiers"]["host"]),
        (Some("y"), &json!(0)),
        "{y}"
    );
    let (s, got) = edit(&d, "y-y");
    assert_eq!(s, 200, "{got}");
    assert_eq!(png(&edit_image(&got)), png(&edit_image(&want)));
}

/// Compressed templates through the daemon: fp8 K/V (a quarter of f32) and step
/// sharing, recorded per template, edited, and still themselves after a restart.
#[test]
fn fp8_and_step_shared_templates_serve_and_survive_a_restart() {
    for (toml, dtype, stride) in [
        ("[cache]\nkv_dtype = \"fp8\"\n", "fp8", 1),
        ("[cache]\nkv_step_stride = 2\n", "f32", 2),
    ] {
        let (_cfg, d) = Daemon::with_config(toml);
        d.template("t", 4);
        let (_, t) = info(&d, "t");
        println!("{toml:?}: {t}");
        assert_eq!(t["kv_dtype"], dtype, "{t}");
        assert_eq!(t["kv_step_stride"], stride, "{t}");
        // The tiny model's f32 KV template of 4 steps is 2883584 bytes.
        assert!(t["cache_bytes"].as_u64().unwrap() < 2_000_000, "{t}");
        let (s, want) = edit(&d, "t");
        assert_eq!(s, 200, "{want}");
        on_disk(&d, "t");
        kill_cache(&d);
        let (_, t) = info(&d, "t");
        assert_eq!(
            (&t["kv_dtype"], &t["kv_step_stride"]),
            (&json!(dtype), &json!(stride))
        );
        let (s, got) = edit(&d, "t");
        assert_eq!(s, 200, "{got}");
        assert_eq!(png(&edit_image(&got)), png(&edit_image(&want)));
    }
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
    // What the tier's capacity covers beside it: recipes kept for peers and a copy
    // from a peer cut short, 0.6 MB each here. Either alone leaves room for three
    // templates (8.66 MB); both, for two only.
    let model = std::fs::read_dir(&d.cache_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .find(|n| !n.starts_with('.') && n != "noise" && d.cache_dir.join(n).is_dir())
        .expect("the disk tier's directory");
    let recipe = d.cache_dir.join(".recipes").join("far");
    let partial = d.cache_dir.join(".incoming").join(model).join("x@1.part");
    for dir in [&recipe, &partial] {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("bytes"), vec![0u8; 600_000]).unwrap();
    }
    d.template("t4", 4);
    on_disk(&d, "t4");
    let tiers = host(&d);
    println!("after a fifth beside 1.2 MB: {tiers:?}");
    let ids: Vec<&str> = tiers.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(ids, ["t2", "t4"], "{tiers:?}");
}

/// The faults of the prefetch tests: every read of a template from disk takes at
/// least `SLOW_READ_MS` (a slow disk), so the read is far longer than preprocessing
/// (tens of ms with the built-in model; see the figures the tests print) and a read
/// that overlapped preprocessing is told from one that followed it.
const SLOW_READ_MS: u64 = 1500;

/// What an edit of a template only on disk measured, all in the same run.
#[derive(Debug)]
struct Prefetch {
    /// The edit's preprocessing (measured in the preprocess worker).
    preprocess: f64,
    /// The cache's read of the template from disk (the injected sleep included).
    read: f64,
    /// What the router waited for the template's cache after preprocessing.
    waited: f64,
    /// Steps that streamed the template, and what their compute waited for its slabs.
    steps: f64,
    bubble: f64,
    /// The edit's denoise stage, from its first step to its last.
    denoised: f64,
}

/// Starts a daemon with `faults`, registers a template, leaves it on disk only (the
/// cache process killed and restarted) and edits it; the edit's figures.
fn edit_from_disk(faults: &str) -> Prefetch {
    let (_cfg, d) = Daemon::with_config_env(
        "[denoise]\nresident_template_bytes = 1\n",
        &[("DENOISED_FAULT", faults)],
    );
    d.template("t", 4);
    on_disk(&d, "t");
    kill_cache(&d);
    let (s, v) = edit(&d, "t");
    assert_eq!(s, 200, "{v}");
    let metrics = d.metrics();
    // Summed over the series of every worker.
    let value = |name: &str| -> f64 {
        let v: Vec<f64> = metrics
            .lines()
            .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        assert!(!v.is_empty(), "{name} in {metrics}");
        v.iter().sum()
    };
    assert_eq!(
        value("denoised_template_load_wait_seconds_count"),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        value("denoised_template_disk_load_duration_seconds_count"),
        1.0,
        "{metrics}"
    );
    let loaded = metrics
        .lines()
        .find(|l| {
            l.starts_with("denoised_template_cache_loaded_bytes_total")
                && l.contains("tier=\"host\"")
        })
        .unwrap();
    assert!(!loaded.ends_with(" 0"), "{loaded}");
    let m = Prefetch {
        preprocess: v["timings"]["preprocess_s"].as_f64().unwrap(),
        read: value("denoised_template_disk_load_duration_seconds_sum"),
        waited: value("denoised_template_load_wait_seconds_sum"),
        steps: value("denoised_denoise_step_bubble_seconds_count"),
        bubble: value("denoised_denoise_step_bubble_seconds_sum"),
        denoised: v["timings"]["denoise_s"].as_f64().unwrap(),
    };
    println!(
        "{faults}: preprocessing {:.1} ms; the cache read the template in {:.1} ms; the edit \
         then waited {:.1} ms for the rest of its load; its {} streamed steps took {:.2} ms and \
         waited {:.4} ms for template slabs (edit: {})",
        m.preprocess * 1e3,
        m.read * 1e3,
        m.waited * 1e3,
        m.steps,
        m.denoised * 1e3,
        m.bubble * 1e3,
        v["timings"]
    );
    // Every step streamed the template (4 steps); the read was the slow one asked for,
    // and far longer than preprocessing, so the checks below can tell the orders apart.
    assert_eq!(m.steps, 4.0, "{metrics}");
    assert!(m.read >= SLOW_READ_MS as f64 / 1e3, "{m:?}");
    assert!(m.read > 3.0 * m.preprocess, "{m:?}");
    m
}

/// What only a read that started with the edit (when it pinned its template) and ran
/// while the request was preprocessed gives: the wait after preprocessing is shorter
/// than the read by at least half of preprocessing. A read that started only after
/// preprocessing is waited for in full (`waited >= read`).
fn overlapped(m: &Prefetch) -> Result<(), String> {
    let margin = m.preprocess / 2.0;
    if m.waited < m.read - margin {
        Ok(())
    } else {
        Err(format!(
            "waited {:.1} ms for a {:.1} ms read after {:.1} ms of preprocessing: not less than \
             the read less half of preprocessing ({:.1} ms)",
            m.waited * 1e3,
            m.read * 1e3,
            m.preprocess * 1e3,
            (m.read - margin) * 1e3
        ))
    }
}

/// The steps read the template at memory speed, the slab loader keeping ahead of
/// compute: what their compute waited for slabs (the bubble) is under a tenth of the
/// edit's denoise time, and under a hundredth of the read. Steps that waited on slow
/// slab reads (a template read at disk speed, or slabs loaded in turn with compute
/// when each load is not negligible) spend most of their time in the bubble. (Measured:
/// 1 to 3 us in 75 to 220 ms of steps, after a 1.5 s read; with slab reads slowed to
/// 5 ms each, 68 ms in 156 ms.) The bubble cannot tell when the disk read ran: the
/// denoise stage starts once the template is in memory.
fn streamed_from_memory(m: &Prefetch) -> Result<(), String> {
    if m.bubble < m.denoised / 10.0 && m.bubble < m.read / 100.0 {
        Ok(())
    } else {
        Err(format!(
            "the steps waited {:.3} ms for slabs in {:.2} ms of denoising, after a {:.1} ms read",
            m.bubble * 1e3,
            m.denoised * 1e3,
            m.read * 1e3
        ))
    }
}

/// The denoise worker keeps no template resident (`resident_template_bytes = 1`), so
/// every step streams the template from the host tier and its waits show in the bubble
/// metric: a template on disk is read while the request is preprocessed (the pin
/// starts the read), and its steps read it at memory speed.
#[test]
fn an_edit_of_a_template_on_disk_loads_it_during_preprocessing() {
    let m = edit_from_disk(&format!("cache:slow_read_ms={SLOW_READ_MS}"));
    let (load, slabs) = (overlapped(&m), streamed_from_memory(&m));
    assert!(load.is_ok() && slabs.is_ok(), "{load:?}; {slabs:?}");
}

/// The check above catches a load that starts only after preprocessing: with the pin
/// not starting the read (`cache:no_prefetch`), the router's `Load` starts it when the
/// denoise stage needs it, and `overlapped` fails.
#[test]
fn a_template_load_that_starts_after_preprocessing_fails_the_prefetch_check() {
    let m = edit_from_disk(&format!(
        "cache:slow_read_ms={SLOW_READ_MS},cache:no_prefetch"
    ));
    let e = overlapped(&m).expect_err("a load after preprocessing passed the prefetch check");
    println!("as expected: {e}");
    assert!(m.waited >= m.read, "{m:?}");
}
