//! Fault injection at loopback scale (Jepsen's idea; docs/cluster.md): three pods and a
//! real etcd as their template registry; clients create, replace, delete and edit a few
//! templates through random pods while a nemesis kills pods (-9), pauses one's
//! processes (SIGSTOP) for longer than the failure bound, cuts one off its peers and
//! the registry (`DENOISED_FAULT_CUT`, actors/src/fault.rs), and restarts etcd. Every
//! request's start, end and outcome are recorded, and a checker over the history
//! (`check`, tested on its own below) finds:
//! - an edit answered with an image of a version other than the newest acknowledged
//!   at its start (or one written concurrently with it): a stale or a deleted version;
//! - an acknowledged template lost: an edit answered 404 while the newest acknowledged
//!   write of its template at its start was a create or replace and nothing changed it
//!   meanwhile, or a template whose last acknowledged write is a create or replace that
//!   no pod serves (at that version) once the faults stop;
//! - a request that took longer than its deadline.
//!
//! Unavailability (503, 429, 504; a refused connection to a killed pod) is allowed:
//! the checker asks for safety, not for answers during faults.
//!
//! The run lasts `DENOISED_NEMESIS_SECONDS` (60 by default). With
//! `DENOISED_NEMESIS_REGISTRY=off` the pods run without a registry (each keeps its own
//! identity, as before the registry), and the checker finds what that allows.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::pods::*;
use common::*;
use serde_json::{json, Value};

/// A request's bound: a forwarded edit's (three stage timeouts of 8 s) with room for a
/// capture's lease wait; the client gives up a little later, and a request answered
/// after its deadline is a violation however it ends.
const DEADLINE: Duration = Duration::from_secs(30);
const IDS: [&str; 3] = ["t0", "t1", "t2"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Create,
    Replace,
    Delete,
    Edit,
}

/// One request as the client saw it (`pod` and `detail` are read in the report, through
/// `Debug`).
#[derive(Clone, Debug)]
#[allow(dead_code)]
struct Op {
    kind: Kind,
    id: &'static str,
    pod: usize,
    /// Seconds since the run started.
    start: f64,
    end: f64,
    /// The HTTP status (0: no answer: refused connection or the client's timeout).
    status: u16,
    timed_out: bool,
    /// A create's or replace's new version, a delete's deleted one, an edit's
    /// `template_version`.
    version: Option<u64>,
    detail: String,
}

impl Op {
    fn acked_write(&self) -> bool {
        match self.kind {
            Kind::Create | Kind::Replace => self.status == 201,
            Kind::Delete => self.status == 200,
            Kind::Edit => false,
        }
    }

    /// A write whose effect is unknown: no answer, or an error that may have come after
    /// its commit (a 409 or 404 is a refusal, which changed nothing).
    fn maybe_write(&self) -> bool {
        self.kind != Kind::Edit && !self.acked_write() && ![400, 404, 409].contains(&self.status)
    }
}

/// What the checker found, one line each.
fn check(history: &[Op]) -> Vec<String> {
    let mut bad = vec![];
    for op in history {
        if op.timed_out || op.end - op.start > DEADLINE.as_secs_f64() {
            bad.push(format!(
                "over its deadline ({:.1} s): {op:?}",
                op.end - op.start
            ));
        }
    }
    for e in history.iter().filter(|o| o.kind == Kind::Edit) {
        let writes: Vec<&Op> = history
            .iter()
            .filter(|w| w.id == e.id && w.kind != Kind::Edit)
            .collect();
        // The newest acknowledged write at the edit's start (versions grow per id, a
        // delete after the version it deletes).
        let newest = writes
            .iter()
            .filter(|w| w.acked_write() && w.end < e.start)
            .max_by_key(|w| (w.version, w.kind == Kind::Delete));
        // Writes concurrent with the edit (started before it ended, not acknowledged
        // before it started): it may see them. A write whose outcome the client never
        // learnt may have taken effect at any time after it started.
        let concurrent: Vec<&&Op> = writes
            .iter()
            .filter(|w| w.start < e.end && !(w.acked_write() && w.end < e.start))
            .filter(|w| w.acked_write() || w.maybe_write())
            .collect();
        let live = newest.filter(|w| w.kind != Kind::Delete);
        match e.status {
            200 => {
                let v = e.version;
                let acked = |v: Option<u64>| {
                    writes.iter().any(|w| w.kind != Kind::Delete && w.acked_write() && w.version == v)
                };
                let ok = live.is_some_and(|w| w.version == v)
                    // A concurrent acknowledged create or replace.
                    || concurrent
                        .iter()
                        .any(|w| w.kind != Kind::Delete && w.acked_write() && w.version == v)
                    // An unknown version, newer than the newest acknowledged, of a
                    // create or replace whose outcome is unknown.
                    || (!acked(v)
                        && v > newest.and_then(|w| w.version)
                        && concurrent.iter().any(|w| w.kind != Kind::Delete && w.maybe_write()));
                if !ok {
                    bad.push(format!(
                        "edit read version {v:?}, the newest acknowledged at its start was {:?}: {e:?}{}",
                        newest.map(|w| (w.kind, w.version)),
                        around(&writes, e)
                    ));
                }
            }
            404 if live.is_some() && concurrent.is_empty() => bad.push(format!(
                "edit answered 404, yet version {:?} was acknowledged and nothing changed it: {e:?}",
                live.and_then(|w| w.version)
            )),
            _ => {}
        }
    }
    bad
}

