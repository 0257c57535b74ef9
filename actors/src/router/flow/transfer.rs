//! Template copies between pods (docs/cluster.md), over the mesh: the bulk stream of
//! `denoised_models::flux::template_transfer` (chunked, checked slab by slab against the
//! template file's CRC-32s, resumable from the verified prefix, capped at the sender)
//! carried by the pod actors' `Open`/`Next`/`Close` calls, so it has the cluster's
//! cookie and TLS. The sending router reads its pod's disk tier; the receiving router
//! writes into its own, then its cache process indexes the copy.
//!
//! A pod that an edit is routed to and lacks its template [`obtain`]s it: a copy from a
//! peer, or, when no pod holds it any more, a capture again from its recipe
//! ([`learn_recipes`] keeps some, [`recipe_from_peers`] asks for the others).
//!
//! [`replicate`] keeps `[cluster] template_replicas` copies of each template: every pod
//! ranks the pods up by a hash of (template, pod), and a pod among the first that lack
//! the template fetches it. Every router computes the same ranking from the same
//! reports, so the copies go to the same pods without any coordination.

use std::collections::{HashMap, HashSet};
use std::io::{BufReader, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use denoised_models::flux::template_transfer;
use ractor::ActorCell;

use super::capture::{capture, Identity, TemplateInput};
use crate::router::state::sessions::Sessions;
use crate::router::state::Ctx;
use crate::wire::pods::{Exported, FromPeer, PodMsg};
use crate::wire::{CacheMsg, ErrorKind, JobId, Wire, WireError};
use crate::workers::cache::disk::DiskTier;

/// How long a stream's next chunk may take (the sender reads its disk at its cap).
const CHUNK_WAIT: Duration = Duration::from_secs(30);

/// The pod's disk tier of templates, which copies to peers are read from (the cache
/// process is its only writer: a copy from a peer is received beside it, [`staging`]).
fn disk(ctx: &Ctx) -> Result<DiskTier, String> {
    DiskTier::open(&ctx.config.cache.resolved_dir(), &ctx.model)
}

/// Where this router receives copies from peers before the cache moves them in.
pub fn staging(ctx: &Ctx) -> std::path::PathBuf {
    DiskTier::staging(&ctx.config.cache.resolved_dir(), &ctx.model)
}

/// Removes what copies cut short left in the staging directory (at start: no copy runs).
pub fn sweep_staging(ctx: &Ctx) {
    let dir = staging(ctx);
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            tracing::info!("removing a copy cut short: {}", e.path().display());
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The sending side: the streams this pod's peers have open.
#[derive(Default)]
pub struct Outgoing {
    next: AtomicU64,
    streams: Mutex<HashMap<u64, Arc<Mutex<Receiver<Result<Vec<u8>, String>>>>>>,
}

/// Writes a stream's bytes into its channel (bounded: the sender runs no further
/// ahead than a few chunks of what the receiver took).
struct ChannelWriter(SyncSender<Result<Vec<u8>, String>>);

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .send(Ok(buf.to_vec()))
            .map_err(|_| std::io::Error::other("the receiver closed the transfer"))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Outgoing {
    /// The newest version of template `id` on this pod's disk.
    pub fn export(&self, ctx: &Ctx, id: &str) -> Result<Exported, WireError> {
        let d = disk(ctx).map_err(WireError::internal)?;
        let (name, info, image) = d.export(id).ok_or_else(|| {
            WireError::new(
                crate::wire::ErrorKind::NotFound,
                format!("no template `{id}` on this pod's disk"),
            )
        })?;
        Ok(Exported { name, info, image })
    }

    /// Opens a stream for a receiver's request: a thread sends the version it names
    /// (or refuses) into the stream's channel.
    pub fn open(&self, ctx: &Ctx, request: Vec<u8>) -> Result<u64, WireError> {
        let d = disk(ctx).map_err(WireError::internal)?;
        let cap = (ctx.config.cluster.transfer_mb_per_s > 0.0)
            .then_some(ctx.config.cluster.transfer_mb_per_s * 1e6);
        let (name, offset) = template_transfer::read_request(&mut BufReader::new(&request[..]))
            .map_err(|e| WireError::bad_input(e.to_string()))?;
        let (tx, rx) = sync_channel(4);
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.streams
            .lock()
            .unwrap()
            .insert(id, Arc::new(Mutex::new(rx)));
        std::thread::spawn(move || {
            let mut w = ChannelWriter(tx.clone());
            let r = match d.version_dir(&name) {
                Some(dir) => template_transfer::send(&dir, offset, &mut w, cap).map(|_| ()),
                None => template_transfer::refuse(&mut w, &format!("no template `{name}` here")),
            };
            if let Err(e) = r {
                let _ = tx.send(Err(e.to_string()));
            }
        });
        Ok(id)
    }

    /// The stream's next bytes; empty once the sender is done.
    pub async fn next(&self, id: u64) -> Result<Vec<u8>, WireError> {
        let rx = self.streams.lock().unwrap().get(&id).cloned();
        let rx = rx.ok_or_else(|| WireError::bad_input(format!("no transfer {id}")))?;
        tokio::task::spawn_blocking(move || {
            match rx.lock().unwrap().recv_timeout(CHUNK_WAIT) {
                Ok(Ok(bytes)) => Ok(bytes),
                Ok(Err(e)) => Err(WireError::internal(e)),
                // The sending thread finished: the end of the stream.
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Ok(vec![]),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    Err(WireError::internal("the template's sender stalled"))
                }
            }
        })
        .await
        .map_err(|e| WireError::internal(e.to_string()))?
    }

    /// Drops a stream (its sending thread stops at its next write).
    pub fn close(&self, id: u64) {
        self.streams.lock().unwrap().remove(&id);
    }
}

/// The receiving side of a stream, as `std::io` sees it: what the receiver writes is its
/// request, sent with `Open` at its first read; reads pull `Next` chunks.
struct MeshStream {
    cell: ActorCell,
    sessions: Arc<Sessions>,
    rt: tokio::runtime::Handle,
    request: Vec<u8>,
    id: Option<u64>,
    chunk: Vec<u8>,
    pos: usize,
    bytes: u64,
}

impl MeshStream {
    fn call<T: Send + 'static>(
        &self,
        build: impl FnOnce(ractor::RpcReplyPort<crate::wire::Res<T>>) -> PodMsg,
    ) -> std::io::Result<T> {
        self.rt
            .block_on(self.sessions.ask(&self.cell, CHUNK_WAIT, build))
            .map_err(|e| std::io::Error::other(e.message))
    }
}

