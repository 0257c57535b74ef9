//! Finding and removing arena files: on shutdown, at start-up after a crash, and after
//! the supervisor saw an owner process die.

use std::path::{Path, PathBuf};

use super::layout::{proc_stat, Header};
use super::{check_namespace, namespace_prefix, Result, ShmError};

/// One arena file of a namespace, as found on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaInfo {
    /// The arena name, or for a leftover temporary file `<name>.tmp<pid>`.
    pub name: String,
    pub path: PathBuf,
    /// Owner pid from the header (for a temporary file, from its name); None when the
    /// header is unreadable.
    pub owner_pid: Option<u32>,
    /// Whether the owner process is still running (false for unreadable headers).
    pub owner_alive: bool,
    /// Data capacity in bytes (0 when unknown).
    pub capacity: u64,
}

/// Whether the process `pid` that started at `start_time` (clock ticks since boot, 0 =
/// unknown) is still running.
///
/// Uses `/proc/<pid>/stat`: a missing entry, a zombie (`Z`/`X`: killed but not yet
/// reaped) or a different start time (the pid was reused) all mean dead. Where `/proc`
/// is unavailable it answers `true`: never delete what might be in use.
pub fn owner_alive(pid: u32, start_time: u64) -> bool {
    if pid == 0 {
        return false;
    }
    if !Path::new("/proc/self/stat").exists() {
        return true;
    }
    match proc_stat(pid) {
        Ok(None) => false,
        Ok(Some((state, start))) => {
            !matches!(state, 'Z' | 'X') && (start_time == 0 || start == 0 || start == start_time)
        }
        Err(_) => true,
    }
}

/// Every arena file (and leftover temporary file) of `namespace` in `dir`, sorted by name.
/// A missing `dir` has no arenas.
pub fn list_arenas(dir: &Path, namespace: &str) -> Result<Vec<ArenaInfo>> {
    check_namespace(namespace)?;
    let prefix = namespace_prefix(namespace);
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(ShmError::io(dir, "list directory", e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| ShmError::io(dir, "list directory", e))?;
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
            continue;
        };
        let path = entry.path();
        let info = if let Some((_, pid)) = name.rsplit_once(".tmp") {
            let pid = pid.parse::<u32>().ok();
            ArenaInfo {
                name: name.to_string(),
                owner_alive: pid.is_some_and(|p| owner_alive(p, 0)),
                owner_pid: pid,
                path,
                capacity: 0,
            }
        } else {
            match Header::read_file(&path) {
                Ok(Ok(h)) => ArenaInfo {
                    name: name.to_string(),
                    path,
                    owner_pid: Some(h.pid),
                    owner_alive: owner_alive(h.pid, h.start_time),
                    capacity: h.capacity,
                },
                Ok(Err(_)) => ArenaInfo {
                    name: name.to_string(),
                    path,
                    owner_pid: None,
                    owner_alive: false,
                    capacity: 0,
                },
                // removed between listing and reading
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(ShmError::io(&path, "read header", e)),
            }
        };
        out.push(info);
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Remove every arena file of `namespace` in `dir`, live or not (start-up after a
/// crash, before any process of the namespace runs; or final shutdown). Returns the
/// names removed. Mappings that still exist stay valid until unmapped.
pub fn cleanup_namespace(dir: &Path, namespace: &str) -> Result<Vec<String>> {
    remove_where(dir, namespace, |_| true)
}

/// Remove the arena files of `namespace` whose owner process no longer exists (or whose
/// header is unreadable), and temporary files of dead creators. Returns the names
/// removed. Arenas of live owners, this process included, are kept.
pub fn reclaim_dead(dir: &Path, namespace: &str) -> Result<Vec<String>> {
    remove_where(dir, namespace, |info| !info.owner_alive)
}

fn remove_where(
    dir: &Path,
    namespace: &str,
    pred: impl Fn(&ArenaInfo) -> bool,
) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for info in list_arenas(dir, namespace)? {
        if !pred(&info) {
            continue;
        }
        match std::fs::remove_file(&info.path) {
            Ok(()) => removed.push(info.name),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ShmError::io(&info.path, "remove", e)),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::super::Arena;
    use super::*;

    /// The pid of a process that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    }

    /// Copy a live arena's file under another name with the header's pid rewritten.
    fn fake_arena(dir: &Path, from: &Path, name: &str, pid: u32) {
        let mut bytes = std::fs::read(from).unwrap();
        bytes[16..24].copy_from_slice(&(pid as u64).to_ne_bytes());
        std::fs::write(dir.join(format!("denoised-ns-{name}")), bytes).unwrap();
    }

    #[test]
    fn reclaim_removes_only_dead_owners() {
        let dir = tempfile::tempdir().unwrap();
        let live = Arena::create(dir.path(), "ns", "live", 256).unwrap();
        let _other_ns = Arena::create(dir.path(), "ns2", "live", 256).unwrap();
        let dead = dead_pid();
        fake_arena(dir.path(), live.path(), "dead", dead);
        std::fs::write(dir.path().join("denoised-ns-garbage"), b"xx").unwrap();
        std::fs::write(dir.path().join(format!("denoised-ns-half.tmp{dead}")), b"").unwrap();
        std::fs::write(dir.path().join("unrelated"), b"").unwrap();

        let list = list_arenas(dir.path(), "ns").unwrap();
        let names: Vec<_> = list.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            ["dead", "garbage", &format!("half.tmp{dead}"), "live"]
        );
        assert_eq!(list[0].owner_pid, Some(dead));
        assert!(!list[0].owner_alive && list[3].owner_alive);
        assert_eq!(list[3].capacity, 256);

        let mut removed = reclaim_dead(dir.path(), "ns").unwrap();
        removed.sort();
        assert_eq!(removed, ["dead", "garbage", &format!("half.tmp{dead}")]);
        assert!(live.path().exists());
        assert!(dir.path().join("denoised-ns2-live").exists());
        assert!(reclaim_dead(dir.path(), "ns").unwrap().is_empty());

        // a dead owner's arena may be replaced by create(); a live one may not
        fake_arena(dir.path(), live.path(), "again", dead);
        let again = Arena::create(dir.path(), "ns", "again", 128).unwrap();
        assert_eq!(again.owner_pid(), std::process::id());

        assert_eq!(
            cleanup_namespace(dir.path(), "ns").unwrap(),
            ["again", "live"]
        );
        assert!(dir.path().join("denoised-ns2-live").exists());
        assert!(dir.path().join("unrelated").exists());
        drop(live); // file already gone: drop must not fail or remove anything else
        drop(again);
        assert!(cleanup_namespace(&dir.path().join("missing"), "ns")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn liveness() {
        assert!(owner_alive(std::process::id(), 0));
        assert!(owner_alive(
            std::process::id(),
            super::super::layout::self_start_time()
        ));
        if Path::new("/proc/self/stat").exists() {
            assert!(!owner_alive(dead_pid(), 0));
            // same pid, different start time: a reused pid
            assert!(!owner_alive(std::process::id(), 1));
        }
        assert!(!owner_alive(0, 0));
    }
}
