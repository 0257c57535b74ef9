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
//! of `ROLE:FAULT`, e.g. `denoise:panic_at_step=3`. A fault fires only in a role's
//! first process (incarnation 0), so the restarted worker serves normally and a test
//! can check that the request it retried succeeds. Faults:
//! - `panic_at_step=K`: the denoise loop thread panics before its K-th batched step
//!   (counting from 0 since the process started).

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
}

impl Faults {
    pub const VAR: &'static str = "DENOISED_FAULT";

    /// The faults `DENOISED_FAULT` asks of `role`'s process of this `incarnation`
    /// (none once restarted). A malformed value is an error, so a drill that would
    /// silently test nothing does not start.
    pub fn from_env(role: Role, incarnation: u32) -> Result<Faults, String> {
        match std::env::var(Self::VAR) {
            Ok(spec) if incarnation == 0 => Self::parse(&spec, role),
            _ => Ok(Faults::default()),
        }
    }

    fn parse(spec: &str, role: Role) -> Result<Faults, String> {
        let mut f = Faults::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = || {
                format!(
                    "{}: `{item}` is not ROLE:panic_at_step=K (e.g. denoise:panic_at_step=3)",
                    Self::VAR
                )
            };
            let (r, fault) = item.split_once(':').ok_or_else(bad)?;
            let r: Role = r.parse()?;
            let (name, value) = fault.split_once('=').ok_or_else(bad)?;
            let value: u64 = value.parse().map_err(|_| bad())?;
            match name {
                "panic_at_step" if r == Role::Denoise => {
                    if r == role {
                        f.panic_at_step = Some(value);
                    }
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
    fn faults_parse_for_their_role_only() {
        let f = Faults::parse("denoise:panic_at_step=3", Role::Denoise).unwrap();
        assert_eq!(f.panic_at_step, Some(3));
        let f = Faults::parse("denoise:panic_at_step=3", Role::Preprocess).unwrap();
        assert_eq!(f, Faults::default());
        for bad in [
            "denoise",
            "denoise:panic_at_step",
            "denoise:panic_at_step=x",
            "preprocess:panic_at_step=1",
            "gpu:panic_at_step=1",
            "denoise:explode=1",
        ] {
            assert!(Faults::parse(bad, Role::Denoise).is_err(), "{bad}");
        }
    }
}