/// The writes of an edit's template from 10 s before it to its end, one a line: what a
/// violation is read against.
fn around(writes: &[&Op], e: &Op) -> String {
    let mut near: Vec<&&Op> = writes
        .iter()
        .filter(|w| w.end > e.start - 10.0 && w.start < e.end)
        .collect();
    near.sort_by(|a, b| a.start.total_cmp(&b.start));
    near.iter().map(|w| format!("\n    {w:?}")).collect()
}

/// Writes the pods' logs into `DENOISED_NEMESIS_LOGS` when it drops, if that is set.
struct KeepLogs<'a>(&'a [Pod]);

impl Drop for KeepLogs<'_> {
    fn drop(&mut self) {
        if let Ok(dir) = std::env::var("DENOISED_NEMESIS_LOGS") {
            for p in self.0 {
                let _ = std::fs::write(format!("{dir}/{}.log", p.name), p.log_text());
            }
        }
    }
}

/// The pods' current HTTP addresses (`None` while one is down).
type Urls = Arc<Mutex<Vec<Option<String>>>>;

fn client(n: usize, urls: Urls, t0: Instant, stop: Arc<AtomicBool>) -> Vec<Op> {
    let http = reqwest::blocking::Client::builder()
        .timeout(DEADLINE + Duration::from_secs(5))
        .build()
        .unwrap();
    let mut rng = n as u64 * 0x9e37_79b9 + 1;
    let mut next = move |m: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % m
    };
    let mut history = vec![];
    while !stop.load(Ordering::Relaxed) {
        let pod = next(3) as usize;
        let Some(url) = urls.lock().unwrap()[pod].clone() else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let id = IDS[next(IDS.len() as u64) as usize];
        let kind = match next(20) {
            0..=2 => Kind::Create,
            3..=5 => Kind::Replace,
            6..=7 => Kind::Delete,
            _ => Kind::Edit,
        };
        let seed = next(1 << 20);
        let template = |replace: bool| {
            json!({"image": image_b64(), "id": id, "steps": 4, "seed": seed,
                   "prompt": "a room", "replace": replace})
        };
        let req = match kind {
            Kind::Create => http
                .post(format!("{url}/v1/templates"))
                .json(&template(false)),
            Kind::Replace => http
                .post(format!("{url}/v1/templates"))
                .json(&template(true)),
            Kind::Delete => http.delete(format!("{url}/v1/templates/{id}")),
            Kind::Edit => http
                .post(format!("{url}/v1/edits"))
                .json(&edit_body(id, seed)),
        };
        let start = t0.elapsed().as_secs_f64();
        let r = req.send().and_then(|r| {
            let status = r.status().as_u16();
            r.json::<Value>().map(|v| (status, v))
        });
        let end = t0.elapsed().as_secs_f64();
        let (status, timed_out, version, detail) = match r {
            Ok((s, v)) => {
                let version = match kind {
                    Kind::Edit => v["template_version"].as_u64(),
                    _ => v["version"].as_u64(),
                };
                // A refusal's reason; for an edit served, the pod that ran it.
                let detail = match (v["error"]["message"].as_str(), v["pod"].as_str()) {
                    (Some(m), _) => m.to_string(),
                    (None, Some(pod)) => format!("ran at {pod}"),
                    (None, None) => String::new(),
                };
                (s, false, version, detail)
            }
            Err(e) => (0, e.is_timeout(), None, e.to_string()),
        };
        // A client backs off after a refusal or no answer (as `Retry-After` asks).
        if status == 0 || status >= 500 || status == 429 {
            std::thread::sleep(Duration::from_millis(100));
        }
        history.push(Op {
            kind,
            id,
            pod,
            start,
            end,
            status,
            timed_out,
            version,
            detail,
        });
    }
    history
}

