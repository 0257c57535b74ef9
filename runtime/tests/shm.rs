//! Multi-process tests of the shared-memory arenas, and the 1 MiB latent hand-off timing.
//!
//! Child processes are this test binary re-run with `--exact child_entry` and
//! `DENOISED_SHM_CHILD` set; `child_entry` does nothing unless that variable is set.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use denoised_runtime::shm::{list_arenas, reclaim_dead, Arena, ArenaView, Handle, ShmError};
use denoised_runtime::{DType, Tensor};

const CHILD_ENV: &str = "DENOISED_SHM_CHILD";

fn child(mode: &str, dir: &Path, args: &[(&str, String)]) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, mode)
        .env("SHM_DIR", dir);
    for (k, v) in args {
        c.env(k, v);
    }
    c
}

fn env_handle(key: &str) -> Handle {
    serde_json::from_str(&std::env::var(key).unwrap()).unwrap()
}

/// Child-process entry point (a no-op in a normal test run).
#[test]
fn child_entry() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let dir = PathBuf::from(std::env::var("SHM_DIR").unwrap());
    match mode.as_str() {
        // Attach to the parent's arena, read the input, write 2*x + 1 into the output.
        "double" => {
            let input = env_handle("IN_HANDLE");
            let output = env_handle("OUT_HANDLE");
            let mut view = ArenaView::attach_rw(&dir, "mp", "parent").unwrap();
            let x = view.read_tensor(&input).unwrap();
            let y: Vec<f32> = x.data().iter().map(|v| 2.0 * v + 1.0).collect();
            view.write_f32(&output, &y).unwrap();
            // a freed handle must be stale in this process too
            let stale = env_handle("STALE_HANDLE");
            match view.read_tensor(&stale) {
                Err(ShmError::StaleHandle { .. }) => {}
                other => panic!("expected a stale handle, got {other:?}"),
            }
            println!("CHILD_DONE");
        }
        // Own an arena, announce it, and wait to be killed.
        "owner" => {
            let mut a = Arena::create(&dir, "mp", "child", 1 << 20).unwrap();
            let h = a
                .write_tensor(&Tensor::new(vec![4], vec![1.0, 2.0, 3.0, 4.0]).unwrap())
                .unwrap();
            println!("CHILD_READY {}", serde_json::to_string(&h).unwrap());
            std::thread::sleep(Duration::from_secs(120));
            drop(a);
        }
        m => panic!("unknown child mode {m}"),
    }
}

#[test]
fn second_process_reads_and_writes_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut arena = Arena::create(dir.path(), "mp", "parent", 4 << 20).unwrap();
    let n = 4096 * 64;
    let x = Tensor::new(vec![4096, 64], (0..n).map(|i| i as f32 * 0.25).collect()).unwrap();
    let input = arena.write_tensor(&x).unwrap();
    let output = arena.alloc(DType::F32, &[4096, 64]).unwrap();
    let freed = arena.write_tensor(&Tensor::zeros(vec![8])).unwrap();
    arena.free(&freed).unwrap();

    let out = child(
        "double",
        dir.path(),
        &[
            ("IN_HANDLE", serde_json::to_string(&input).unwrap()),
            ("OUT_HANDLE", serde_json::to_string(&output).unwrap()),
            ("STALE_HANDLE", serde_json::to_string(&freed).unwrap()),
        ],
    )
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD_DONE"),
        "child failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let y = arena.read_tensor(&output).unwrap();
    assert_eq!(y.shape(), &[4096, 64]);
    for (a, b) in x.data().iter().zip(y.data()) {
        assert_eq!(*b, 2.0 * a + 1.0);
    }
    arena.free(&input).unwrap();
    arena.free(&output).unwrap();
    assert_eq!(arena.live_slices(), 0);
}

