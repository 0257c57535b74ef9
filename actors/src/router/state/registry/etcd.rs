//! A small client of etcd's v3 API as etcd serves it over HTTP: its gRPC gateway
//! (`/v3/kv/range`, `/v3/kv/txn`; JSON, keys and values in base64, 64-bit integers as
//! strings), documented and stable since etcd 3.4. The registry needs three calls: read
//! one key, read what changed under a prefix since a revision, and put a key if its
//! revision is still the one read (compare-and-swap).
//!
//! Why not the `etcd-client` crate: it compiles etcd's `.proto` files when it is built,
//! which needs `protoc` on the build machine, and the README promises a build with a
//! Rust toolchain alone; the gateway speaks the same API (the same linearizable reads
//! and transactions) over the HTTP client the daemon already links.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

/// A key's value and the revision of its last change.
#[derive(Clone, Debug, PartialEq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

pub struct Etcd {
    endpoints: Vec<String>,
    http: reqwest::Client,
    /// The endpoint that answered last (tried first).
    good: AtomicUsize,
}

/// etcd's JSON writes 64-bit integers as strings (and leaves zeros out).
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn kvs(v: &Value) -> Result<Vec<Kv>, String> {
    let Some(list) = v.get("kvs").and_then(Value::as_array) else {
        return Ok(vec![]);
    };
    list.iter()
        .map(|kv| {
            let text = |f: &str| kv.get(f).and_then(Value::as_str).unwrap_or("");
            let key = B64.decode(text("key")).map_err(|e| e.to_string())?;
            Ok(Kv {
                key: String::from_utf8(key).map_err(|e| e.to_string())?,
                value: B64.decode(text("value")).map_err(|e| e.to_string())?,
                mod_revision: int(&kv["mod_revision"]),
            })
        })
        .collect()
}

/// The end of the range of keys that start with `prefix` (its last byte plus one).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl Etcd {
    /// A client of the etcd members at `endpoints` (`HOST:PORT`), each call bounded by
    /// `timeout`.
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<Etcd, String> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Etcd {
            endpoints: endpoints.iter().map(|e| format!("http://{e}")).collect(),
            http,
            good: AtomicUsize::new(0),
        })
    }

    pub fn endpoints(&self) -> String {
        self.endpoints.join(", ")
    }

    /// Posts `body` to `path` at the endpoint that answered last, then the others.
    async fn call(&self, path: &str, body: &Value) -> Result<Value, String> {
        if crate::fault::cut() {
            return Err("cut off the registry (DENOISED_FAULT_CUT)".into());
        }
        let n = self.endpoints.len();
        let first = self.good.load(Ordering::Relaxed);
        let mut last = String::from("no etcd endpoint");
        for i in 0..n {
            let at = (first + i) % n;
            let url = format!("{}{path}", self.endpoints[at]);
            let r = self.http.post(&url).json(body).send().await;
            let r = match r {
                Ok(r) if r.status().is_success() => r.json::<Value>().await,
                Ok(r) => {
                    let status = r.status();
                    last = format!("{url}: {status}: {}", r.text().await.unwrap_or_default());
                    continue;
                }
                Err(e) => Err(e),
            };
            match r {
                Ok(v) => {
                    self.good.store(at, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(e) => last = format!("{url}: {e}"),
            }
        }
        Err(last)
    }

    /// Key `key` now (a linearizable read), with the store's revision.
    pub async fn get(&self, key: &str) -> Result<(i64, Option<Kv>), String> {
        let v = self
            .call("/v3/kv/range", &json!({ "key": B64.encode(key) }))
            .await?;
        Ok((int(&v["header"]["revision"]), kvs(&v)?.into_iter().next()))
    }

    /// The keys under `prefix` changed after revision `since` (all of them for 0), and
    /// the store's revision they are read at: the next call passes that revision.
    pub async fn changed_since(&self, prefix: &str, since: i64) -> Result<(i64, Vec<Kv>), String> {
        let body = json!({
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix)),
            "min_mod_revision": (since + 1).to_string(),
        });
        let v = self.call("/v3/kv/range", &body).await?;
        Ok((int(&v["header"]["revision"]), kvs(&v)?))
    }

    /// Puts `value` at `key` if the key's last change is still revision `expected` (0:
    /// the key does not exist): `Ok(revision)` of the put, or `Err(now)` when the key
    /// changed meanwhile, with what it holds now.
    pub async fn put_if(
        &self,
        key: &str,
        expected: i64,
        value: &[u8],
    ) -> Result<Result<i64, Option<Kv>>, String> {
        let k = B64.encode(key);
        let body = json!({
            "compare": [{ "target": "MOD", "key": k, "mod_revision": expected.to_string(),
                          "result": "EQUAL" }],
            "success": [{ "request_put": { "key": k, "value": B64.encode(value) } }],
            "failure": [{ "request_range": { "key": k } }],
        });
        let v = self.call("/v3/kv/txn", &body).await?;
        if v.get("succeeded").and_then(Value::as_bool) == Some(true) {
            return Ok(Ok(int(&v["header"]["revision"])));
        }
        let now = v["responses"]
            .get(0)
            .map(|r| kvs(&r["response_range"]))
            .transpose()?
            .and_then(|k| k.into_iter().next());
        Ok(Err(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_after_every_key_under_it() {
        assert_eq!(prefix_end("/d/t/"), b"/d/t0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        assert_eq!(int(&json!("42")), 42);
        assert_eq!(int(&Value::Null), 0);
    }
}
