//! The library half of the `denoised` package: whole-model checks that need every
//! crate (the models on the GPU backend against the reference fixtures). The tests and
//! `denoised selftest` run the same code, so a GPU server is verified exactly as CI
//! verifies the emulator.

pub mod selfcheck;
