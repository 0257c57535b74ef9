//! A small W3C WebDriver client for the browser tests: chromedriver driving headless
//! Chromium, spoken to over HTTP with reqwest (blocking). Only what the tests use:
//! navigate, find, send keys, click, pointer actions, run a script, screenshot.
//!
//! [`Browser`] owns everything it starts: dropping it (also when the test panics)
//! ends the session, stops chromedriver and kills any Chromium process still using
//! the browser's temporary profile, then removes the profile.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use reqwest::blocking::Client;
use serde_json::{json, Value};

/// The W3C name of an element reference in WebDriver's JSON.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Chromium and chromedriver, from `DENOISED_CHROMIUM` / `DENOISED_CHROMEDRIVER` or
/// the PATH (Debian's `chromium` and `chromium-driver` packages); why not, if absent.
pub fn find_tools() -> Result<(PathBuf, PathBuf), String> {
    let chromium = tool(
        "DENOISED_CHROMIUM",
        &["chromium", "chromium-browser", "google-chrome"],
    )
    .ok_or("no Chromium (set DENOISED_CHROMIUM or install Debian's chromium)")?;
    let driver = tool("DENOISED_CHROMEDRIVER", &["chromedriver"])
        .ok_or("no chromedriver (set DENOISED_CHROMEDRIVER or install Debian's chromium-driver)")?;
    Ok((chromium, driver))
}

fn tool(var: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    names
        .iter()
        .flat_map(|n| std::env::split_paths(&path).map(move |d| d.join(n)))
        .find(|p| p.is_file())
}

pub struct Browser {
    http: Client,
    base: String,
    session: Option<String>,
    driver: Child,
    profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver on a free port and a headless Chromium session with a
    /// window of `width` x `height`.
    pub fn start(chromium: &Path, driver: &Path, width: u32, height: u32) -> Browser {
        let port = free_port();
        // Chromium's profile and temporary files (its scoped dirs) in one directory
        // of ours, removed at the end.
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .env("TMPDIR", &tmp)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let mut b = Browser {
            http: Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            base: format!("http://127.0.0.1:{port}"),
            session: None,
            driver: child,
            profile: dir,
        };
        b.wait_driver();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless=new",
                    // Tests may run as root (containers), where the sandbox refuses to start.
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--hide-scrollbars",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", b.profile.path().join("profile").display()),
                ],
            },
        }}});
        let v = b.call("POST", "/session", Some(caps));
        b.session = Some(v["sessionId"].as_str().expect("a session id").to_string());
        b
    }

    fn wait_driver(&mut self) {
        let t0 = Instant::now();
        loop {
            let ready = self
                .http
                .get(format!("{}/status", self.base))
                .send()
                .ok()
                .and_then(|r| r.json::<Value>().ok())
                .is_some_and(|v| v["value"]["ready"] == json!(true));
            if ready {
                return;
            }
            if let Some(s) = self.driver.try_wait().unwrap() {
                panic!("chromedriver exited at start ({s})");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "chromedriver never ready"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// One WebDriver command; panics with the driver's error.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}{path}", self.base);
        let req = match method {
            "GET" => self.http.get(url),
            "DELETE" => self.http.delete(url),
            _ => self.http.post(url).json(&body.unwrap_or(json!({}))),
        };
        let r = req
            .send()
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = r.status();
        let v: Value = r.json().unwrap_or(Value::Null);
        assert!(status.is_success(), "{method} {path}: {status} {v}");
        v["value"].clone()
    }

    fn s(&self, path: &str) -> String {
        format!("/session/{}{path}", self.session.as_deref().unwrap())
    }

    pub fn goto(&self, url: &str) {
        self.call("POST", &self.s("/url"), Some(json!({ "url": url })));
    }

    /// The element `css` selects (the first).
    pub fn find(&self, css: &str) -> String {
        let v = self.call(
            "POST",
            &self.s("/element"),
            Some(json!({"using": "css selector", "value": css})),
        );
        v[ELEMENT].as_str().expect("an element").to_string()
    }

    /// Types `text` into an element; for a file input, `text` is the file's path.
    pub fn send_keys(&self, css: &str, text: &str) {
        let e = self.find(css);
        self.call(
            "POST",
            &self.s(&format!("/element/{e}/value")),
            Some(json!({ "text": text })),
        );
    }

    pub fn click(&self, css: &str) {
        let e = self.find(css);
        self.call("POST", &self.s(&format!("/element/{e}/click")), None);
    }

    /// Runs `body` (a function body: `return ...`) in the page with `args`.
    pub fn js(&self, body: &str, args: Value) -> Value {
        self.call(
            "POST",
            &self.s("/execute/sync"),
            Some(json!({"script": body, "args": args})),
        )
    }

    /// A mouse drag through `points`, each relative to the centre of the element `css`
    /// selects (real input events: the page sees pointerdown, pointermoves, pointerup).
    pub fn drag(&self, css: &str, points: &[(i64, i64)]) {
        let e = self.find(css);
        let origin = json!({ ELEMENT: e });
        let mut actions = vec![];
        for (i, (x, y)) in points.iter().enumerate() {
            actions.push(
                json!({"type": "pointerMove", "duration": 20, "origin": origin, "x": x, "y": y}),
            );
            if i == 0 {
                actions.push(json!({"type": "pointerDown", "button": 0}));
            }
        }
        actions.push(json!({"type": "pointerUp", "button": 0}));
        let body = json!({"actions": [{
            "type": "pointer", "id": "mouse", "parameters": {"pointerType": "mouse"},
            "actions": actions,
        }]});
        self.call("POST", &self.s("/actions"), Some(body));
        self.call("DELETE", &self.s("/actions"), None);
    }

    /// A PNG of the viewport.
    pub fn screenshot(&self, path: &Path) {
        let v = self.call("GET", &self.s("/screenshot"), None);
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap();
        std::fs::write(path, png).unwrap();
    }

    /// PIDs of the processes whose command line names this browser's profile (Chromium
    /// and its helpers: ours alone, since the profile is a fresh temporary directory).
    fn profile_pids(&self) -> Vec<i32> {
        let needle = self.profile.path().to_string_lossy().into_owned();
        let mut pids = vec![];
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmd).contains(&needle) {
                pids.push(pid);
            }
        }
        pids
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session makes chromedriver close Chromium; with a short timeout,
        // since a hung browser must not hang the test's cleanup.
        if let Some(id) = self.session.take() {
            let _ = self
                .http
                .delete(format!("{}/session/{id}", self.base))
                .timeout(Duration::from_secs(10))
                .send();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        // Whatever Chromium left (a crash of the driver, a hung renderer), by PID.
        let t0 = Instant::now();
        loop {
            let pids = self.profile_pids();
            if pids.is_empty() || t0.elapsed() > Duration::from_secs(10) {
                break;
            }
            for pid in pids {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
