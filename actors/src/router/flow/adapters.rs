//! The LoRAs a request ran with, as its reply reports them (the request's `loras` are
//! resolved at the HTTP edge, `crate::router::http::inputs`; the denoise workers load
//! and apply them, `crate::denoise::adapters`).

pub use crate::wire::pods::LoraApplied;
use crate::wire::WireLora;

/// The reply's `loras` of a request that ran with `loras`, whose set applied at `at`.
pub fn applied(loras: &[WireLora], at: Option<u32>) -> Vec<LoraApplied> {
    loras
        .iter()
        .map(|l| LoraApplied {
            id: l.name.clone(),
            scale: l.scale,
            // A merged set is in the weights from the first step.
            applied_at_step: if l.merged { Some(0) } else { at },
        })
        .collect()
}
