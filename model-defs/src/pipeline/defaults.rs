//! The pipelines' defaults, as diffusers' FluxFillPipeline, FluxKontextPipeline and
//! FluxPipeline have them:
//! one place for every front end (the command line, the HTTP API, the internal bus).

/// Denoising steps (`num_inference_steps`).
pub const STEPS: u32 = 28;
/// An edit's or a template's guidance scale (FluxFillPipeline's `guidance_scale`).
pub const EDIT_GUIDANCE: f32 = 30.0;
/// A FLUX.1 Kontext instruction edit's guidance scale (FluxKontextPipeline's
/// `guidance_scale`).
pub const KONTEXT_GUIDANCE: f32 = 3.5;
/// A generation's guidance scale (FluxPipeline's `guidance_scale`).
pub const GENERATION_GUIDANCE: f32 = 3.5;
/// T5's sequence length (`max_sequence_length`), also the most it can be.
pub const MAX_SEQUENCE_LENGTH: u32 = 512;
