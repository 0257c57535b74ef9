//! True CFG's two branches on two denoise workers (docs/design.md §Adapters, parallel CFG
//! branches): when two workers have room for a generation with a negative prompt, the
//! positive branch runs on one and the negative on the other, each a request of its
//! own that hands its velocity over every step (`crate::denoise::cfg_pair`, through a
//! slice of this process's arena) and takes the same combined step; otherwise the
//! branches batch in one worker (`DenoiseWork::Generate::true_cfg`).

use ractor::ActorCell;

use super::stages::{run_steps, send_denoise, step_shape, Held};
use crate::denoise::cfg_pair::{pair_bytes, CfgPairRef, PairPartner};
use crate::router::state::jobs::JobStatus;
use crate::router::state::Ctx;
use crate::wire::{
    groups, DenoiseReq, DenoiseWork, Denoised, JobId, NegativeHandles, PreparedRefs, WireError,
    WireLora,
};

/// The workers of a split generation.
pub struct Pair {
    pub positive: ActorCell,
    pub negative: ActorCell,
}

/// Two workers with room now for the branches of `work` (a generation's, before its
/// true CFG is set), or `None`: then it runs batched.
pub(crate) fn place(
    ctx: &Ctx,
    job: JobId,
    prepared: &PreparedRefs,
    negative: &NegativeHandles,
    (work, steps): (&DenoiseWork, u32),
) -> Option<Pair> {
    // Both branches read the same text length (T5 pads to the sequence length).
    if ctx.config.workers.denoise < 2 || negative.txt.shape != prepared.inputs.txt.shape {
        return None;
    }
    let members = ctx.members(groups::DENOISE);
    if members.len() < 2 {
        return None;
    }
    let shape = step_shape(prepared, work, 0);
    let _place = ctx.balancer.enqueue(job, shape, run_steps(work, steps));
    let (a, b) = ctx
        .balancer
        .place_pair(&members, job, shape, run_steps(work, steps))?;
    Some(Pair {
        positive: a.worker,
        negative: b.worker,
    })
}

/// Runs the two branches on their workers; the positive branch's result is the
/// generation's. `work` is the generation's (its `true_cfg` unset): the negative
/// branch stores no states for the approximate cache.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    ctx: &Ctx,
    job: JobId,
    prepared: &PreparedRefs,
    steps: u32,
    work: DenoiseWork,
    (negative, scale): (&NegativeHandles, f32),
    loras: Vec<WireLora>,
    pair: Pair,
    held: &mut Held,
) -> Result<Denoised, WireError> {
    let DenoiseWork::Generate {
        start_at, store_at, ..
    } = work
    else {
        return Err(WireError::internal(
            "a split true CFG runs generations only",
        ));
    };
    let (rows, cols) = match prepared.inputs.latents.shape[..] {
        [r, c] => (r, c),
        _ => return Err(WireError::internal("latents are not [N, C]")),
    };
    let (slot, slice) = ctx.shm.alloc_host(pair_bytes(rows, cols))?;
    // SAFETY: a slice just allocated, seen by nobody else yet.
    unsafe { slice.bytes_mut() }.fill(0);
    let preview_every = ctx.jobs.preview_every(job).await;
    let branch = |positive: bool| {
        let mut inputs = prepared.inputs.clone();
        if !positive {
            inputs.txt = negative.txt.clone();
            inputs.pooled = negative.pooled.clone();
        }
        DenoiseReq {
            job,
            inputs,
            steps,
            rows: prepared.rows,
            cols: prepared.cols,
            active: vec![],
            work: DenoiseWork::Generate {
                start_at,
                store_at: if positive { store_at.clone() } else { vec![] },
                true_cfg: None,
                control: None,
                cfg_pair: Some(CfgPairRef {
                    slot: slot.clone(),
                    rows: rows as u32,
                    cols: cols as u32,
                    positive,
                    scale,
                }),
            },
            loras: loras.clone(),
            // The positive branch previews the pair's latent (both branches hold it).
            preview_every: if positive { preview_every } else { 0 },
        }
    };
    ctx.jobs
        .stage(job, JobStatus::Denoising, Some(pair.positive.clone()));
    // A branch that fails stops the other's wait for its velocity at once.
    let run = |den: ActorCell, req: DenoiseReq| {
        let slice = slice.clone();
        async move {
            let r = send_denoise(ctx, &den, 0.0, req).await;
            if r.is_err() {
                PairPartner::abandon(&slice);
            }
            (den, r)
        }
    };
    let ((pd, p), (nd, n)) = tokio::join!(
        run(pair.positive, branch(true)),
        run(pair.negative, branch(false))
    );
    ctx.shm.release(&[slot]);
    for (den, r) in [(&nd, &n), (&pd, &p)] {
        if let Ok(d) = r {
            held.den.push((den.clone(), d.handles()));
        }
    }
    let d = p?;
    n?;
    ctx.check_cancel(job).await?;
    Ok(d)
}
