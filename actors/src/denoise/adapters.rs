//! LoRAs in the denoise loop: bounded asynchronous loading (docs/design.md §Adapters).
//!
//! A request that names LoRAs the device does not hold starts at once on the base
//! weights while the loader (its own thread) reads them. At the first step boundary
//! after a load completes, the loop uploads the adapter and every request whose whole
//! set is now on the device runs with it from its next step (unmerged, so the batch is
//! unaffected). A request never runs step `patch_by` (its K) or later without its set:
//! it is held there (`BatchScheduler::hold`), the rest of the batch going on, until the
//! load lands. With K = 0 a request waits for its set before its first step, which is
//! synchronous loading.
//!
//! Adapters stay on the device, least recently used first out, up to `slots` of them
//! that no live request uses.

use crate::wire::JobId;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Sender};
use denoised_models::flux::adapters::{LoraId, LoraUse};
use denoised_models::flux::lora::LoraFile;
use denoised_models::flux::stepper::Stepper;
use denoised_models::FluxConfig;

use super::{Event, LoopCommand, LoopSender};
use crate::batching::BatchScheduler;

/// The file or directory of adapter `name` under `dir`: `NAME.safetensors`, or a
/// directory `NAME/` (holding `pytorch_lora_weights.safetensors`). Names are plain
/// (letters, digits, `.`, `_`, `-`; not starting with `.`), so a request can name
/// nothing outside `dir`.
pub fn adapter_path(dir: &std::path::Path, name: &str) -> Result<PathBuf, String> {
    check_name(name)?;
    let file = dir.join(format!("{name}.safetensors"));
    if file.is_file() {
        return Ok(file);
    }
    let d = dir.join(name);
    if d.is_dir() {
        return Ok(d);
    }
    Err(format!(
        "no adapter `{name}` (looked for {} and {}/)",
        file.display(),
        d.display()
    ))
}

/// Checks an adapter name (see [`adapter_path`]).
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "adapter name {name:?}: 1-128 letters, digits, '.', '_' or '-', not starting with '.'"
        ))
    }
}

/// One LoRA of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraRequest {
    /// The adapter's name (its identity on this worker).
    pub name: String,
    /// Its file or directory.
    pub path: PathBuf,
    pub scale: f32,
    /// K: the first step the request may not run without it.
    pub patch_by: usize,
}

/// How the loop serves LoRAs ([`super::LoopOptions::adapters`]).
#[derive(Clone, Debug)]
pub struct AdapterOptions {
    /// The transformer's config, which every file is checked against.
    pub config: FluxConfig,
    /// LoRAs kept on the device beyond those in use.
    pub slots: usize,
    /// Read bandwidth of the loader, bytes per second (None: as fast as the disk).
    pub throttle_bytes_per_s: Option<f64>,
}

/// The loader thread: reads and checks LoRA files off the loop thread, throttled to a
/// bandwidth when configured, and hands each result to the loop as a command.
pub struct LoraLoader {
    jobs: Option<Sender<(String, PathBuf)>>,
    thread: Option<JoinHandle<()>>,
}

impl LoraLoader {
    pub fn spawn(opts: &AdapterOptions, to_loop: LoopSender) -> Result<Self, String> {
        let (tx, rx) = unbounded::<(String, PathBuf)>();
        let (config, throttle) = (opts.config.clone(), opts.throttle_bytes_per_s);
        let thread = std::thread::Builder::new()
            .name("lora-loader".into())
            .spawn(move || {
                for (name, path) in rx {
                    let t0 = Instant::now();
                    let result = LoraFile::open(&path, &config).map(Arc::new);
                    if let (Ok(f), Some(rate)) = (&result, throttle) {
                        // A disk (or network volume) of this bandwidth: the load ends
                        // no sooner than its bytes take to read.
                        let bytes = 4.0 * f.params() as f64;
                        let due = Duration::from_secs_f64(bytes / rate);
                        if let Some(rest) = due.checked_sub(t0.elapsed()) {
                            std::thread::sleep(rest);
                        }
                    }
                    to_loop.send(LoopCommand::LoraLoaded {
                        name,
                        result: result.map_err(|e| e.to_string()),
                        seconds: t0.elapsed().as_secs_f64(),
                    });
                }
            })
            .map_err(|e| format!("cannot start the LoRA loader: {e}"))?;
        Ok(LoraLoader {
            jobs: Some(tx),
            thread: Some(thread),
        })
    }

    fn load(&self, name: String, path: PathBuf) {
        if let Some(tx) = &self.jobs {
            let _ = tx.send((name, path));
        }
    }
}

