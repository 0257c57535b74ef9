//! The device memory budget of a GPU denoise worker, computed once at start.
//!
//! A step must never run out of device memory halfway: the CUDA context survives an
//! out-of-memory error, but the step's requests would fail. So the worker works out at
//! start what its device must hold, and refuses to start when that does not fit:
//!
//! - the transformer's weights (loaded first, so they are already out of `free`);
//! - the step workspace: every activation of one batched forward of the largest
//!   admissible batch, `max_batch` requests of at most `token_budget` computed rows
//!   (or the one largest request the server admits, which may run alone), each
//!   attending over its whole sequence;
//! - the running requests' own tensors (their latents, text and RoPE tables live on
//!   the device from admission to the end): `max_batch` of the largest request;
//! - slab buffers: a pair of (step, block) K/V buffers per edit of the batch, for
//!   templates too large to be resident, which stream from host memory;
//! - a reserve for allocator fragmentation and library workspaces created lazily;
//! - what is left holds resident templates: every resident template the running batch
//!   reads stays during its step, so the batch scheduler admits a request only while
//!   the distinct resident templates of the batch fit here
//!   (`BatchConfig::template_bytes`), and the worker keeps recently used ones in the
//!   rest.
//!
//! The workspace figure is an upper bound of the model's allocations, in units of the
//! hidden width per row and per attended token; tests/gpu_transformer.rs measures the
//! peak allocation of real steps on the emulated device and checks it stays below.

/// Device bytes per computed row of a batched forward, in units of `hidden * dtype`,
/// and per attended token (the text and every image token of each request).
///
/// Measured on the emulated device (`emulated_step_workspace_stays_within_the_budget`
/// in tests/gpu_transformer.rs, which fails if a step ever needs more): a full step
/// peaks at 12.1 units per row (its rows are its attended tokens), an edit at 721
/// units for 63 rows over 288 tokens, in bf16 and f32 alike. The widest live set is a
/// single block's: its input, the fused `[q|k|v|mlp]` projection (7 wide), the
/// attention output and the `[attn|mlp]` concatenation (5 wide). With the attention
/// library's scratch (packed queries, K/V and output of the double blocks and of
/// edits: `crate`-external, `denoised_cuda`'s `sdpa`), the same test measures 2.0-2.1x
/// of headroom for full steps and 1.7-2.8x for edits, for what the emulator does not
/// allocate like a GPU (library workspaces grown on demand). fp8 weights add each GEMM
/// input quantised to E4M3 and its scales: 1.59-1.72x of headroom remains, per-tensor
/// and per-channel alike (`emulated_fp8_step_workspace_stays_within_the_budget`).
pub const ROW_FACTOR: u64 = 16;
pub const CONTEXT_FACTOR: u64 = 4;

/// What the budget is computed from.
#[derive(Clone, Debug)]
pub struct BudgetInputs {
    /// Device memory after the weights were loaded and the kernels warmed up.
    pub free: u64,
    pub total: u64,
    pub weights: u64,
    /// The transformer's hidden width and the device dtype's size.
    pub hidden: usize,
    pub dtype_bytes: usize,
    pub max_batch: usize,
    pub token_budget: usize,
    /// Rows and attended tokens of the largest request the server admits
    /// (`[server] max_pixels`, 512 text tokens).
    pub largest_rows: usize,
    pub largest_context: usize,
    /// Device bytes of the largest request's own tensors.
    pub request_bytes: u64,
    /// Bytes of one (step, block) K/V slab of the largest template.
    pub slab_bytes: u64,
    /// Device bytes of the pre- and postprocess workers that share this device (their
    /// models and workspace, `stage_memory`): set aside before templates, because they
    /// may load after this budget is computed.
    pub stage_bytes: u64,
}

pub use crate::wire::DeviceBudget;

/// The step workspace for `rows` computed rows attending over `context` tokens.
pub fn workspace_bytes(hidden: usize, dtype_bytes: usize, rows: usize, context: usize) -> u64 {
    let unit = (hidden * dtype_bytes) as u64;
    unit * (ROW_FACTOR * rows as u64 + CONTEXT_FACTOR * context as u64)
}

