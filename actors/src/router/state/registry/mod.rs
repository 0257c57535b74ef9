//! The template registry (docs/cluster.md): each template's identity (its version,
//! content digest and tombstone) kept in etcd, one key per id under
//! `<[cluster] registry_prefix>/templates/<model>/`, and changed only by
//! compare-and-swap, so that the pods of a cluster agree on it whatever fails.
//!
//! A pod reads what changed every third of its lease (`[cluster]
//! registry_lease_seconds`): that read is also its lease, the time it may serve the
//! versions it read without reading again. A change that supersedes or deletes a
//! version some pod may serve is answered only once a lease has passed since it was
//! made, so after the answer no pod serves the old version. A pod whose reads fail
//! refuses identity changes (503) and, once its lease is out, edits of versions it
//! cannot confirm.

pub mod etcd;
pub mod record;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use self::etcd::Etcd;
pub use self::record::{Held, Record};
use crate::daemon::unix_now;
use crate::wire::{ErrorKind, WireError};

/// The pods' view of the records: every record under the prefix, as of `revision`,
/// read at `confirmed` (when the read was sent).
#[derive(Default)]
struct View {
    records: HashMap<String, Record>,
    revision: i64,
    confirmed: Option<Instant>,
}

impl View {
    /// Keeps `r` as `id`'s record unless the view has a later one (reads may answer
    /// out of order: a slow one does not take the view back).
    fn keep(&mut self, id: &str, r: Record) {
        let later = |a: &Record| (a.version, a.deleted);
        match self.records.get(id) {
            Some(old) if later(old) > later(&r) => {}
            _ => {
                self.records.insert(id.to_string(), r);
            }
        }
    }
}

pub struct Registry {
    etcd: Etcd,
    /// The keys of this cluster's templates of this model start with it.
    prefix: String,
    pub lease: Duration,
    /// This pod's name (in the records it writes).
    pod: String,
    view: Mutex<View>,
    /// The registrations under way at this pod: (id, version) from
    /// [`Registry::begin`] until its [`Intent`] is dropped.
    in_flight: Arc<Mutex<HashSet<(String, u64)>>>,
    /// One registration of an id at a time at this pod: the cache makes a stored
    /// version current at once, so a second one that lost its compare-and-swap would
    /// otherwise take the winner's copy down with its own.
    claims: super::keyed::KeyedLocks,
    /// Whether this pod's templates were reconciled with the registry since it started
    /// (it is not ready before).
    reconciled: AtomicBool,
}

/// A create or replace under way: the version it takes, and the record it replaces
/// (with that record's revision, which the commit compares). Counted in flight while
/// it lives.
pub struct Intent {
    pub id: String,
    pub version: u64,
    before: Option<Record>,
    expected: i64,
    in_flight: Arc<Mutex<HashSet<(String, u64)>>>,
    _claim: tokio::sync::OwnedMutexGuard<()>,
}

impl Drop for Intent {
    fn drop(&mut self) {
        let mut f = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        f.remove(&(std::mem::take(&mut self.id), self.version));
    }
}

fn encode(r: &Record) -> Vec<u8> {
    serde_json::to_vec(r).expect("a record serialises")
}

impl Registry {
    /// The registry of `[cluster] registry` for templates of `model`.
    pub fn new(
        endpoints: &[String],
        prefix: &str,
        lease: Duration,
        model: &str,
        pod: &str,
    ) -> Result<Registry, String> {
        // A call that takes a third of the lease is as good as failed.
        let etcd = Etcd::new(endpoints, (lease / 3).max(Duration::from_millis(100)))?;
        Ok(Registry {
            etcd,
            prefix: format!("{}/templates/{model}/", prefix.trim_end_matches('/')),
            lease,
            pod: pod.to_string(),
            view: Mutex::new(View::default()),
            in_flight: Default::default(),
            claims: Default::default(),
            reconciled: AtomicBool::new(false),
        })
    }

    /// Where it is, for logs and errors.
    pub fn describe(&self) -> String {
        format!("etcd at {} ({})", self.etcd.endpoints(), self.prefix)
    }

