//! A synthetic text-to-image prompt trace for the approximate cache's policy study.
//!
//! There is no prompt data set offline, so the trace is made up, with the structure the
//! NIRVANA paper describes in production traffic, each part a parameter:
//! - **prompt families** (a subject, a style) drawn by **Zipf** popularity;
//! - **attribute substitutions** within a family: a few slots (colour, setting, ...)
//!   that usually take the family's common value and sometimes another one;
//! - **drifting popularity**: every `drift_every` requests the popularity ranking
//!   shifts by a tenth of the families, so yesterday's head becomes the tail;
//! - **clustered embeddings**: families share a cluster direction, so prompts of
//!   different families in one cluster are moderately similar.
//!
//! Embeddings are random Gaussian directions mixed with these weights, standing in for
//! CLIP pooled embeddings: similar prompts are close by construction, which is what the
//! cache sees; nothing here says how CLIP would place real prompts.

/// The trace's shape.
#[derive(Clone, Debug)]
pub struct TraceSpec {
    pub requests: usize,
    pub families: usize,
    pub clusters: usize,
    /// Attribute slots per prompt, and values per slot.
    pub slots: usize,
    pub values: usize,
    /// Chance that a slot takes a value other than its family's common one.
    pub substitution: f64,
    pub zipf: f64,
    pub drift_every: usize,
    pub dim: usize,
    pub seed: u64,
}

impl Default for TraceSpec {
    fn default() -> Self {
        TraceSpec {
            requests: 20_000,
            families: 500,
            clusters: 25,
            slots: 3,
            values: 6,
            substitution: 0.3,
            zipf: 1.0,
            drift_every: 5_000,
            dim: 256,
            seed: 7,
        }
    }
}

/// One request of the trace.
pub struct Request {
    /// Identifies the prompt text (family and attribute values).
    pub text: u64,
    pub embedding: Vec<f32>,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 11
    }
    fn uniform(&mut self) -> f64 {
        self.next() as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform().max(1e-300), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
    fn direction(&mut self, dim: usize) -> Vec<f32> {
        let v: Vec<f32> = (0..dim).map(|_| self.normal()).collect();
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.into_iter().map(|x| x / n).collect()
    }
}

/// Weights of the embedding's parts: cluster, family, each attribute slot.
const CLUSTER_W: f32 = 0.6;
const FAMILY_W: f32 = 1.0;
const SLOT_W: f32 = 0.3;

/// The trace of `spec`, deterministic for its seed.
pub fn generate(spec: &TraceSpec) -> Vec<Request> {
    let mut rng = Rng(spec.seed ^ 0x2545_F491_4F6C_DD1D);
    let clusters: Vec<Vec<f32>> = (0..spec.clusters.max(1))
        .map(|_| rng.direction(spec.dim))
        .collect();
    let families: Vec<Vec<f32>> = (0..spec.families)
        .map(|_| rng.direction(spec.dim))
        .collect();
    let attrs: Vec<Vec<Vec<f32>>> = (0..spec.slots)
        .map(|_| (0..spec.values).map(|_| rng.direction(spec.dim)).collect())
        .collect();
    // Each family's common value per slot.
    let common: Vec<Vec<usize>> = (0..spec.families)
        .map(|_| {
            (0..spec.slots)
                .map(|_| rng.next() as usize % spec.values)
                .collect()
        })
        .collect();
    let cdf: Vec<f64> = (1..=spec.families)
        .scan(0.0, |acc, r| {
            *acc += 1.0 / (r as f64).powf(spec.zipf);
            Some(*acc)
        })
        .collect();
    let total = *cdf.last().unwrap_or(&1.0);
    (0..spec.requests)
        .map(|i| {
            let rank = cdf.partition_point(|&c| c < rng.uniform() * total);
            let shift = (i / spec.drift_every.max(1)) * spec.families.div_ceil(10);
            let f = (rank + shift) % spec.families;
            let values: Vec<usize> = common[f]
                .iter()
                .map(|&c| {
                    if rng.uniform() < spec.substitution {
                        rng.next() as usize % spec.values
                    } else {
                        c
                    }
                })
                .collect();
            let mut e: Vec<f32> = clusters[f % clusters.len()]
                .iter()
                .zip(&families[f])
                .map(|(c, v)| CLUSTER_W * c + FAMILY_W * v)
                .collect();
            for (slot, &v) in values.iter().enumerate() {
                for (x, a) in e.iter_mut().zip(&attrs[slot][v]) {
                    *x += SLOT_W * a;
                }
            }
            let text = values.iter().fold(f as u64, |h, &v| {
                h.wrapping_mul(31).wrapping_add(v as u64 + 1)
            });
            Request { text, embedding: e }
        })
        .collect()
}
