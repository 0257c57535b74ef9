//! Template identity across the pods of a cluster, with a template registry
//! (`crate::router::state::registry`, docs/cluster.md): deletes from any pod, the check
//! that an edit reads the current version, and the loop that keeps this pod's copies
//! and recipes in line with the registry (at start, before the pod is ready, then as
//! the registry changes). Without a registry, a delete is this pod's, told to its peers.

use std::sync::Arc;
use std::time::Duration;

use crate::router::state::registry::{record, Held, Record, Registry};
use crate::router::state::Ctx;
use crate::wire::{ErrorKind, TemplateEntry, TemplateInfo, WireError};

/// Deletes template `id`: from the registry (a tombstone, at any pod, answered once no
/// pod may serve it), then this pod's copy; without a registry, this pod's copy, and
/// every peer up is told.
pub async fn delete(ctx: &Ctx, id: &str) -> Result<TemplateInfo, WireError> {
    let Some(reg) = ctx.template_registry() else {
        let info = ctx.delete_template(id, None).await?;
        if let Some(pods) = &ctx.pods {
            pods.forget(id);
        }
        return Ok(info);
    };
    let gone = reg.delete(id).await?;
    // The registry's answer is the delete's: this pod's copy (if it has one) goes now,
    // the peers' as they read the tombstone (told now too, to be quicker).
    let here = ctx.delete_template(id, Some(gone.version)).await;
    if let Some(pods) = &ctx.pods {
        pods.forget(id);
    }
    Ok(match here {
        Ok(info) => info,
        Err(_) => TemplateInfo {
            id: id.to_string(),
            model: ctx.model.clone(),
            version: gone.version,
            digest: gone.digest,
            ..Default::default()
        },
    })
}

/// A peer says it deleted template `id`: without a registry this pod drops its copy
/// and recipe; with one, the peer's word is a hint to read the record now and apply it.
pub async fn deleted_at_peer(ctx: &Ctx, id: &str) {
    let Some(reg) = ctx.template_registry() else {
        if let Some(p) = &ctx.pods {
            p.forgotten(id);
        }
        if ctx.delete_template(id, None).await.is_ok() {
            tracing::info!("template `{id}`: deleted on a peer, and here");
        }
        return;
    };
    if let Ok((Some(r), _)) = reg.read(id).await {
        apply(ctx, id, &r).await;
    }
}

/// Whether this pod may serve `t` (an edit's pinned template): yes without a registry;
/// with one, only its current version (404 for one deleted or superseded, which an edit
/// brings in anew; 503 when the registry cannot confirm it).
pub async fn confirm(ctx: &Ctx, t: &TemplateEntry) -> Result<(), WireError> {
    let Some(reg) = ctx.template_registry() else {
        return Ok(());
    };
    let id = &t.info.id;
    match reg.check(id, t.version).await? {
        Held::Current => Ok(()),
        Held::Deleted => Err(WireError::new(
            ErrorKind::NotFound,
            format!("unknown template `{id}`"),
        )),
        Held::Uncommitted if reg.in_flight(id, t.version) => Err(WireError::new(
            ErrorKind::Unavailable,
            format!(
                "template `{id}`: version {} is being registered here; retry",
                t.version
            ),
        )),
        held => {
            // Superseded, or a registration whose commit went unanswered and did not
            // happen: this copy goes, and the edit brings in the current version.
            if held == Held::Uncommitted {
                let _ = ctx.delete_template(id, Some(t.version)).await;
            }
            Err(WireError::new(
                ErrorKind::NotFound,
                format!(
                    "template `{id}`: version {} here is not the current one ({held:?})",
                    t.version
                ),
            ))
        }
    }
}

/// The version of template `id` to bring into this pod: the registry's current one
/// (`Err(missing)` when the registry has none), or `None` without a registry (the
/// newest a peer holds).
pub async fn wanted(ctx: &Ctx, id: &str, missing: WireError) -> Result<Option<u64>, WireError> {
    let Some(reg) = ctx.template_registry() else {
        return Ok(None);
    };
    match reg.current(id).await? {
        Some(r) => Ok(Some(r.version)),
        None => Err(missing),
    }
}