/// The faults, in turn, each followed by a calm: a pod killed (-9) and restarted, a
/// pod paused for longer than the failure bound, a pod cut off, etcd restarted.
fn nemesis(
    pods: &mut [Pod],
    etcd: &mut Etcd,
    keys: &str,
    urls: &Urls,
    t0: Instant,
    until: Duration,
) -> Vec<String> {
    let all: Vec<String> = pods.iter().map(Pod::addr).collect();
    let mut faults = vec![];
    let mut turn = 0usize;
    while t0.elapsed() < until {
        std::thread::sleep(Duration::from_secs(3));
        let p = turn % pods.len();
        let at = t0.elapsed().as_secs_f64();
        match turn % 4 {
            0 => {
                urls.lock().unwrap()[p] = None;
                signal_all(pods[p].d(), libc::SIGKILL);
                pods[p].d = None;
                if let Ok(dir) = std::env::var("DENOISED_NEMESIS_LOGS") {
                    let to = format!("{dir}/{}.log.{turn}", pods[p].name);
                    std::fs::write(to, pods[p].log_text()).unwrap();
                }
                std::thread::sleep(Duration::from_secs(1));
                pods[p].start_with(&all, COOKIE, keys);
                urls.lock().unwrap()[p] = Some(pods[p].d().url.clone());
                faults.push(format!(
                    "{at:.1} s: pod {} killed (-9), restarted",
                    pods[p].name
                ));
            }
            1 => {
                signal_all(pods[p].d(), libc::SIGSTOP);
                std::thread::sleep(Duration::from_secs(5));
                signal_all(pods[p].d(), libc::SIGCONT);
                faults.push(format!("{at:.1} s: pod {} paused 5 s", pods[p].name));
            }
            2 => {
                std::fs::write(pods[p].cut_switch(), b"").unwrap();
                std::thread::sleep(Duration::from_secs(5));
                std::fs::remove_file(pods[p].cut_switch()).unwrap();
                faults.push(format!("{at:.1} s: pod {} cut off 5 s", pods[p].name));
            }
            _ => {
                etcd.kill();
                std::thread::sleep(Duration::from_secs(2));
                etcd.restart();
                faults.push(format!("{at:.1} s: etcd killed, restarted 2 s later"));
            }
        }
        turn += 1;
    }
    faults
}

/// After the faults: every template whose last acknowledged write (with no write of
/// unknown effect after it) is a create or replace is served at that version by
/// every pod.
fn final_reads(pods: &[Pod], history: &[Op]) -> Vec<String> {
    let mut bad = vec![];
    for id in IDS {
        let writes: Vec<&Op> = history
            .iter()
            .filter(|w| w.id == id && w.kind != Kind::Edit)
            .collect();
        let Some(last) = writes
            .iter()
            .filter(|w| w.acked_write())
            .max_by_key(|w| (w.version, w.kind == Kind::Delete))
        else {
            continue;
        };
        if last.kind == Kind::Delete
            || writes
                .iter()
                .any(|w| w.maybe_write() && w.start > last.start)
        {
            continue;
        }
        for p in pods {
            let (s, v) = p.d().post("/v1/edits", &edit_body(id, 1));
            if s != 200 || v["template_version"].as_u64() != last.version {
                bad.push(format!(
                    "template {id}: acknowledged version {:?}, pod {} answered {s} {}",
                    last.version,
                    p.name,
                    v.get("template_version")
                        .or(v.get("error"))
                        .unwrap_or(&Value::Null)
                ));
            }
        }
    }
    bad
}