impl Write for MeshStream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.request.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Read for MeshStream {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.id.is_none() {
            let request = std::mem::take(&mut self.request);
            self.id = Some(self.call(|p| PodMsg::Open(FromPeer::of(request), p))?);
        }
        if self.pos == self.chunk.len() {
            let id = self.id.unwrap_or_default();
            self.chunk = self.call(|p| PodMsg::Next(FromPeer::of(id), p))?;
            self.pos = 0;
            self.bytes += self.chunk.len() as u64;
        }
        let n = out.len().min(self.chunk.len() - self.pos);
        out[..n].copy_from_slice(&self.chunk[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl Drop for MeshStream {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.sessions
                .tell(&self.cell, PodMsg::Close(FromPeer::of(id)));
        }
    }
}

/// Fetches the newest version of template `id` from the peer whose pod actor is `cell`
/// into this pod's disk tier, and has this pod's cache index it (`wanted`: only that
/// version, the registry's). The bytes moved.
pub async fn fetch(
    ctx: &Ctx,
    cell: ActorCell,
    id: &str,
    wanted: Option<u64>,
) -> Result<u64, String> {
    if crate::fault::cut() {
        return Err("cut off its peers (DENOISED_FAULT_CUT)".into());
    }
    let pods = ctx.pods.as_ref().ok_or("not a pod of a cluster")?;
    let sessions = pods.sessions.clone();
    let asked = Instant::now();
    let e = sessions
        .ask(&cell, CHUNK_WAIT, |p| {
            PodMsg::Export(FromPeer::of(id.to_string()), p)
        })
        .await
        .map_err(|e| e.message)?;
    let info = exported(ctx, id, &e)?;
    if wanted.is_some_and(|v| e.name != crate::wire::version_name(id, v)) {
        return Err(format!(
            "the peer holds {} of template `{id}`, not version {}: refused",
            e.name,
            wanted.unwrap_or_default()
        ));
    }
    // The receiver takes no more than the template's description announces, and never
    // more than its whole disk tier.
    let max_bytes = (info.cache_bytes + info.vae_trace_bytes).min(ctx.config.cache.disk_bytes);
    let dir = staging(ctx);
    let dest = dir.join(&e.name);
    let staged = dest.to_string_lossy().to_string();
    let rt = tokio::runtime::Handle::current();
    let name = e.name.clone();
    let moved = tokio::task::spawn_blocking(move || -> Result<u64, String> {
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let _ = std::fs::remove_dir_all(&dest);
        let mut stream = MeshStream {
            cell,
            sessions,
            rt,
            request: vec![],
            id: None,
            chunk: vec![],
            pos: 0,
            bytes: 0,
        };
        let r = template_transfer::receive(&mut stream, &name, &dest, max_bytes)
            .map_err(|e| e.to_string())
            .and_then(|_| DiskTier::stage(&dest, &e.info, &e.image).map_err(|e| e.to_string()));
        if r.is_err() {
            let _ = std::fs::remove_dir_all(&dest);
        }
        r.map(|()| stream.bytes)
    })
    .await
    .map_err(|e| e.to_string())??;
    // A delete that crossed the copy (told by a peer meanwhile) wins: the copy is of
    // what was deleted.
    if pods.forgotten_since(id, asked) {
        let _ = std::fs::remove_dir_all(&staged);
        return Err(format!("template `{id}` was deleted while it was copied"));
    }
    let c = ctx.cache().await.map_err(|e| e.message)?;
    let adopted = ctx
        .ask(&c, |p| {
            CacheMsg::Adopt(Wire((id.to_string(), staged.clone())), p)
        })
        .await;
    if adopted.is_err() {
        let _ = std::fs::remove_dir_all(&staged);
    }
    ctx.templates_changed();
    adopted.map_err(|e| e.message)?;
    Ok(moved)
}

/// The pods that should hold template `id` (`replicas` of them, among `pods`): the
/// first by a hash of (template, pod), the same in every router.
pub fn chosen<'a>(id: &str, pods: &'a [String], replicas: usize) -> Vec<&'a String> {
    use std::hash::{Hash, Hasher};
    let rank = |pod: &String| {
        let mut h = std::hash::DefaultHasher::new();
        (id, pod).hash(&mut h);
        h.finish()
    };
    let mut ranked: Vec<&String> = pods.iter().collect();
    ranked.sort_by_key(|p| (rank(p), *p));
    ranked.truncate(replicas);
    ranked
}

