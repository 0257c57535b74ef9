//! AutoencoderKL as FLUX.1 uses it (work in progress).
