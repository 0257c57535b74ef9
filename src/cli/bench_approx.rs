//! `denoised bench approx-cache`: the approximate cache's eviction policies on one
//! synthetic prompt trace at equal capacity (`denoised_actors::approx::trace`): hit
//! rate per K and the share of denoising steps saved; one JSON line per policy.
//!
//! Only the cache's decisions are simulated (no model runs): a hit at K saves K of the
//! request's steps, a miss stores the states of `store_steps`.

use clap::Parser;
use denoised_actors::approx::trace::{generate, TraceSpec};
use denoised_actors::approx::{
    store_steps, ApproxCache, EvictionPolicy, ExactKey, Thresholds, STORE_FRACTIONS,
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
    /// Instead of the policy study: with this many prompts indexed (comma-separated),
    /// at CLIP-L's 768 dimensions, time one lookup through the cache (the exact scan
    /// below `ANN_FROM` prompts, the HNSW graph above), and compare the exact scan with
    /// the graph alone: its build time per prompt, search time and recall@1.
    #[arg(long, value_delimiter = ',')]
    pub index_sizes: Vec<usize>,
}

/// One lookup through the cache with `n` prompts indexed, and the exact scan against
/// the HNSW graph over the same prompts, as a JSON value.
fn time_index(n: usize, dim: usize) -> serde_json::Value {
    use denoised_actors::approx::ann::{Ann, ANN_FROM};
    use std::time::Instant;
    let queries = 200;
    let spec = TraceSpec {
        requests: n + queries,
        families: n.max(1),
        dim,
        ..TraceSpec::default()
    };
    let trace = generate(&spec);
    let mut cache = ApproxCache::new(
        u64::MAX,
        EvictionPolicy::Lru,
        Thresholds::default(),
        &STORE_FRACTIONS,
    );
    for (i, r) in trace[..n].iter().enumerate() {
        cache.insert(ExactKey(0), i as u64, &r.embedding, 28, 1);
    }
    let qs = &trace[n..];
    let t0 = Instant::now();
    for r in qs {
        std::hint::black_box(cache.lookup(ExactKey(0), u64::MAX, &r.embedding, 28, false));
    }
    let lookup = t0.elapsed().as_secs_f64() / queries as f64;
    // The components alone: unit vectors, exact scan against the graph.
    let unit = |v: &[f32]| {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / n).collect::<Vec<f32>>()
    };
    let points: Vec<Vec<f32>> = trace[..n].iter().map(|r| unit(&r.embedding)).collect();
    let exact = |q: &[f32]| {
        (0..n)
            .map(|i| (i, denoised_runtime::cpu::simd::dot(&points[i], q)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
    };
    let k_of = |s: Option<(usize, f32)>| s.and_then(|s| Thresholds::default().skip_for(s.1, 28));
    let t0 = Instant::now();
    let ann = Ann::build(points.iter().enumerate().map(|(i, p)| (i as u64, &p[..])));
    let build = t0.elapsed().as_secs_f64() / n.max(1) as f64;
    let (mut scan_s, mut ann_s, mut agree, mut same_k, mut loss) = (0.0, 0.0, 0, 0, 0f32);
    for r in qs {
        let q = unit(&r.embedding);
        let t0 = Instant::now();
        let want = std::hint::black_box(exact(&q));
        scan_s += t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let c = ann.candidates(&q, |_| true);
        // Scored exactly, as the cache does.
        let got = c
            .iter()
            .map(|&i| {
                (
                    i as usize,
                    denoised_runtime::cpu::simd::dot(&points[i as usize], &q),
                )
            })
            .max_by(|a, b| a.1.total_cmp(&b.1));
        ann_s += t0.elapsed().as_secs_f64();
        agree += (got.map(|g| g.0) == want.map(|w| w.0)) as usize;
        same_k += (k_of(got) == k_of(want)) as usize;
        loss = loss.max(want.map_or(0.0, |w| w.1) - got.map_or(0.0, |g| g.1));
    }
    let per = |s: f64| s / queries as f64 * 1e3;
    serde_json::json!({
        "prompts": n, "dim": dim, "index": if n >= ANN_FROM { "hnsw" } else { "scan" },
        "lookup_ms": lookup * 1e3, "scan_ms": per(scan_s), "hnsw_ms": per(ann_s),
        "hnsw_recall_at_1": agree as f64 / queries as f64,
        "hnsw_same_k": same_k as f64 / queries as f64, "hnsw_max_similarity_loss": loss,
        "hnsw_build_ms_per_prompt": build * 1e3,
    })
}

pub fn run(a: Args) -> CliResult {
    if !a.index_sizes.is_empty() {
        for &n in &a.index_sizes {
            println!("{}", time_index(n, 768));
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
        let policy: EvictionPolicy = name.parse()?;
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