/// Copies template `id` (`wanted`: that version) from peer `from` into this pod,
/// counted in the metrics. The bytes moved.
pub async fn copy_from(
    ctx: &Ctx,
    from: &str,
    id: &str,
    wanted: Option<u64>,
) -> Result<u64, String> {
    let r = match ctx.pods.as_ref().and_then(|p| Some((p, p.cell(from)?))) {
        Some((pods, cell)) => tokio::select! {
            r = fetch(ctx, cell, id, wanted) => r,
            () = pods.until_down(from) => Err(format!("pod {from} stopped reporting")),
        },
        None => Err(format!("pod {from} went away")),
    };
    let result = match &r {
        Ok(bytes) => {
            ctx.metrics.pod_transfer_bytes.inc_by(*bytes);
            tracing::info!(
                "template `{id}`: copied from pod {from} ({:.1} MB)",
                *bytes as f64 / 1e6
            );
            "ok"
        }
        Err(e) => {
            tracing::warn!("template `{id}`: copy from pod {from} failed: {e}");
            "error"
        }
    };
    ctx.metrics
        .pod_transfers
        .get_or_create(&[("pod", from.to_string()), ("result", result.into())])
        .inc();
    r
}

/// Each second, from one listing of this pod's templates: the copies this pod should
/// make ([`replicate`]), and the recipes it should learn ([`learn_recipes`]; one round
/// at a time, `learning`: a round asks each new template's holder).
pub async fn tend(ctx: Arc<Ctx>, learning: Arc<tokio::sync::Mutex<()>>) {
    let mine: HashSet<String> = match ctx.templates().await {
        Ok(t) => t.into_iter().map(|t| t.id).collect(),
        Err(_) => return,
    };
    replicate(&ctx, &mine);
    if let Ok(_round) = learning.try_lock_owned() {
        learn_recipes(&ctx, &mine).await;
    }
}

