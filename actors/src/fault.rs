//! What a worker process does when something goes wrong inside it, and the debug hook
//! that makes something go wrong on purpose.
//!
//! **Panics end the process.** A panic in any thread of a worker (the denoise loop, a
//! compute thread, an actor handler) would otherwise leave the process alive but
//! broken: its group membership stays, pending replies are never sent, and clients
//! wait. [`exit_on_panic`] makes every panic print its message and exit the process
//! with [`EXIT_PANIC`], so the router sees the worker lost (and retries its requests)
//! and the supervisor restarts it, exactly as after a kill.
//!
//! **Fault injection** (`DENOISED_FAULT`), for tests and drills: a comma-separated list
//! of `ROLE:FAULT` or `ROLE:FAULT=N`, e.g. `denoise:panic_at_step=3`. Each process reads
//! it once, at start ([`Faults::from_env`]); an absent fault costs the code it guards a
//! branch on a field. Faults:
//! - `panic_at_step=K` (denoise): the denoise loop thread panics before its K-th
//!   batched step (counting from 0 since the process started), in the role's first
//!   process only (incarnation 0), so the restarted worker serves normally and a test
//!   can check that the request it retried succeeds;
//! - `exit_at_start_from=K` (any role but the router): every process of the role from
//!   its K-th restart on exits with status 1 right after starting: a crash loop;
//! - `slow_step_ms=N` (denoise): the denoise loop sleeps N ms before each batched step,
//!   in every process of the role: a slow device, for deadlines;
//! - `slow_read_ms=N` (cache): each read of a template from the disk tier sleeps N ms
//!   before it starts (counted in its `denoised_template_disk_load_duration_seconds`): a
//!   slow disk, so that a test can tell a read that overlapped preprocessing from one
//!   that followed it;
//! - `slow_write_ms=N` (cache): each write of a template to the disk tier sleeps N ms
//!   before it starts: a slow disk, so that a test can tell whether a registration
//!   is answered before its template is on disk;
//! - `no_prefetch` (cache, no value): pinning a template that is only on disk does not
//!   start its read; the read starts when the router asks for the template's cache
//!   (`Load`), after preprocessing: the regression the prefetch test must catch;
//! - `claim_any_name` (router, no value): with `[cluster] tls_*`, the pod starts with a
//!   certificate that does not name it, which it otherwise refuses: an impostor, whose
//!   peers must refuse its name (tests/serve_cluster_security.rs).
//!
//! **A network cut** (`DENOISED_FAULT_CUT=PATH`, a pod's router): while the file PATH
//! exists, the pod is cut off its peers and its template registry, as by a network
//! partition that leaves its processes running: its calls to its peers and to etcd fail
//! at once and it answers none of its peers' calls ([`cut`]). A switch a test (or a
//! drill) flips at any moment, which `DENOISED_FAULT`, read at start, is not.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use crate::node::Role;

/// Whether this pod is cut off its peers and registry now (`DENOISED_FAULT_CUT`; see the
/// module docs). Off, it costs a branch on a static.
pub fn cut() -> bool {
    static SWITCH: OnceLock<Option<PathBuf>> = OnceLock::new();
    SWITCH
        .get_or_init(|| std::env::var_os("DENOISED_FAULT_CUT").map(PathBuf::from))
        .as_ref()
        .is_some_and(|p| p.exists())
}

/// Exit status of a worker that panicked (Rust's own status for a panicking main).
pub const EXIT_PANIC: i32 = 101;

/// Installs the panic hook of a worker process: the default report (message, location,
/// backtrace per `RUST_BACKTRACE`), then exit. Must be called before any thread starts.
pub fn exit_on_panic(process: String) {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        eprintln!("error: {process}: a thread panicked; the process exits to be restarted");
        std::process::exit(EXIT_PANIC);
    }));
}

/// The faults injected into one process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    pub panic_at_step: Option<u64>,
    pub exit_at_start: bool,
    /// Denoise: a sleep before each batched step.
    pub slow_step: Option<Duration>,
    /// Cache: a sleep before each template read from disk.
    pub slow_read: Option<Duration>,
    /// Cache: a sleep before each template write to disk.
    pub slow_write: Option<Duration>,
    /// Cache: a pin does not start a template's read from disk.
    pub no_prefetch: bool,
    /// Router: with TLS, starts with a certificate that does not name its pod.
    pub claim_any_name: bool,
}

/// The forms `DENOISED_FAULT` accepts, for its error message.
const KNOWN: &str = "denoise:panic_at_step=K, ROLE:exit_at_start_from=K, \
denoise:slow_step_ms=N, cache:slow_read_ms=N, cache:slow_write_ms=N, cache:no_prefetch \
or router:claim_any_name (K >= 0, N >= 1)";

impl Faults {
    pub const VAR: &'static str = "DENOISED_FAULT";

