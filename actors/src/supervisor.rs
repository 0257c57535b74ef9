//! `denoised serve`: the supervisor. It starts one process per actor group member
//! (the same binary, `denoised worker --role ROLE --index I`), restarts any that die,
//! and on SIGTERM/SIGINT stops them all and removes the shared-memory arenas.
//!
//! Arenas: every process owns one arena in `/dev/shm` under this daemon's namespace.
//! At start-up the supervisor removes arenas left by dead processes of earlier daemons
//! that are gone (a crash, a SIGKILL of the supervisor); a running daemon's arenas are
//! its own supervisor's to reclaim (`supervisor_alive`). After a child dies it removes that child's arena before
//! starting the replacement, which is how slices leaked by a crashed worker come back.
//! Except the cache process's: it may hold templates already acknowledged and not yet
//! on disk, which its replacement writes from there before it replaces the arena with
//! its own (`crate::workers::cache::recover`).

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use denoised_runtime::config::Config;
use denoised_runtime::shm;

use crate::node::{Role, WorkerEnv};
use crate::restarts::{Next, Restarts};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

struct Worker {
    role: Role,
    index: usize,
    /// The running process; none while waiting to restart, or once failed.
    child: Option<Child>,
    started: Instant,
    restarts: Restarts,
    /// When to start it again, while it waits out a backoff.
    restart_at: Option<Instant>,
    /// Processes started in this slot so far, the first one included.
    started_count: u32,
    /// Still the process started with the daemon (never restarted).
    first: bool,
}

impl Worker {
    fn name(&self) -> String {
        format!("{}{}", self.role, self.index)
    }
}

