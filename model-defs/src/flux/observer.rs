//! What a forward pass reports besides its velocity: hidden states (tests), each
//! block's slabs (a template capture) and each block's image rows (a ControlNet).

use denoised_runtime::{Result, Tensor};

use super::template::CacheMode;

/// Receives intermediate values of a forward pass (tests, template capture). `T` is
/// the backend's tensor type.
pub trait ForwardObserver<T> {
    /// Whether to build and report hidden states (costs a download each).
    fn wants_hidden(&self) -> bool {
        false
    }
    fn hidden(&mut self, _name: &str, _t: Tensor) {}
    /// What request `req` captures of each block, if anything (a template capture).
    fn captures(&self, _req: usize) -> Option<CacheMode> {
        None
    }
    /// The slab of request `req`'s computed image tokens at block `block`, on the
    /// device, in the template cache layout of its [`captures`](Self::captures) mode:
    /// `[K | V]` rows `[A, 2*hidden]` (K post-norm and post-RoPE), or the block's output
    /// `[A, hidden]` (every block but the last). Called as soon as the block has queued
    /// them, so a capture can start copying them out while later blocks compute.
    fn block_slab(&mut self, _req: usize, _block: usize, _slab: &T) -> Result<()> {
        Ok(())
    }
    /// Whether to report each block's image rows ([`block_image`](Self::block_image)).
    fn wants_block_images(&self) -> bool {
        false
    }
    /// The image rows of every request after block `block` (double blocks first), packed
    /// as the velocity's rows: what a ControlNet turns into its residuals.
    fn block_image(&mut self, _block: usize, _img: &T) -> Result<()> {
        Ok(())
    }
}

/// The observer that observes nothing.
pub struct NoObserver;
impl<T> ForwardObserver<T> for NoObserver {}