    /// The faults `DENOISED_FAULT` asks of `role`'s process of this `incarnation`. A
    /// malformed value is an error, so a drill that would silently test nothing does
    /// not start.
    pub fn from_env(role: Role, incarnation: u32) -> Result<Faults, String> {
        match std::env::var(Self::VAR) {
            Ok(spec) => Self::parse(&spec, role, incarnation),
            Err(_) => Ok(Faults::default()),
        }
    }

    fn parse(spec: &str, role: Role, incarnation: u32) -> Result<Faults, String> {
        let mut f = Faults::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = || format!("{}: `{item}` is not one of {KNOWN}", Self::VAR);
            let (r, fault) = item.split_once(':').ok_or_else(bad)?;
            let r: Role = r.parse()?;
            // `NAME=N` for the faults with a value, a bare `NAME` for the others.
            let (name, value) = match fault.split_once('=') {
                Some((name, v)) => (name, Some(v.parse::<u64>().map_err(|_| bad())?)),
                None => (fault, None),
            };
            let mine = r == role;
            let ms = |n: u64| mine.then(|| Duration::from_millis(n));
            match (name, value) {
                ("panic_at_step", Some(k)) if r == Role::Denoise => {
                    if mine && incarnation == 0 {
                        f.panic_at_step = Some(k);
                    }
                }
                ("exit_at_start_from", Some(k)) if r != Role::Router => {
                    f.exit_at_start |= mine && u64::from(incarnation) >= k;
                }
                ("slow_step_ms", Some(n)) if r == Role::Denoise && n > 0 => {
                    f.slow_step = f.slow_step.or(ms(n));
                }
                ("slow_read_ms", Some(n)) if r == Role::Cache && n > 0 => {
                    f.slow_read = f.slow_read.or(ms(n));
                }
                ("slow_write_ms", Some(n)) if r == Role::Cache && n > 0 => {
                    f.slow_write = f.slow_write.or(ms(n));
                }
                ("no_prefetch", None) if r == Role::Cache => f.no_prefetch |= mine,
                ("claim_any_name", None) if r == Role::Router => f.claim_any_name |= mine,
                _ => return Err(bad()),
            }
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_for_their_role_and_incarnation_only() {
        let spec = "denoise:panic_at_step=3, preprocess:exit_at_start_from=1";
        let f = Faults::parse(spec, Role::Denoise, 0).unwrap();
        assert_eq!(f.panic_at_step, Some(3));
        assert!(!f.exit_at_start);
        // The restarted denoise worker serves normally.
        assert_eq!(
            Faults::parse(spec, Role::Denoise, 1).unwrap(),
            Faults::default()
        );
        assert!(
            !Faults::parse(spec, Role::Preprocess, 0)
                .unwrap()
                .exit_at_start
        );
        assert!(
            Faults::parse(spec, Role::Preprocess, 1)
                .unwrap()
                .exit_at_start
        );
        assert!(
            Faults::parse(spec, Role::Preprocess, 7)
                .unwrap()
                .exit_at_start
        );
        for bad in [
            "denoise",
            "denoise:panic_at_step",
            "denoise:panic_at_step=x",
            "preprocess:panic_at_step=1",
            "router:exit_at_start_from=1",
            "gpu:panic_at_step=1",
            "denoise:explode=1",
            "denoise:slow_step_ms=0",
            "denoise:slow_step_ms",
            "cache:slow_step_ms=5",
            "denoise:slow_read_ms=5",
            "cache:slow_read_ms=-1",
            "cache:no_prefetch=1",
            "cache:slow_write_ms=0",
            "denoise:slow_write_ms=5",
            "router:no_prefetch",
            "cache:prefetch",
            "router:claim_any_name=1",
            "cache:claim_any_name",
        ] {
            assert!(Faults::parse(bad, Role::Denoise, 0).is_err(), "{bad}");
            assert!(Faults::parse(bad, Role::Cache, 0).is_err(), "{bad}");
        }
        let claim = "router:claim_any_name";
        assert!(
            Faults::parse(claim, Role::Router, 0)
                .unwrap()
                .claim_any_name
        );
        assert_eq!(Faults::parse(claim, Role::Cache, 0), Ok(Faults::default()));
    }

    #[test]
    fn slow_and_reordering_faults_hold_in_every_incarnation_of_their_role() {
        let spec = "denoise:slow_step_ms=40,cache:slow_read_ms=1500,cache:no_prefetch,cache:slow_write_ms=700";
        for incarnation in [0, 3] {
            let d = Faults::parse(spec, Role::Denoise, incarnation).unwrap();
            assert_eq!(
                d,
                Faults {
                    slow_step: Some(Duration::from_millis(40)),
                    ..Faults::default()
                }
            );
            let c = Faults::parse(spec, Role::Cache, incarnation).unwrap();
            assert_eq!(
                c,
                Faults {
                    slow_read: Some(Duration::from_millis(1500)),
                    slow_write: Some(Duration::from_millis(700)),
                    no_prefetch: true,
                    ..Faults::default()
                }
            );
        }
        assert_eq!(
            Faults::parse(spec, Role::Preprocess, 0).unwrap(),
            Faults::default()
        );
    }
}