#[test]
fn killed_owner_is_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let mut proc = child("owner", dir.path(), &[])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(proc.stdout.take().unwrap()).lines();
    let handle: Handle = loop {
        let line = lines
            .next()
            .expect("child exited before it was ready")
            .unwrap();
        // libtest prints "test child_entry ... " on the same line, before our output
        if let Some((_, json)) = line.split_once("CHILD_READY ") {
            break serde_json::from_str(json).unwrap();
        }
    };
    let path = dir.path().join("denoised-mp-child");
    assert!(path.exists());

    // While the owner lives: attachable, readable, and not reclaimed.
    let view = ArenaView::attach(dir.path(), "mp", "child").unwrap();
    assert_eq!(view.owner_pid(), proc.id());
    assert_eq!(view.slice_f32(&handle).unwrap(), &[1.0, 2.0, 3.0, 4.0]);
    assert!(reclaim_dead(dir.path(), "mp").unwrap().is_empty());
    assert!(list_arenas(dir.path(), "mp").unwrap()[0].owner_alive);

    proc.kill().unwrap(); // SIGKILL: no destructors run, the file stays behind
    proc.wait().unwrap();
    assert!(path.exists(), "a SIGKILLed owner cannot clean up");

    assert_eq!(reclaim_dead(dir.path(), "mp").unwrap(), ["child"]);
    assert!(!path.exists());
    // the existing mapping stays readable after the file is gone
    assert_eq!(view.slice_f32(&handle).unwrap(), &[1.0, 2.0, 3.0, 4.0]);
}

/// Hand-off of a 1024² FLUX latent ([4096, 64] f32 = 1 MiB) between two mappings of
/// the same arena. Prints timings; asserts nothing about wall-clock time.
#[test]
fn handoff_timing_1mib_latent() {
    let dir = tempfile::tempdir().unwrap();
    let mut owner = Arena::create(dir.path(), "bench", "latents", 64 << 20).unwrap();
    let reader = ArenaView::attach(dir.path(), "bench", "latents").unwrap();
    let n = 4096 * 64;
    let t = Tensor::new(vec![4096, 64], (0..n).map(|i| (i % 97) as f32).collect()).unwrap();
    let bytes = (n * 4) as f64;
    let iters = 200;

    let mut write = Duration::ZERO;
    let mut read = Duration::ZERO;
    let mut borrow = Duration::ZERO;
    let mut borrow_sum = Duration::ZERO;
    let mut checksum = 0.0f64;
    for i in 0..iters + 10 {
        let t0 = Instant::now();
        let h = owner.write_tensor(&t).unwrap();
        let t1 = Instant::now();
        let back = reader.read_tensor(&h).unwrap();
        let t2 = Instant::now();
        let s = reader.slice_f32(&h).unwrap();
        let t3 = Instant::now();
        checksum += s.iter().map(|&v| v as f64).sum::<f64>();
        let t4 = Instant::now();
        assert_eq!(back.data()[n - 1], t.data()[n - 1]);
        owner.free(&h).unwrap();
        if i >= 10 {
            write += t1 - t0;
            read += t2 - t1;
            borrow += t3 - t2;
            borrow_sum += t4 - t3;
        }
    }
    let mut clone = Duration::ZERO;
    for _ in 0..iters {
        let t0 = Instant::now();
        let c = t.clone();
        clone += t0.elapsed();
        std::hint::black_box(c);
    }
    assert!(checksum > 0.0);
    let report = |what: &str, d: Duration| {
        let per = d.as_secs_f64() / iters as f64;
        println!(
            "shm hand-off 1 MiB: {what:<34} {:>8.1} µs  {:>6.2} GB/s",
            per * 1e6,
            bytes / per / 1e9
        );
    };
    report("write_tensor (alloc + copy in)", write);
    report("read_tensor (copy out, other map)", read);
    report("Vec clone (memcpy baseline)", clone);
    println!(
        "shm hand-off 1 MiB: {:<34} {:>8.3} µs  (no bytes move)",
        "slice_f32 (zero-copy borrow)",
        borrow.as_secs_f64() / iters as f64 * 1e6
    );
    report("sum over the borrowed slice", borrow_sum);
}
