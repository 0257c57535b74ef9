//! `denoised bench-approx-cache`: the approximate cache's eviction policies on one
//! synthetic prompt trace at equal capacity (`denoised_actors::approx::trace`): hit
//! rate per K and the share of denoising steps saved; one JSON line per policy.
//!
//! Only the cache's decisions are simulated (no model runs): a hit at K saves K of the
//! request's steps, a miss stores the states of `store_steps`.

use clap::Parser;
use denoised_actors::approx::trace::{generate, TraceSpec};
use denoised_actors::approx::{
    store_steps, ApproxCache, ExactKey, Policy, Thresholds, STORE_FRACTIONS,
};

use super::CliResult;

#[derive(Parser, Debug)]
pub struct Args {
    /// Eviction policies to compare: lcbfu, lru, lfu, gdsf.
    #[arg(long, value_delimiter = ',', default_value = "lcbfu,lru,lfu,gdsf")]
    pub policy: Vec<String>,
    /// Cache capacity in noise states (a miss stores one per stored step).
    #[arg(long, default_value_t = 1000)]
    pub capacity_states: u64,
    /// Denoising steps per request.
    #[arg(long, default_value_t = 28)]
    pub steps: usize,
    #[arg(long, default_value_t = 20_000)]
    pub requests: usize,
    /// Prompt families, Zipf-popular with this exponent.
    #[arg(long, default_value_t = 500)]
    pub families: usize,
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Chance that an attribute slot takes other than its family's common value.
    #[arg(long, default_value_t = 0.3)]
    pub substitution: f64,
    /// Requests between popularity shifts (a tenth of the families each).
    #[arg(long, default_value_t = 5_000)]
    pub drift_every: usize,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Instead of the policy study: time one lookup's exact scan with this many
    /// prompts indexed (comma-separated), at CLIP-L's 768 dimensions.
    #[arg(long, value_delimiter = ',')]
    pub index_sizes: Vec<usize>,
}

/// Mean time of a lookup (the exact cosine scan) over `n` indexed prompts.
fn time_scan(n: usize, dim: usize) -> f64 {
    let spec = TraceSpec {
        requests: n + 200,
        families: n.max(1),
        dim,
        ..TraceSpec::default()
    };
    let trace = generate(&spec);
    let mut cache = ApproxCache::new(
        u64::MAX,
        Policy::Lru,
        Thresholds::default(),
        &STORE_FRACTIONS,
    );
    for (i, r) in trace[..n].iter().enumerate() {
        cache.insert(ExactKey(0), i as u64, &r.embedding, 28, 1);
    }
    let t0 = std::time::Instant::now();
    for r in &trace[n..] {
        std::hint::black_box(cache.lookup(ExactKey(0), u64::MAX, &r.embedding, 28, false));
    }
    t0.elapsed().as_secs_f64() / (trace.len() - n) as f64
}

pub fn run(a: Args) -> CliResult {
    if !a.index_sizes.is_empty() {
        for &n in &a.index_sizes {
            let s = time_scan(n, 768);
            println!(
                "{}",
                serde_json::json!({"prompts": n, "dim": 768, "lookup_ms": s * 1e3})
            );
        }
        return Ok(());
    }
    let spec = TraceSpec {
        requests: a.requests,
        families: a.families,
        zipf: a.zipf,
        substitution: a.substitution,
        drift_every: a.drift_every,
        seed: a.seed,
        ..TraceSpec::default()
    };
    let trace = generate(&spec);
    let ks = store_steps(a.steps, &STORE_FRACTIONS);
    for name in &a.policy {
        let policy: Policy = name.parse()?;
        let mut cache = ApproxCache::new(
            a.capacity_states,
            policy,
            Thresholds::default(),
            &STORE_FRACTIONS,
        );
        let mut hits_at = vec![0u64; a.steps];
        let (mut saved, mut sim) = (0usize, 0f64);
        for r in &trace {
            match cache.lookup(ExactKey(0), r.text, &r.embedding, a.steps, false) {
                Some(h) => {
                    hits_at[h.k] += 1;
                    saved += h.k;
                    sim += h.similarity as f64;
                }
                None => {
                    cache.insert(ExactKey(0), r.text, &r.embedding, a.steps, 1);
                }
            }
        }
        let hits: u64 = hits_at.iter().sum();
        let n = trace.len().max(1) as f64;
        let per_k: serde_json::Map<String, serde_json::Value> = ks
            .iter()
            .map(|&k| (k.to_string(), (hits_at[k] as f64 / n).into()))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "policy": policy.as_str(),
                "capacity_states": a.capacity_states,
                "requests": trace.len(),
                "steps": a.steps,
                "hit_rate": hits as f64 / n,
                "hit_rate_per_k": per_k,
                "steps_saved": saved as f64 / (n * a.steps as f64),
                "mean_hit_similarity": sim / hits.max(1) as f64,
                "prompts_indexed": cache.prompts(),
            })
        );
    }
    Ok(())
}