/// One round of replication: for each template with fewer than `[cluster]
/// template_replicas` holders up, this pod (holding `mine`) fetches it when it is among
/// the pods chosen to hold it (one copy of a template at a time:
/// [`crate::router::state::pods::Pods::obtaining`]).
fn replicate(ctx: &Arc<Ctx>, mine: &HashSet<String>) {
    let Some(pods) = &ctx.pods else { return };
    let replicas = ctx.config.cluster.template_replicas as usize;
    if replicas <= 1 {
        return;
    }
    let grace = Duration::from_secs_f64(ctx.config.cluster.replicate_after_seconds);
    let (up, held) = pods.placement(grace);
    let mut everyone = up.clone();
    everyone.push(pods.me.clone());
    for (id, holders) in held {
        if mine.contains(&id) || holders.len() >= replicas {
            continue;
        }
        let lacking: Vec<String> = everyone
            .iter()
            .filter(|p| !holders.contains(p))
            .cloned()
            .collect();
        if !chosen(&id, &lacking, replicas - holders.len()).contains(&&pods.me) {
            continue;
        }
        // From a holder whose disk has it (a fresh template's is still being written).
        let Some(from) = pods.holder(&id, &[]) else {
            continue;
        };
        let Ok(guard) = pods.obtaining(&id).try_lock_owned() else {
            continue;
        };
        // With a registry, the version it records (reports of others are filtered out).
        let wanted = ctx
            .template_registry()
            .and_then(|r| r.record(&id))
            .map(|r| r.version);
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let _ = copy_from(&ctx, &from, &id, wanted).await;
            drop(guard);
        });
    }
}

/// Keeps the recipe of each template a peer up holds that this pod (holding `mine`) is
/// to keep a recipe of: among the first `[cluster] recipe_copies` of the pods that lack
/// the template, by the ranking [`chosen`] gives every router alike (asked of a holder
/// whose disk has it: its description and image). The other pods ask for it when they
/// need it ([`recipe_from_peers`]).
async fn learn_recipes(ctx: &Ctx, mine: &HashSet<String>) {
    let Some(pods) = &ctx.pods else { return };
    let (up, held) = pods.placement(Duration::ZERO);
    let copies = ctx.config.cluster.recipe_copies as usize;
    for (id, holders) in held {
        if mine.contains(&id) || pods.recipes.has(&id) || pods.was_forgotten(&id) {
            continue;
        }
        let lacking: Vec<String> = up
            .iter()
            .chain(std::iter::once(&pods.me))
            .filter(|p| !holders.contains(p))
            .cloned()
            .collect();
        if !chosen(&id, &lacking, copies).contains(&&pods.me) {
            continue;
        }
        let Some(from) = pods.holder(&id, &[]) else {
            continue;
        };
        let asked = Instant::now();
        match ask_recipe(ctx, &from, &id, Ask::Export).await {
            Ok(_) if pods.forgotten_since(&id, asked) => {
                tracing::debug!("template `{id}`: deleted while its recipe came: not kept")
            }
            Ok((info, image)) => match pods.recipes.save(&id, &info, &image) {
                Ok(()) => tracing::debug!("template `{id}`: kept its recipe"),
                Err(e) => tracing::debug!("template `{id}`: cannot keep its recipe: {e}"),
            },
            Err(e) => tracing::debug!("template `{id}`: no recipe from pod {from}: {e}"),
        }
    }
    ctx.metrics.pod_recipes.set(pods.recipes.count() as i64);
}

/// The description of what a peer exported for template `id`, checked before any path
/// is built from it or anything is kept: a version of that template, of the model this
/// pod serves.
fn exported(ctx: &Ctx, id: &str, e: &Exported) -> Result<crate::wire::TemplateInfo, String> {
    crate::wire::check_version_name(id, &e.name)?;
    let info = crate::workers::cache::disk::stored_info(&e.info)?;
    if info.id != id || info.model != ctx.model {
        return Err(format!(
            "the peer sent template `{}` of model `{}` for `{id}` of `{}`: refused",
            info.id, info.model, ctx.model
        ));
    }
    Ok(info)
}

