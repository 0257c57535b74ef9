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
//! of `ROLE:FAULT`, e.g. `denoise:panic_at_step=3`. Faults:
//! - `panic_at_step=K` (denoise): the denoise loop thread panics before its K-th
//!   batched step (counting from 0 since the process started), in the role's first
//!   process only (incarnation 0), so the restarted worker serves normally and a test
//!   can check that the request it retried succeeds;
//! - `exit_at_start_from=K` (any role but the router): every process of the role from
//!   its K-th restart on exits with status 1 right after starting: a crash loop.

use crate::node::Role;

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
}

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
            let bad = || {
                format!(
                    "{}: `{item}` is not denoise:panic_at_step=K or ROLE:exit_at_start_from=K",
                    Self::VAR
                )
            };
            let (r, fault) = item.split_once(':').ok_or_else(bad)?;
            let r: Role = r.parse()?;
            let (name, value) = fault.split_once('=').ok_or_else(bad)?;
            let value: u64 = value.parse().map_err(|_| bad())?;
            let mine = r == role;
            match name {
                "panic_at_step" if r == Role::Denoise => {
                    if mine && incarnation == 0 {
                        f.panic_at_step = Some(value);
                    }
                }
                "exit_at_start_from" if r != Role::Router => {
                    f.exit_at_start |= mine && u64::from(incarnation) >= value;
                }
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
        ] {
            assert!(Faults::parse(bad, Role::Denoise, 0).is_err(), "{bad}");
        }
    }
}