impl DeviceBudget {
    /// The budget, or why the device is too small, with the figures.
    pub fn compute(i: &BudgetInputs) -> Result<DeviceBudget, String> {
        // The batch's rows are bounded by the token budget, except for one oversized
        // request running alone; each of up to max_batch requests attends over at
        // most the largest sequence.
        let rows = i.token_budget.max(i.largest_rows);
        let context = i.largest_context * i.max_batch;
        let workspace = workspace_bytes(i.hidden, i.dtype_bytes, rows, context);
        let requests = i.request_bytes * i.max_batch as u64;
        let slabs = 2 * i.slab_bytes * i.max_batch as u64;
        let reserve = i.total / 20;
        let need = workspace + requests + slabs + reserve + i.stage_bytes;
        if need > i.free {
            return Err(format!(
                "the device is too small for this configuration: {} total, {} \
                 free after {} of weights; a step of max_batch {} / token_budget {} \
                 (and the largest request, {} rows attending over {} tokens) needs {} \
                 of workspace, {} for the requests, {} of slab buffers and a {} \
                 reserve, and the pre- and postprocess workers on this device need {}. \
                 Lower [denoise] max_batch or token_budget, [server] max_pixels, use \
                 dtype = \"bf16\", or put [workers] preprocess_device / \
                 postprocess_device elsewhere",
                human(i.total),
                human(i.free),
                human(i.weights),
                i.max_batch,
                i.token_budget,
                i.largest_rows,
                i.largest_context,
                human(workspace),
                human(requests),
                human(slabs),
                human(reserve),
                human(i.stage_bytes),
            ));
        }
        Ok(DeviceBudget {
            total_bytes: i.total,
            weights_bytes: i.weights,
            workspace_bytes: workspace,
            requests_bytes: requests,
            slab_buffer_bytes: slabs,
            reserve_bytes: reserve,
            stage_bytes: i.stage_bytes,
            template_bytes: i.free - need,
        })
    }

    /// One log line.
    pub fn describe(&self) -> String {
        format!(
            "{} total: weights {}, step workspace {}, requests {}, slab buffers {}, \
             reserve {}, pre/postprocess workers {}, templates {}",
            human(self.total_bytes),
            human(self.weights_bytes),
            human(self.workspace_bytes),
            human(self.requests_bytes),
            human(self.slab_buffer_bytes),
            human(self.reserve_bytes),
            human(self.stage_bytes),
            human(self.template_bytes)
        )
    }
}

/// Bytes for people: GB from 1 GB up, else MB.
fn human(b: u64) -> String {
    if b >= 1_000_000_000 {
        format!("{:.2} GB", b as f64 / 1e9)
    } else {
        format!("{:.1} MB", b as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(free: u64) -> BudgetInputs {
        BudgetInputs {
            free,
            total: 80_000_000_000,
            weights: 23_800_000_000,
            hidden: 3072,
            dtype_bytes: 2,
            max_batch: 16,
            token_budget: 32768,
            largest_rows: 512 + 16384,
            largest_context: 512 + 16384,
            request_bytes: 100_000_000,
            slab_bytes: 16384 * 6144 * 2,
            stage_bytes: 0,
        }
    }

    #[test]
    fn flux_dev_on_an_80_gb_device() {
        let b = DeviceBudget::compute(&inputs(56_000_000_000)).unwrap();
        // 16 x 32768 rows + 4 x 16 x 16896 tokens, 6144 bytes each.
        assert_eq!(b.workspace_bytes, 6144 * (16 * 32768 + 4 * 16 * 16896));
        assert_eq!(b.reserve_bytes, 4_000_000_000);
        assert_eq!(b.requests_bytes, 16 * 100_000_000);
        assert_eq!(b.slab_buffer_bytes, 2 * 16 * 16384 * 6144 * 2);
        assert_eq!(
            b.template_bytes,
            56_000_000_000
                - b.workspace_bytes
                - b.requests_bytes
                - b.slab_buffer_bytes
                - b.reserve_bytes
        );
        assert!(b.describe().contains("templates"));
        // The pre- and postprocess workers on the device come out of the templates.
        let with = DeviceBudget::compute(&BudgetInputs {
            stage_bytes: 12_000_000_000,
            ..inputs(56_000_000_000)
        })
        .unwrap();
        assert_eq!(with.template_bytes, b.template_bytes - 12_000_000_000);
        let e = DeviceBudget::compute(&BudgetInputs {
            stage_bytes: 50_000_000_000,
            ..inputs(56_000_000_000)
        })
        .unwrap_err();
        assert!(
            e.contains("pre- and postprocess workers on this device need 50.00 GB"),
            "{e}"
        );
    }

    #[test]
    fn too_small_a_device_is_refused_with_the_figures() {
        let e = DeviceBudget::compute(&inputs(10_000_000_000)).unwrap_err();
        for want in [
            "80.00 GB total",
            "10.00 GB free",
            "23.80 GB of weights",
            "max_batch 16",
        ] {
            assert!(e.contains(want), "{want} in {e}");
        }
    }
}
