//! Idempotency keys: a client that retries a POST after a timeout sends the same
//! `Idempotency-Key` header, and gets the first request's job (or its reply) instead of
//! a second job. The table maps a key to a digest of the request (route and body) and
//! the job it started, with the first reply when it is small enough to keep.
//!
//! Keys outlive a router that crashes: each is appended (and synced) to a file beside
//! the supervisor's status file before the reply that made it leaves, and a restarted
//! router reads it back. They live as long as the daemon (its jobs do not outlive it
//! either) and at most `[server] idempotency_window_seconds`.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::wire::JobId;

/// A first reply, replayed as it was.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub content_type: String,
    /// Its `x-denoised-*` and `location` headers.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    #[serde(with = "b64")]
    pub body: Vec<u8>,
}

/// What a key stands for.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    pub key: String,
    /// SHA-256 of the route and body, hex.
    pub digest: String,
    pub job: JobId,
    pub created_unix: f64,
    /// The first reply, when kept (an async request's 202 always is; a large image
    /// reply only in memory, and while the memory bound allows).
    pub reply: Option<Reply>,
}

/// What a request with a key finds.
#[derive(Debug, PartialEq)]
pub enum Found {
    /// A new key: reserved for this request until [`Keys::record`] or [`Keys::release`].
    New,
    /// The same request was made before: its entry.
    Replay(Entry),
    /// The key was used with another request (another route or body).
    Mismatch,
    /// A request with this key is still being answered.
    InFlight,
}

/// Replies larger than this are kept in memory only (the file keeps the job id).
const FILE_BODY_BYTES: usize = 64 << 10;
/// Memory the kept replies may take (the oldest's bodies go first beyond it).
const MEMORY_BYTES: usize = 256 << 20;

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    in_flight: std::collections::HashSet<String>,
    order: VecDeque<String>,
    body_bytes: usize,
}

pub struct Keys {
    inner: Mutex<Inner>,
    file: Option<PathBuf>,
    window_s: f64,
}

impl Keys {
    /// The table, with the keys of earlier routers of this daemon read back from
    /// `file` (`None`: kept in memory only).
    pub fn open(file: Option<PathBuf>, window_s: f64, now: f64) -> Keys {
        let mut inner = Inner::default();
        if let Some(f) = &file {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            // A line cut short by a crash is skipped.
            for e in text
                .lines()
                .filter_map(|l| serde_json::from_str::<Entry>(l).ok())
            {
                if now - e.created_unix < window_s {
                    inner.insert(e);
                }
            }
        }
        Keys {
            inner: Mutex::new(inner),
            file,
            window_s,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Looks `key` up for a request of `digest`, reserving it when it is new.
    pub fn begin(&self, key: &str, digest: &str, now: f64) -> Found {
        let mut s = self.lock();
        s.expire(now, self.window_s);
        if let Some(e) = s.entries.get(key) {
            return match e.digest == digest {
                true => Found::Replay(e.clone()),
                false => Found::Mismatch,
            };
        }
        if !s.in_flight.insert(key.to_string()) {
            return Found::InFlight;
        }
        Found::New
    }

    /// Gives up a reservation: the request started no job (refused before it did).
    pub fn release(&self, key: &str) {
        self.lock().in_flight.remove(key);
    }

    /// Records the job a reserved key's request started, durably when there is a file
    /// (before its reply leaves).
    pub fn record(&self, e: Entry) -> std::io::Result<()> {
        let appended = match &self.file {
            Some(f) => {
                // The file keeps a small reply; a large one's key names its job only.
                let small = e.reply.as_ref().filter(|r| r.body.len() <= FILE_BODY_BYTES);
                let line = Entry {
                    key: e.key.clone(),
                    digest: e.digest.clone(),
                    job: e.job,
                    created_unix: e.created_unix,
                    reply: small.cloned(),
                };
                append(f, &line)
            }
            None => Ok(()),
        };
        let mut s = self.lock();
        s.in_flight.remove(&e.key);
        s.insert(e);
        while s.body_bytes > MEMORY_BYTES {
            s.shed_oldest_body();
        }
        appended
    }
}

fn append(path: &PathBuf, e: &Entry) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(e)?;
    line.push(b'\n');
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    f.write_all(&line)?;
    f.sync_data()
}

impl Inner {
    fn insert(&mut self, e: Entry) {
        self.body_bytes += e.reply.as_ref().map_or(0, |r| r.body.len());
        self.order.push_back(e.key.clone());
        if let Some(old) = self.entries.insert(e.key.clone(), e) {
            self.body_bytes -= old.reply.map_or(0, |r| r.body.len());
        }
    }

    fn expire(&mut self, now: f64, window_s: f64) {
        while let Some(k) = self.order.front() {
            match self.entries.get(k) {
                Some(e) if now - e.created_unix < window_s => break,
                _ => {
                    let k = self.order.pop_front().expect("a front");
                    if let Some(e) = self.entries.remove(&k) {
                        self.body_bytes -= e.reply.map_or(0, |r| r.body.len());
                    }
                }
            }
        }
    }

    /// Drops the oldest kept reply body (its key still names its job).
    fn shed_oldest_body(&mut self) {
        let Some(k) = self
            .order
            .iter()
            .find(|k| self.entries.get(*k).is_some_and(|e| e.reply.is_some()))
            .cloned()
        else {
            self.body_bytes = 0;
            return;
        };
        if let Some(r) = self.entries.get_mut(&k).and_then(|e| e.reply.take()) {
            self.body_bytes -= r.body.len();
        }
    }
}

mod b64 {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, digest: &str, job: JobId, at: f64) -> Entry {
        Entry {
            key: key.into(),
            digest: digest.into(),
            job,
            created_unix: at,
            reply: Some(Reply {
                status: 202,
                content_type: "application/json".into(),
                headers: vec![("location".into(), "/v1/jobs/x".into())],
                body: b"{}".to_vec(),
            }),
        }
    }

    /// New, in flight, replayed, mismatched, read back by a new table from the file,
    /// and gone after the window.
    #[test]
    fn keys_replay_refuse_other_bodies_outlive_the_router_and_expire() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("keys.jsonl");
        let keys = Keys::open(Some(file.clone()), 100.0, 0.0);
        assert_eq!(keys.begin("k", "d1", 1.0), Found::New);
        assert_eq!(keys.begin("k", "d1", 1.0), Found::InFlight);
        keys.record(entry("k", "d1", 7, 1.0)).unwrap();
        assert_eq!(
            keys.begin("k", "d1", 2.0),
            Found::Replay(entry("k", "d1", 7, 1.0))
        );
        assert_eq!(keys.begin("k", "d2", 2.0), Found::Mismatch);
        assert_eq!(keys.begin("other", "d1", 2.0), Found::New);
        keys.release("other");
        assert_eq!(keys.begin("other", "d1", 2.0), Found::New);
        // A line cut short by a crash is skipped.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .unwrap()
            .write_all(b"{\"key\":\"cut")
            .unwrap();
        let again = Keys::open(Some(file.clone()), 100.0, 50.0);
        assert_eq!(
            again.begin("k", "d1", 50.0),
            Found::Replay(entry("k", "d1", 7, 1.0))
        );
        assert_eq!(again.begin("k", "d1", 101.5), Found::New, "past the window");
        let late = Keys::open(Some(file), 100.0, 200.0);
        assert_eq!(late.begin("k", "d2", 200.0), Found::New);
    }
}