/// Stops every process of `role`: SIGTERM, then SIGKILL after `limit`.
fn stop_role(workers: &mut [Worker], role: Role, limit: Duration) {
    let mine = |w: &&mut Worker| w.role == role;
    for c in workers
        .iter_mut()
        .filter(mine)
        .filter_map(|w| w.child.as_ref())
    {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    }
    let deadline = Instant::now() + limit;
    for c in workers
        .iter_mut()
        .filter(mine)
        .filter_map(|w| w.child.as_mut())
    {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Schedules the restart of a worker that exited (`how`), or gives up on it
/// (`crate::restarts`); returns whether it gave up.
fn after_exit(w: &mut Worker, how: &str) -> bool {
    match w.restarts.after_exit(w.started, Instant::now(), how) {
        Next::RestartAt(at) => {
            let wait = at.saturating_duration_since(Instant::now());
            tracing::warn!(
                "{} worker {} exited ({how}); restarting{}",
                w.role,
                w.index,
                if wait.is_zero() {
                    String::new()
                } else {
                    format!(" in {:.2} s", wait.as_secs_f64())
                }
            );
            w.restart_at = Some(at);
            false
        }
        Next::GiveUp(why) => {
            tracing::error!("{} worker {} {why}", w.role, w.index);
            w.restarts.failed = Some(why);
            true
        }
    }
}

/// A random hex token (the cluster cookie when the config sets none).
fn random_token() -> String {
    random_bytes::<16>()
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_ok();
    if !ok {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let seed = (t ^ (std::process::id() as u128) << 64).to_le_bytes();
        for (i, x) in b.iter_mut().enumerate() {
            *x = seed[i % seed.len()];
        }
    }
    b
}

/// A port that is free on `ip` now and stays free until a process of ours binds it.
///
/// The supervisor picks a port and the router process binds it later (and again
/// after every restart), so a port the kernel hands out for `bind(:0)` will not do: it
/// comes from the ephemeral range, where any process's next outgoing connection or
/// `:0` listener may take it in between ("Address already in use" at the router's
/// start, seen in CI with several daemons at once). So the pick is a random free port
/// just below the ephemeral range (`net.ipv4.ip_local_port_range`), which the kernel
/// never hands out by itself. (Also for tests that start other servers beside a
/// daemon, e.g. a Prometheus.)
pub fn free_port(ip: std::net::IpAddr) -> Result<u16, String> {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // 16384 ports below it, above the privileged ones.
    let low = ephemeral_low.saturating_sub(16384).max(1024);
    let span = ephemeral_low.saturating_sub(low);
    if span > 0 {
        for _ in 0..64 {
            let r = u16::from_le_bytes(random_bytes::<2>());
            let port = low + r % span;
            if std::net::TcpListener::bind((ip, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    // A system with no room below its ephemeral range: the kernel's pick.
    let l = std::net::TcpListener::bind((ip, 0)).map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// `listen` with port 0 replaced by a free port: a restarted router must listen where
/// the first one did.
fn fixed_port(listen: &str) -> Result<String, String> {
    let addr: std::net::SocketAddr = match listen.parse() {
        Ok(a) => a,
        // A host name: resolved by the router itself.
        Err(_) => return Ok(listen.to_string()),
    };
    if addr.port() != 0 {
        return Ok(listen.to_string());
    }
    let port = free_port(addr.ip()).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    Ok(std::net::SocketAddr::new(addr.ip(), port).to_string())
}

/// Whether the daemon whose arenas are in `namespace` (`s<supervisor pid>`) is still
/// running: then its own supervisor decides about its dead workers' arenas (it keeps a
/// dead cache process's, whose successor writes the templates not yet on disk from it).
fn supervisor_alive(namespace: &str) -> bool {
    let Some(pid) = namespace
        .strip_prefix('s')
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// Removes arenas of dead owners in every namespace under `dir` whose daemon is gone.
fn sweep_dead_arenas(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut namespaces: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e
                .file_name()
                .to_str()?
                .strip_prefix("denoised-")?
                .to_string();
            Some(n.split('-').next()?.to_string())
        })
        .collect();
    namespaces.sort();
    namespaces.dedup();
    for ns in namespaces.into_iter().filter(|ns| !supervisor_alive(ns)) {
        if let Ok(removed) = shm::reclaim_dead(dir, &ns) {
            if !removed.is_empty() {
                tracing::info!(
                    "removed {} arenas of dead processes in namespace {ns}",
                    removed.len()
                );
            }
        }
    }
}

/// Removes the arenas of this daemon's dead processes, except a cache process's (see
/// the module docs): the cache process started in its slot replaces it.
fn reclaim_dead_workers(dir: &std::path::Path, namespace: &str) {
    let cache = |name: &str| {
        name.strip_prefix(Role::Cache.name())
            .is_some_and(|i| i.parse::<usize>().is_ok())
    };
    let arenas = match shm::list_arenas(dir, namespace) {
        Ok(a) => a,
        Err(e) => return tracing::warn!("reclaiming arenas: {e}"),
    };
    for a in arenas.iter().filter(|a| !a.owner_alive && !cache(&a.name)) {
        if let Err(e) = std::fs::remove_file(&a.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("reclaiming arena {}: {e}", a.path.display());
            }
        }
    }
}

/// Runs the daemon until SIGTERM/SIGINT. `listen` overrides `[server] listen`.
pub fn serve(mut config: Config, listen: Option<String>) -> Result<(), String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let placement = crate::device::place_workers(&mut config, cores)?;
    tracing::info!(
        "denoise workers on {}; {} CPU threads per compute process",
        placement
            .denoise
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        placement.threads
    );
    let exe = std::env::current_exe().map_err(|e| format!("cannot find own binary: {e}"))?;
    let shm_dir = if config.cluster.shm_dir.is_empty() {
        shm::default_dir()
    } else {
        PathBuf::from(&config.cluster.shm_dir)
    };
    sweep_dead_arenas(&shm_dir);
    let namespace = format!("s{}", std::process::id());
    let cookie = if config.cluster.cookie.is_empty() {
        random_token()
    } else {
        config.cluster.cookie.clone()
    };
    let router_port = match config.cluster.port {
        0 => free_port(std::net::Ipv4Addr::LOCALHOST.into())?,
        p => p,
    };
    let listen = fixed_port(&listen.unwrap_or_else(|| config.server.listen.clone()))?;
    let started_unix = crate::daemon::unix_now();
    // Beside the sockets of a systemd service when there is a runtime directory.
    let status_file = std::env::var_os("RUNTIME_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("denoised-{namespace}.status.json"));
    let mut status = crate::daemon::SupervisorStatus::default();
    status.write(&status_file);
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    let spawn = |role: Role, index: usize, incarnation: u32| -> Result<Child, String> {
        let env = WorkerEnv {
            config: config.clone(),
            role,
            index,
            namespace: namespace.clone(),
            cookie: cookie.clone(),
            router_port,
            shm_dir: shm_dir.clone(),
            device: match role {
                Role::Denoise => placement.denoise[index].to_string(),
                Role::Preprocess => placement.preprocess[index].to_string(),
                Role::Postprocess => placement.postprocess[index].to_string(),
                // ControlNets run on the host's CPU for now (see crate::controlnet).
                Role::Router | Role::Cache | Role::ControlNet => "cpu".into(),
            },
            threads: placement.threads,
            incarnation,
            started_unix,
            status_file: status_file.clone(),
            stages_on_device: match role {
                Role::Denoise => placement.stages_on(index),
                _ => Default::default(),
            },
        };
        let mut cmd = Command::new(&exe);
        cmd.args([
            "worker",
            "--role",
            role.name(),
            "--index",
            &index.to_string(),
        ])
        .env(
            WorkerEnv::VAR,
            serde_json::to_string(&env).map_err(|e| e.to_string())?,
        );
        if role == Role::Router {
            cmd.args(["--listen", &listen]);
        }
        // SAFETY: prctl is async-signal-safe; it makes the child receive SIGTERM when
        // the supervisor dies, so no worker outlives a killed daemon.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        cmd.spawn()
            .map_err(|e| format!("cannot start {role} worker: {e}"))
    };
    let mut workers = Vec::new();
    for role in Role::ALL {
        for index in 0..role.count(&config) {
            workers.push(Worker {
                role,
                index,
                child: Some(spawn(role, index, 0)?),
                started: Instant::now(),
                restarts: Restarts::default(),
                restart_at: None,
                started_count: 1,
                first: true,
            });
        }
    }
    tracing::info!(
        "supervisor: {} processes, shm namespace {namespace}, cluster node 127.0.0.1:{router_port}",
        workers.len()
    );
    crate::notify::notify(&format!("STATUS=starting {} processes", workers.len()));
    // Every worker's restart count, from zero (a series for each from the start).
    status.restarts = workers
        .iter()
        .map(|w| (w.name(), (w.role.name().to_string(), 0)))
        .collect();
    status.write(&status_file);
    let mut fatal = None;
    'watch: while !STOP.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
        let mut gave_up = false;
        for w in workers.iter_mut() {
            if STOP.load(Ordering::SeqCst) {
                break;
            }
            if let Some(at) = w.restart_at {
                if Instant::now() >= at {
                    w.restart_at = None;
                    w.started = Instant::now();
                    status
                        .restarts
                        .entry(w.name())
                        .or_insert_with(|| (w.role.name().to_string(), 0))
                        .1 += 1;
                    status.write(&status_file);
                    match spawn(w.role, w.index, w.started_count) {
                        Ok(c) => w.child = Some(c),
                        Err(e) => {
                            tracing::error!("{e}");
                            gave_up |= after_exit(w, "could not start");
                        }
                    }
                    w.started_count += 1;
                }
                continue;
            }
            let Some(Ok(Some(exit))) = w.child.as_mut().map(|c| c.try_wait()) else {
                continue;
            };
            w.child = None;
            // A worker that cannot load its model at the daemon's start (bad model
            // directory, a device too small for the configuration) would fail the same
            // way forever: the daemon refuses to start, with the worker's message above.
            // Later, a failed reload (a device lost after a fault) is retried, so the
            // other workers keep serving.
            if w.first && exit.code() == Some(crate::daemon::EXIT_CANNOT_LOAD) {
                fatal = Some(format!(
                    "{} worker {} cannot load its model (see its error above); not starting",
                    w.role, w.index
                ));
                break 'watch;
            }
            w.first = false;
            reclaim_dead_workers(&shm_dir, &namespace);
            gave_up |= after_exit(w, &exit.to_string());
        }
        if gave_up {
            status.failed = workers
                .iter()
                .filter_map(|w| w.restarts.failed.clone().map(|why| (w.name(), why)))
                .collect();
            status.write(&status_file);
        }
    }
    tracing::info!("supervisor: stopping");
    crate::notify::notify("STOPPING=1");
    // In order: the router first, which drains (requests in flight finish, new ones
    // get 503) and exits; then the stages it no longer feeds, front to back.
    let drain = Duration::from_secs(config.server.drain_timeout_seconds);
    for role in [
        Role::Router,
        Role::Preprocess,
        Role::Denoise,
        Role::Postprocess,
        Role::ControlNet,
        Role::Cache,
    ] {
        let limit = if role == Role::Router {
            drain + Duration::from_secs(5)
        } else {
            Duration::from_secs(10)
        };
        stop_role(&mut workers, role, limit);
    }
    let _ = shm::cleanup_namespace(&shm_dir, &namespace);
    let _ = std::fs::remove_file(&status_file);
    let _ = std::fs::remove_file(crate::daemon::idempotency_file(&status_file));
    fatal.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picked_ports_are_free_and_outside_the_ephemeral_range() {
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let ip = std::net::Ipv4Addr::LOCALHOST.into();
        for _ in 0..20 {
            let p = free_port(ip).unwrap();
            assert!((1024..low).contains(&p), "{p} not below {low}");
            // Free: it can be bound now.
            std::net::TcpListener::bind((ip, p)).unwrap();
        }
        let fixed = fixed_port("127.0.0.1:0").unwrap();
        let port = fixed.rsplit(':').next().unwrap().parse::<u16>().unwrap();
        assert!((1024..low).contains(&port), "{fixed}");
        assert_eq!(fixed_port("127.0.0.1:8080").unwrap(), "127.0.0.1:8080");
    }
}