/// Keeps this pod's templates in line with the registry: every third of its lease,
/// reads what changed and applies it. The first read reconciles this pod's copies and
/// recipes with every record before the pod is ready (a pod that comes back removes
/// what the registry says is gone before it serves).
pub async fn tend(ctx: Arc<Ctx>) {
    let Some(reg) = ctx.template_registry() else {
        return;
    };
    let tick = reg.lease / 3;
    let mut failing = false;
    loop {
        match reg.refresh().await {
            Ok(changed) => {
                if failing {
                    tracing::info!("the template registry answers again");
                    failing = false;
                }
                if !reg.reconciled() {
                    match reconcile(&ctx, reg).await {
                        Ok(n) => {
                            tracing::info!("templates reconciled with the registry ({n} records)");
                            reg.set_reconciled();
                        }
                        Err(e) => tracing::warn!("reconciling with the registry: {e}"),
                    }
                } else {
                    for (id, r) in changed {
                        apply(&ctx, &id, &r).await;
                    }
                }
            }
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(
                    "the template registry ({}) does not answer: {e}; template edits are \
                     refused once the lease ({:.1} s) is out",
                    reg.describe(),
                    reg.lease.as_secs_f64()
                );
            }
            Err(_) => {}
        }
        tokio::time::sleep(tick.max(Duration::from_millis(100))).await;
    }
}

/// Applies template `id`'s record to this pod: a copy older than it allows goes, and a
/// recipe of an older version (or of a deleted template).
async fn apply(ctx: &Ctx, id: &str, r: &Record) {
    let keep = record::keep_from(r);
    if let Ok(info) = ctx.delete_template(id, Some(keep.saturating_sub(1))).await {
        tracing::info!(
            "template `{id}`: version {} here dropped ({} at pod {})",
            info.version,
            if r.deleted { "deleted" } else { "superseded" },
            r.pod
        );
    }
    if let Some(pods) = &ctx.pods {
        let stale = pods.recipes.info(id).is_some_and(|i| i.version < keep);
        if r.deleted || stale {
            pods.forgotten(id);
        }
    }
}

/// Reconciles this pod's templates with every record: what the registry says is gone
/// or superseded goes; a version newer than the registry's was never committed and
/// goes; a template the registry does not know (held from before the registry) is
/// registered as it is. The records applied.
async fn reconcile(ctx: &Ctx, reg: &Registry) -> Result<usize, WireError> {
    let records = reg.records();
    for (id, r) in &records {
        apply(ctx, id, r).await;
    }
    for t in ctx.templates().await? {
        match reg.record(&t.id) {
            Some(r) if record::judge(Some(&r), t.version) == Held::Uncommitted => {
                let _ = ctx.delete_template(&t.id, Some(t.version)).await;
                tracing::info!(
                    "template `{}`: version {} here was never committed (the registry has {}): dropped",
                    t.id,
                    t.version,
                    r.version
                );
            }
            Some(_) => {}
            None => adopt(ctx, reg, &t).await?,
        }
    }
    Ok(records.len())
}

/// Registers a template this pod held before it had a registry, as it is (unless
/// another pod registered the id first: then that one stands and this copy goes).
async fn adopt(ctx: &Ctx, reg: &Registry, t: &TemplateInfo) -> Result<(), WireError> {
    let digest = match t.digest.is_empty() {
        false => t.digest.clone(),
        true => {
            let entry = ctx.template(&t.id).await?;
            let image = ctx.shm.read_bytes(&entry.image)?;
            super::capture::digest(t, &image)
        }
    };
    match reg.adopt(&t.id, t.version, &digest).await {
        Ok(()) => {
            tracing::info!("template `{}`: registered as version {}", t.id, t.version);
            Ok(())
        }
        Err(e) if e.kind == ErrorKind::Conflict => {
            let _ = ctx.delete_template(&t.id, Some(t.version)).await;
            tracing::warn!(
                "template `{}`: {}; this pod's copy dropped",
                t.id,
                e.message
            );
            Ok(())
        }
        Err(e) => Err(e),
    }
}
