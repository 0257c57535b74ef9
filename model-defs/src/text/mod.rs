//! Text encoders and tokenizers of FLUX.1: CLIP-L (pooled) and T5 v1.1 (work in progress).
