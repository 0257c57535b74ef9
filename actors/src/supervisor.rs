//! `denoised serve`: the supervisor. It starts one process per actor group member
//! (the same binary, `denoised worker --role ROLE --index I`), restarts any that die,
//! and on SIGTERM/SIGINT stops them all and removes the shared-memory arenas.
//!
//! Arenas: every process owns one arena in `/dev/shm` under this daemon's namespace.
//! At start-up the supervisor removes arenas left by dead processes of any earlier
//! daemon (a crash, a SIGKILL); after a child dies it removes that child's arena before
//! starting the replacement, which is how slices leaked by a crashed worker come back.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use denoised_runtime::config::Config;
use denoised_runtime::shm;

use crate::node::{Role, WorkerEnv};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

struct Worker {
    role: Role,
    index: usize,
    child: Child,
    started: Instant,
    restarts: u32,
    /// Processes started in this slot so far, the first one included.
    started_count: u32,
    /// Still the process started with the daemon (never restarted).
    first: bool,
}

/// A random hex token (the cluster cookie when the config sets none).
fn random_token() -> String {
    let mut b = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_ok();
    if !ok {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        b = (t ^ (std::process::id() as u128) << 64).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
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
    let l =
        std::net::TcpListener::bind(addr).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.to_string())
}

/// Removes arenas of dead owners in every namespace under `dir`.
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
    for ns in namespaces {
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
        0 => free_port()?,
        p => p,
    };
    let listen = fixed_port(&listen.unwrap_or_else(|| config.server.listen.clone()))?;
    let started_unix = crate::denoise::actor::unix_now();
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
                _ => "cpu".into(),
            },
            threads: placement.threads,
            incarnation,
            started_unix,
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
                child: spawn(role, index, 0)?,
                started: Instant::now(),
                restarts: 0,
                started_count: 1,
                first: true,
            });
        }
    }
    tracing::info!(
        "supervisor: {} processes, shm namespace {namespace}, cluster node 127.0.0.1:{router_port}",
        workers.len()
    );
    let mut fatal = None;
    'watch: while !STOP.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
        for w in workers.iter_mut() {
            let Ok(Some(status)) = w.child.try_wait() else {
                continue;
            };
            if STOP.load(Ordering::SeqCst) {
                break;
            }
            // A worker that cannot load its model at the daemon's start (bad model
            // directory, a device too small for the configuration) would fail the same
            // way forever: the daemon refuses to start, with the worker's message above.
            // Later, a failed reload (a device lost after a fault) is retried, so the
            // other workers keep serving.
            if w.first && status.code() == Some(crate::process::EXIT_CANNOT_LOAD) {
                fatal = Some(format!(
                    "{} worker {} cannot load its model (see its error above); not starting",
                    w.role, w.index
                ));
                break 'watch;
            }
            w.first = false;
            tracing::warn!(
                "{} worker {} exited ({status}); restarting",
                w.role,
                w.index
            );
            if let Err(e) = shm::reclaim_dead(&shm_dir, &namespace) {
                tracing::warn!("reclaiming arenas: {e}");
            }
            // A worker that keeps dying right after start (bad model path, port in
            // use) is restarted with a pause, so the log stays readable.
            if w.started.elapsed() < Duration::from_secs(5) {
                w.restarts += 1;
                std::thread::sleep(Duration::from_millis(500 * w.restarts.min(10) as u64));
            } else {
                w.restarts = 0;
            }
            match spawn(w.role, w.index, w.started_count) {
                Ok(c) => {
                    w.child = c;
                    w.started = Instant::now();
                    w.started_count += 1;
                }
                Err(e) => tracing::error!("{e}"),
            }
        }
    }
    tracing::info!("supervisor: stopping");
    crate::notify::notify("STOPPING=1");
    for w in &workers {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(w.child.id() as i32, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for w in workers.iter_mut() {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = w.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = w.child.kill();
        let _ = w.child.wait();
    }
    let _ = shm::cleanup_namespace(&shm_dir, &namespace);
    fatal.map_or(Ok(()), Err)
}