/// What to ask a peer for a recipe: the description and image of its copy
/// (`Export`), or of its copy or the recipe it keeps (`Recipe`).
#[derive(Clone, Copy)]
enum Ask {
    Export,
    Recipe,
}

/// Template `id`'s recipe (its stored description, its image) from peer `from`: of
/// the registry's version, when there is one.
async fn ask_recipe(
    ctx: &Ctx,
    from: &str,
    id: &str,
    ask: Ask,
) -> Result<(Vec<u8>, Vec<u8>), String> {
    let (pods, cell) = ctx
        .pods
        .as_ref()
        .and_then(|p| Some((p, p.cell(from)?)))
        .ok_or_else(|| format!("pod {from} went away"))?;
    let msg = |p| match ask {
        Ask::Export => PodMsg::Export(FromPeer::of(id.to_string()), p),
        Ask::Recipe => PodMsg::Recipe(FromPeer::of(id.to_string()), p),
    };
    if crate::fault::cut() {
        return Err("cut off its peers (DENOISED_FAULT_CUT)".into());
    }
    // An edit may be waiting on it: a peer that stops answering ends the ask when it
    // is marked down, not at the timeout.
    let e = tokio::select! {
        r = pods.sessions.ask(&cell, CHUNK_WAIT, msg) => r.map_err(|e| e.message)?,
        () = pods.until_down(from) => return Err(format!("pod {from} stopped reporting")),
    };
    exported(ctx, id, &e)?;
    match ctx.template_registry().and_then(|r| r.record(id)) {
        Some(r) if r.deleted || e.name != crate::wire::version_name(id, r.version) => {
            Err(format!("{} is not the registry's version", e.name))
        }
        _ => Ok((e.info, e.image)),
    }
}

/// Template `id`'s recipe from a peer up that keeps it or holds a copy, asked in the
/// order [`chosen`] ranks them (its recipe's keepers first): for an edit that needs to
/// capture it again here and has no recipe of its own. Kept here once found.
async fn recipe_from_peers(ctx: &Ctx, id: &str) -> Option<(crate::wire::TemplateInfo, Vec<u8>)> {
    let pods = ctx.pods.as_ref()?;
    let (up, _) = pods.placement(Duration::ZERO);
    for from in chosen(id, &up, up.len()) {
        let asked = Instant::now();
        match ask_recipe(ctx, from, id, Ask::Recipe).await {
            Ok(_) if pods.forgotten_since(id, asked) => {
                tracing::info!("template `{id}`: deleted while its recipe came from pod {from}");
                return None;
            }
            Ok((info, image)) => {
                tracing::info!("template `{id}`: its recipe came from pod {from}");
                if let Err(e) = pods.recipes.save(id, &info, &image) {
                    tracing::warn!("template `{id}`: cannot keep its recipe: {e}");
                }
                return pods.recipes.get(id);
            }
            Err(e) => tracing::debug!("template `{id}`: no recipe from pod {from}: {e}"),
        }
    }
    None
}