impl Drop for LoraLoader {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Resident {
    id: LoraId,
    /// Live requests naming it.
    users: usize,
    /// When it was last named (a counter), for the LRU.
    used: u64,
}

/// The loop's adapters: on the device, loading, and the requests waiting for them.
pub(super) struct LoopAdapters {
    loader: LoraLoader,
    resident: HashMap<String, Resident>,
    loading: HashSet<String>,
    /// Requests whose set is not applied yet, with it.
    pending: HashMap<JobId, Vec<LoraRequest>>,
    /// Every live request's set (to release its adapters when it leaves).
    sets: HashMap<JobId, Vec<String>>,
    slots: usize,
    tick: u64,
}

impl LoopAdapters {
    pub fn new(opts: &AdapterOptions, to_loop: LoopSender) -> Result<Self, String> {
        Ok(LoopAdapters {
            loader: LoraLoader::spawn(opts, to_loop)?,
            resident: HashMap::new(),
            loading: HashSet::new(),
            pending: HashMap::new(),
            sets: HashMap::new(),
            slots: opts.slots,
            tick: 0,
        })
    }

    /// A request arrives with `loras`: the loads it needs start now.
    pub fn submit(&mut self, id: JobId, loras: Vec<LoraRequest>) {
        if loras.is_empty() {
            return;
        }
        self.tick += 1;
        for l in &loras {
            match self.resident.get_mut(&l.name) {
                Some(r) => {
                    r.users += 1;
                    r.used = self.tick;
                }
                None => {
                    if self.loading.insert(l.name.clone()) {
                        self.loader.load(l.name.clone(), l.path.clone());
                    }
                }
            }
        }
        self.sets
            .insert(id, loras.iter().map(|l| l.name.clone()).collect());
        self.pending.insert(id, loras);
    }

    /// Applies the set of every admitted pending request whose adapters are all on the
    /// device, and holds, at their K, those whose are not. Returns whether it held or
    /// released a request (the loop then plans again).
    pub fn gate(
        &mut self,
        sched: &mut BatchScheduler,
        model: &mut dyn Stepper,
        tx: &Sender<Event>,
    ) -> bool {
        let mut changed = false;
        let ids: Vec<JobId> = self.pending.keys().copied().collect();
        for id in ids {
            let Some(at) = model.position(id) else {
                continue; // not admitted yet
            };
            let set = &self.pending[&id];
            if set.iter().all(|l| self.resident.contains_key(&l.name)) {
                let uses: Vec<LoraUse> = set
                    .iter()
                    .map(|l| LoraUse {
                        id: self.resident[&l.name].id,
                        scale: l.scale,
                    })
                    .collect();
                match model.set_loras(id, uses) {
                    Ok(()) => {
                        self.pending.remove(&id);
                        changed |= sched.release(id);
                        let _ = tx.send(Event::LoraApplied { id, step: at });
                    }
                    Err(e) => tracing::warn!("request {id:x}: its LoRAs were not set: {e}"),
                }
            } else if at >= set.iter().map(|l| l.patch_by).min().unwrap_or(0) && !sched.is_held(id)
            {
                changed |= sched.hold(id);
            }
        }
        changed
    }

    /// A load finished: the adapter goes to the device (or its requests fail). Returns
    /// the requests that failed, each with the reason.
    pub fn loaded(
        &mut self,
        name: String,
        result: Result<Arc<LoraFile>, String>,
        model: &mut dyn Stepper,
    ) -> Vec<(JobId, String)> {
        self.loading.remove(&name);
        let users: Vec<JobId> = self
            .sets
            .iter()
            .filter(|(_, s)| s.contains(&name))
            .map(|(id, _)| *id)
            .collect();
        let error = match result.and_then(|f| model.add_lora(&f).map_err(|e| e.to_string())) {
            Ok(id) => {
                self.tick += 1;
                self.resident.insert(
                    name,
                    Resident {
                        id,
                        users: users.len(),
                        used: self.tick,
                    },
                );
                self.evict(model);
                return vec![];
            }
            Err(e) => e,
        };
        users
            .into_iter()
            .map(|id| (id, format!("LoRA `{name}` could not be loaded: {error}")))
            .collect()
    }

    /// A request left (finished, failed or cancelled): its adapters may go.
    pub fn leave(&mut self, id: JobId, model: &mut dyn Stepper) {
        self.pending.remove(&id);
        let Some(set) = self.sets.remove(&id) else {
            return;
        };
        for name in set {
            if let Some(r) = self.resident.get_mut(&name) {
                r.users = r.users.saturating_sub(1);
            }
        }
        self.evict(model);
    }

    /// Drops the least recently used idle adapters beyond `slots`.
    fn evict(&mut self, model: &mut dyn Stepper) {
        loop {
            let idle: Vec<(&String, &Resident)> =
                self.resident.iter().filter(|(_, r)| r.users == 0).collect();
            if idle.len() <= self.slots {
                return;
            }
            let name = idle
                .iter()
                .min_by_key(|(_, r)| r.used)
                .map(|(n, _)| (*n).clone())
                .expect("idle is not empty");
            let r = self.resident.remove(&name).expect("resident");
            if let Err(e) = model.remove_lora(r.id) {
                tracing::warn!("LoRA `{name}` was not dropped: {e}");
            }
        }
    }
}