    fn key(&self, id: &str) -> String {
        format!("{}{id}", self.prefix)
    }

    fn view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn unreachable(&self, e: impl std::fmt::Display) -> WireError {
        WireError::new(
            ErrorKind::Unavailable,
            format!(
                "the template registry ({}) does not answer: {e}; template identity cannot be confirmed, retry later",
                self.describe()
            ),
        )
    }

    fn parse(&self, kv: &etcd::Kv) -> Option<Record> {
        match serde_json::from_slice(&kv.value) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(
                    "template registry: key {} is no record ({e}): ignored",
                    kv.key
                );
                None
            }
        }
    }

    /// Reads template `id`'s record now, and keeps it in the view.
    pub async fn read(&self, id: &str) -> Result<(Option<Record>, i64), WireError> {
        let (_, kv) = self
            .etcd
            .get(&self.key(id))
            .await
            .map_err(|e| self.unreachable(e))?;
        let rev = kv.as_ref().map_or(0, |kv| kv.mod_revision);
        let record = kv.as_ref().and_then(|kv| self.parse(kv));
        if let Some(r) = &record {
            self.view().keep(id, r.clone());
        }
        Ok((record, rev))
    }

    /// Starts a create (`replace`: or a replace) of template `id`: 409 when the cluster
    /// holds it and this is no replace, 503 when the registry does not answer.
    pub async fn begin(&self, id: &str, replace: bool) -> Result<Intent, WireError> {
        let claim = self.claim(id).await;
        let (before, expected) = self.read(id).await?;
        let clock_us = (unix_now() * 1e6) as u64;
        let version = record::new_version(before.as_ref(), replace, clock_us)
            .map_err(|_| WireError::template_exists(id))?;
        Ok(self.intent(id, version, before, expected, claim))
    }

    /// Waits for this pod's registration of `id` under way, if any, to end.
    async fn claim(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        self.claims.of(id).lock_owned().await
    }

    fn intent(
        &self,
        id: &str,
        version: u64,
        before: Option<Record>,
        expected: i64,
        claim: tokio::sync::OwnedMutexGuard<()>,
    ) -> Intent {
        let mut f = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        f.insert((id.to_string(), version));
        Intent {
            id: id.to_string(),
            version,
            before,
            expected,
            in_flight: self.in_flight.clone(),
            _claim: claim,
        }
    }

    /// Whether version `version` of `id` is being registered at this pod (stored here,
    /// its commit not done).
    pub fn in_flight(&self, id: &str, version: u64) -> bool {
        let f = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        f.contains(&(id.to_string(), version))
    }

    /// Template `id`'s current record, read now (`None`: none, or a tombstone).
    pub async fn current(&self, id: &str) -> Result<Option<Record>, WireError> {
        let (now, _) = self.read(id).await?;
        Ok(now.filter(|r| !r.deleted))
    }

    /// Registers version `version` of a template the registry has no record of (one
    /// this pod held before it had a registry): 409 when another pod did first.
    pub async fn adopt(&self, id: &str, version: u64, digest: &str) -> Result<(), WireError> {
        let claim = self.claim(id).await;
        let intent = self.intent(id, version, None, 0, claim);
        self.commit(&intent, digest).await
    }

    /// Makes `intent`'s version, stored on this pod with content `digest`, the
    /// template's: 409 when the id changed since [`Registry::begin`] (the version is
    /// not the template's), 503 when the registry does not answer (whether it is, is
    /// unknown until the next read). A replace returns once every pod's lease on the
    /// version it supersedes is out.
    pub async fn commit(&self, intent: &Intent, digest: &str) -> Result<(), WireError> {
        let r = Record {
            version: intent.version,
            digest: digest.to_string(),
            deleted: false,
            pod: self.pod.clone(),
            unix: unix_now(),
        };
        let value = encode(&r);
        let put = self
            .etcd
            .put_if(&self.key(&intent.id), intent.expected, &value)
            .await;
        match put.map_err(|e| self.unreachable(e))? {
            Ok(_) => {
                self.view().keep(&intent.id, r);
                if record::supersedes(intent.before.as_ref()) {
                    tokio::time::sleep(self.lease).await;
                }
                Ok(())
            }
            Err(now) => {
                let by = now
                    .as_ref()
                    .and_then(|kv| self.parse(kv))
                    .map(|r| format!(" (now version {} by pod {})", r.version, r.pod))
                    .unwrap_or_default();
                Err(WireError::new(
                    ErrorKind::Conflict,
                    format!(
                        "template `{}` was changed at another pod meanwhile{by}",
                        intent.id
                    ),
                ))
            }
        }
    }

    /// Deletes template `id` from the cluster: its record becomes a tombstone of its
    /// version (404 when the cluster does not hold it). Returns once every pod's lease
    /// on that version is out.
    pub async fn delete(&self, id: &str) -> Result<Record, WireError> {
        // A change racing this one makes the compare fail: read again and retry.
        for _ in 0..8 {
            let (now, expected) = self.read(id).await?;
            let t = record::tombstone(now.as_ref(), &self.pod, unix_now()).map_err(|_| {
                WireError::new(ErrorKind::NotFound, format!("unknown template `{id}`"))
            })?;
            let value = encode(&t);
            let put = self.etcd.put_if(&self.key(id), expected, &value).await;
            if put.map_err(|e| self.unreachable(e))?.is_ok() {
                self.view().keep(id, t.clone());
                tokio::time::sleep(self.lease).await;
                return Ok(t);
            }
        }
        Err(WireError::new(
            ErrorKind::Conflict,
            format!("template `{id}` keeps changing at other pods; retry"),
        ))
    }

    /// Whether this pod may serve version `version` of template `id`: from the view
    /// when it is within its lease and says so, else from a read now (503 when that
    /// fails).
    pub async fn check(&self, id: &str, version: u64) -> Result<Held, WireError> {
        {
            let v = self.view();
            let fresh = v.confirmed.is_some_and(|t| t.elapsed() < self.lease);
            let held = record::judge(v.records.get(id), version);
            if fresh && held == Held::Current {
                return Ok(held);
            }
        }
        let (now, _) = self.read(id).await?;
        Ok(record::judge(now.as_ref(), version))
    }

    /// Template `id`'s record as last read (none when the registry has none or this
    /// pod has not read it yet).
    pub fn record(&self, id: &str) -> Option<Record> {
        self.view().records.get(id).cloned()
    }

    /// Whether the view is within its lease.
    pub fn confirmed(&self) -> bool {
        let v = self.view();
        v.confirmed.is_some_and(|t| t.elapsed() < self.lease)
    }

    /// Reads what changed since the last read (everything, the first time), renewing
    /// the lease; returns the records that changed.
    pub async fn refresh(&self) -> Result<Vec<(String, Record)>, String> {
        let sent = Instant::now();
        let since = self.view().revision;
        let (revision, kvs) = self.etcd.changed_since(&self.prefix, since).await?;
        let changed: Vec<(String, Record)> = kvs
            .iter()
            .filter_map(|kv| {
                let id = kv.key.strip_prefix(&self.prefix)?.to_string();
                Some((id, self.parse(kv)?))
            })
            .collect();
        let mut v = self.view();
        for (id, r) in &changed {
            v.keep(id, r.clone());
        }
        v.revision = v.revision.max(revision);
        v.confirmed = Some(v.confirmed.map_or(sent, |t| t.max(sent)));
        Ok(changed)
    }

    pub fn reconciled(&self) -> bool {
        self.reconciled.load(Ordering::Acquire)
    }

    pub fn set_reconciled(&self) {
        self.reconciled.store(true, Ordering::Release);
    }

    /// Every record (after a first [`Registry::refresh`]).
    pub fn records(&self) -> Vec<(String, Record)> {
        let v = self.view();
        v.records
            .iter()
            .map(|(k, r)| (k.clone(), r.clone()))
            .collect()
    }
}
