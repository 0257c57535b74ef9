//! A real etcd for the cluster tests' template registry (Debian's `etcd-server`, which
//! `.ci/run` installs): one member on free loopback ports, its data in a directory of
//! its own, stopped (and restarted on the same data) by the tests. Dropping it stops
//! it and waits.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use denoised_runtime::skip::{skip, Need};

use super::pods::free_port;

pub struct Etcd {
    dir: tempfile::TempDir,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

impl Etcd {
    /// An etcd, started; `None` (the test skips, or fails where tools are required)
    /// when there is no `etcd` on the PATH.
    pub fn start(test: &str) -> Option<Etcd> {
        let found = Command::new("etcd")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            skip(
                test,
                Need::Tool,
                "no `etcd` on the PATH (Debian's etcd-server)",
            );
            return None;
        }
        let mut e = Etcd {
            dir: tempfile::tempdir().unwrap(),
            client: free_port("127.0.0.1"),
            peer: free_port("127.0.0.1"),
            child: None,
        };
        e.run();
        Some(e)
    }

    /// Its client endpoint (`[cluster] registry`).
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client)
    }

    fn run(&mut self) {
        let url = |port: u16| format!("http://127.0.0.1:{port}");
        let log = std::fs::File::create(self.dir.path().join("etcd.log")).unwrap();
        let child = Command::new("etcd")
            .args(["--name", "registry", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &url(self.client)])
            .args(["--advertise-client-urls", &url(self.client)])
            .args(["--listen-peer-urls", &url(self.peer)])
            .args(["--initial-advertise-peer-urls", &url(self.peer)])
            .args(["--initial-cluster", &format!("registry={}", url(self.peer))])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let health = format!("{}/health", url(self.client));
        let http = reqwest::blocking::Client::new();
        let t0 = Instant::now();
        loop {
            let ok = http
                .get(&health)
                .timeout(Duration::from_secs(1))
                .send()
                .ok()
                .and_then(|r| r.json::<serde_json::Value>().ok())
                .is_some_and(|v| v["health"] == "true");
            if ok {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "etcd did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills it (-9); its data stays.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same data.
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