#[test]
fn no_fault_makes_a_pod_serve_a_stale_lost_or_deleted_template() {
    const TEST: &str = "no_fault_makes_a_pod_serve_a_stale_lost_or_deleted_template";
    let _one = one_cluster_at_a_time();
    let Some(mut etcd) = Etcd::start(TEST) else {
        return;
    };
    let with_registry = std::env::var("DENOISED_NEMESIS_REGISTRY").as_deref() != Ok("off");
    let seconds: u64 = std::env::var("DENOISED_NEMESIS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let mut keys = match with_registry {
        true => format!(
            "registry = [{:?}]\nregistry_lease_seconds = 1.0\n",
            etcd.endpoint()
        ),
        false => String::new(),
    };
    keys.push_str("[server]\nstage_timeout_seconds = 8\n");
    let mut pods = start_three(&keys);
    let urls: Urls = Arc::new(Mutex::new(
        pods.iter().map(|p| Some(p.d().url.clone())).collect(),
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let clients: Vec<_> = (0..3)
        .map(|n| {
            let (urls, stop) = (urls.clone(), stop.clone());
            std::thread::spawn(move || client(n, urls, t0, stop))
        })
        .collect();
    let faults = nemesis(
        &mut pods,
        &mut etcd,
        &keys,
        &urls,
        t0,
        Duration::from_secs(seconds),
    );
    stop.store(true, Ordering::Relaxed);
    let history: Vec<Op> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();

    // The pods' logs, for a closer look at a failed run (`DENOISED_NEMESIS_LOGS=DIR`,
    // with `DENOISED_TEST_LOG=info`), kept however the test ends.
    let _logs = KeepLogs(&pods);
    // Healed: every pod up and reconciled, then the final reads.
    for p in &pods {
        p.wait_for("its peers up", Duration::from_secs(30), |v| {
            v.iter().filter(|x| x.1 == "up").count() == 2
        });
    }
    std::thread::sleep(Duration::from_secs(2));
    let mut bad = check(&history);
    bad.extend(final_reads(&pods, &history));

    println!("faults ({}):", faults.len());
    for f in &faults {
        println!("  {f}");
    }
    println!("operations ({}), by kind and status:", history.len());
    let mut outcomes = std::collections::BTreeMap::<(String, u16), usize>::new();
    for o in &history {
        *outcomes
            .entry((format!("{:?}", o.kind), o.status))
            .or_default() += 1;
    }
    for ((kind, status), n) in &outcomes {
        println!("  {kind:8} {status:3}: {n}");
    }
    // The commonest refusals, with their reasons.
    let mut reasons = std::collections::BTreeMap::<(String, u16, String), usize>::new();
    for o in history.iter().filter(|o| ![200, 201].contains(&o.status)) {
        let why: String = o.detail.chars().take(90).collect();
        *reasons
            .entry((format!("{:?}", o.kind), o.status, why))
            .or_default() += 1;
    }
    let mut reasons: Vec<_> = reasons.into_iter().collect();
    reasons.sort_by_key(|r| std::cmp::Reverse(r.1));
    for ((kind, status, why), n) in reasons.iter().take(12) {
        println!("  {n:5} x {kind} {status}: {why}");
    }
    // The whole history, for a closer look (`DENOISED_NEMESIS_HISTORY=PATH`).
    if let Ok(path) = std::env::var("DENOISED_NEMESIS_HISTORY") {
        let mut sorted = history.clone();
        sorted.sort_by(|a, b| a.start.total_cmp(&b.start));
        let text: Vec<String> = sorted.iter().map(|o| format!("{o:?}")).collect();
        std::fs::write(path, text.join("\n")).unwrap();
    }
    println!("violations ({}):", bad.len());
    for b in &bad {
        println!("  {b}");
    }
    drop(_logs);
    drop(pods);
    assert!(
        history
            .iter()
            .filter(|o| o.kind == Kind::Edit && o.status == 200)
            .count()
            > 10
    );
    assert!(bad.is_empty(), "{} violations (above)", bad.len());
}

/// The checker finds each kind of violation in a history made up to have it, and
/// passes the same history without it.
#[test]
fn the_checker_finds_stale_lost_and_slow_answers() {
    let op = |kind, start: f64, end: f64, status, version| Op {
        kind,
        id: "t0",
        pod: 0,
        start,
        end,
        status,
        timed_out: false,
        version,
        detail: String::new(),
    };
    let created = op(Kind::Create, 0.0, 1.0, 201, Some(10));
    let replaced = op(Kind::Replace, 2.0, 3.0, 201, Some(20));
    let deleted = op(Kind::Delete, 5.0, 6.0, 200, Some(20));
    let fine = vec![
        created.clone(),
        replaced.clone(),
        op(Kind::Edit, 3.5, 4.0, 200, Some(20)),
        // Concurrent with the replace: either version.
        op(Kind::Edit, 2.5, 2.9, 200, Some(10)),
        op(Kind::Edit, 2.5, 3.1, 200, Some(20)),
        deleted.clone(),
        op(Kind::Edit, 7.0, 7.5, 404, None),
        op(Kind::Edit, 7.0, 7.5, 503, None),
    ];
    assert_eq!(check(&fine), Vec::<String>::new());
    let with = |extra: Op| {
        let mut h = fine.clone();
        h.push(extra);
        check(&h)
    };
    // A stale version after the replace was acknowledged.
    assert_eq!(with(op(Kind::Edit, 4.0, 4.5, 200, Some(10))).len(), 1);
    // A deleted template back.
    assert_eq!(with(op(Kind::Edit, 8.0, 8.5, 200, Some(20))).len(), 1);
    // A version nobody acknowledged, with no write of unknown outcome to explain it.
    assert_eq!(with(op(Kind::Edit, 4.0, 4.5, 200, Some(30))).len(), 1);
    // ... which a replace that ended in a 503 (it may have committed) explains.
    let mut h = fine.clone();
    h.push(op(Kind::Replace, 3.2, 3.8, 503, None));
    h.push(op(Kind::Edit, 4.0, 4.5, 200, Some(30)));
    assert_eq!(check(&h), Vec::<String>::new());
    // An acknowledged template lost.
    assert_eq!(with(op(Kind::Edit, 4.0, 4.5, 404, None)).len(), 1);
    // Over the deadline.
    let slow = DEADLINE.as_secs_f64() + 1.0;
    assert_eq!(with(op(Kind::Edit, 7.0, 7.0 + slow, 503, None)).len(), 1);
}