/// Brings template `id` into this pod for an edit that found it missing (`missing`,
/// its error, when nothing can): a copy from a peer that holds it, or a capture again
/// from its recipe when no holder is left or that is cheaper by the cost model. One at a time per template: an edit
/// that waited for another's copy finds it here.
pub async fn obtain(ctx: &Ctx, job: JobId, id: &str, missing: WireError) -> Result<(), WireError> {
    let Some(pods) = &ctx.pods else {
        return Err(missing);
    };
    // With a registry, its current version (404 when it has none).
    let wanted = super::identity::wanted(ctx, id, missing.clone()).await?;
    let lock = pods.obtaining(id);
    let _held = lock.lock().await;
    match ctx.template(id).await {
        Ok(t) if wanted.is_none_or(|v| t.version == v) => return Ok(()),
        // An older copy goes first (a newer one, uncommitted, stays and is refused).
        Ok(t) if wanted.is_some_and(|v| t.version < v) => {
            let _ = ctx.delete_template(id, Some(t.version)).await;
        }
        _ => {}
    }
    let kept = |r: Option<(crate::wire::TemplateInfo, Vec<u8>)>| {
        r.filter(|(info, _)| wanted.is_none_or(|v| info.version == v))
    };
    let mut recipe = kept(pods.recipes.get(id));
    if recipe.is_none() && pods.holder(id, &[]).is_none() {
        // This pod's view of its peers may be older than the template (captured a
        // moment ago, seen first by the pod that routed the edit here): ask them now.
        pods.refresh_all().await;
        if pods.holder(id, &[]).is_none() {
            // No copy is left: its recipe, from a pod that keeps it.
            recipe = kept(recipe_from_peers(ctx, id).await);
        }
    }
    // A copy, unless capturing it again is cheaper by the cost model (a large template
    // over a slow link), as routing priced it.
    let pricing = ctx.pricing();
    let cheaper = recipe
        .as_ref()
        .is_some_and(|(info, _)| pods.recapture_is_cheaper(id, info, &pricing));
    let waited = Instant::now();
    let limit = Duration::from_secs(ctx.config.server.stage_timeout_seconds);
    let mut tried = vec![];
    while !cheaper {
        if let Some(from) = pods.holder(id, &tried) {
            if copy_from(ctx, &from, id, wanted).await.is_ok() {
                return Ok(());
            }
            tried.push(from);
        } else if pods.writing(id, &tried) && waited.elapsed() < limit {
            // A holder captured it a moment ago and is still writing its disk copy
            // (what a copy reads): wait for it, as for the copy.
            tokio::time::sleep(Duration::from_millis(200)).await;
            pods.refresh_all().await;
        } else {
            break;
        }
    }
    let Some((info, image)) = recipe else {
        return Err(match (wanted, pods.holders(id).is_empty()) {
            // The registry holds it: it exists, however unreachable its copies are.
            (Some(v), _) => WireError::new(
                ErrorKind::Unavailable,
                format!(
                    "template `{id}`: no pod that holds its version {v} answers, and no \
                     recipe of it is here; retry later"
                ),
            ),
            (None, true) => missing,
            (None, false) => pods.no_holder(id),
        });
    };
    tracing::warn!(
        "template `{id}`: capturing it again from its recipe (no copy, or a copy costs more)"
    );
    let r = recapture(ctx, job, info, image, wanted).await;
    let result = if r.is_ok() { "ok" } else { "error" };
    ctx.metrics
        .recaptures
        .get_or_create(&[("result", result)])
        .inc();
    r
}

/// Captures a template again from its recipe (its description and image), under its id
/// (`wanted`: as the registry's version, which the recipe is of).
async fn recapture(
    ctx: &Ctx,
    job: JobId,
    info: crate::wire::TemplateInfo,
    image: Vec<u8>,
    wanted: Option<u64>,
) -> Result<(), WireError> {
    let cache_mode = match info.cache_mode.as_str() {
        "" => ctx.config.cache.mode.parse(),
        m => m.parse(),
    }
    .map_err(WireError::internal)?;
    let input = TemplateInput {
        id: info.id,
        image,
        prompt: info.prompt,
        steps: info.steps,
        guidance: info.guidance,
        seed: info.seed,
        max_sequence_length: info.max_sequence_length,
        replace: false,
        identity: match wanted {
            Some(v) => Identity::Existing(v),
            None => Identity::Local,
        },
        cache_mode,
        step_stride: info.kv_step_stride,
        loras: info.loras,
    };
    match capture(ctx, job, &input).await {
        // Registered here meanwhile (by a client): that one stands.
        Err(e) if e.kind == ErrorKind::Conflict => Ok(()),
        r => r.map(|_| ()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_router_chooses_the_same_pods_for_a_template() {
        let pods: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let mut shuffled = pods.clone();
        shuffled.reverse();
        for id in ["room", "hall", "t3"] {
            let x = chosen(id, &pods, 2);
            let y = chosen(id, &shuffled, 2);
            assert_eq!(x, y);
            assert_eq!(x.len(), 2);
        }
        // Spread: not every template on the same two pods.
        let firsts: HashSet<&String> = (0..20)
            .map(|i| chosen(&format!("t{i}"), &pods, 1)[0])
            .collect();
        assert!(firsts.len() > 1);
    }
}
