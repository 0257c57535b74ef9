//! The kernel sources, embedded in the binary, and the names each module exports.
//!
//! A module is compiled from `common.cuh` followed by its `.cu` file (NVRTC gets one
//! string, so no include paths are needed on the GPU machine).

pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// A compilation unit: its file name, source, and the kernels it defines.
pub struct Module {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

pub const MODULES: &[Module] = &[
    Module {
        name: "elementwise.cu",
        source: include_str!("../kernels/elementwise.cu"),
        kernels: &[
            "gelu_tanh_f32",
            "gelu_tanh_bf16",
            "silu_f32",
            "silu_bf16",
            "add_f32",
            "add_bf16",
            "bias_rows_f32",
            "bias_rows_bf16",
            "gated_residual_f32",
            "gated_residual_bf16",
            "axpy_cols_f32",
            "axpy_cols_bf16",
            "gated_gelu_f32",
            "gated_gelu_bf16",
            "quick_gelu_f32",
            "quick_gelu_bf16",
            "convert_f32_bf16",
            "convert_bf16_f32",
            "fp8_scales_f32",
            "fp8_scales_bf16",
            "fp8_quantize_f32",
            "fp8_quantize_bf16",
            "fp8_rows_f32",
            "fp8_rows_bf16",
            "fp8_amax_f32",
            "fp8_amax_bf16",
            "fp8_tensor_f32",
            "fp8_tensor_bf16",
            "linear_epilogue_f32",
            "linear_epilogue_bf16",
            "timestep_embed_f32",
            "timestep_embed_bf16",
        ],
    },
    Module {
        name: "norm.cu",
        source: include_str!("../kernels/norm.cu"),
        kernels: &[
            "ln_modulate_f32",
            "ln_modulate_bf16",
            "residual_ln_modulate_f32",
            "residual_ln_modulate_bf16",
            "rms_rope_f32",
            "rms_rope_bf16",
            "gather_f32",
            "gather_bf16",
            "ln_affine_f32",
            "ln_affine_bf16",
            "rms_norm_f32",
            "rms_norm_bf16",
        ],
    },
    Module {
        name: "attention.cu",
        source: include_str!("../kernels/attention.cu"),
        kernels: &[
            "attn_simt_f32",
            "attn_simt_bf16",
            "attn_mma_bf16_d64",
            "attn_mma_bf16_d128",
            "attn_fa2_bf16_d64",
            "attn_fa2_bf16_d128",
            "attn_fa2w_bf16_d64",
            "attn_fa2w_bf16_d128",
            "attn_pack_bf16",
            "attn_unpack_bf16",
            "text_attn_f32",
            "text_attn_bf16",
        ],
    },
    Module {
        name: "image.cu",
        source: include_str!("../kernels/image.cu"),
        kernels: &[
            "im2col_f32",
            "im2col_bf16",
            "gn_stats_f32",
            "gn_stats_bf16",
            "gn_finalize",
            "gn_apply_f32",
            "gn_apply_bf16",
            "softmax_rows_f32",
            "softmax_rows_bf16",
            "transpose_f32",
            "transpose_bf16",
            "copy2d_f32",
            "copy2d_bf16",
            "sige_gather_f32",
            "sige_gather_bf16",
            "sige_scatter_f32",
            "sige_scatter_bf16",
            "sige_group_delta_f32",
            "sige_group_delta_bf16",
        ],
    },
    Module {
        name: "quant.cu",
        source: include_str!("../kernels/quant.cu"),
        kernels: &[
            "dequant_q8_0_f32",
            "dequant_q8_0_bf16",
            "dequant_q4_0_f32",
            "dequant_q4_0_bf16",
            "dequant_q5_0_f32",
            "dequant_q5_0_bf16",
            "dequant_q4_k_f32",
            "dequant_q4_k_bf16",
            "dequant_q5_k_f32",
            "dequant_q5_k_bf16",
            "dequant_q6_k_f32",
            "dequant_q6_k_bf16",
        ],
    },
];

impl Module {
    /// The full source NVRTC compiles: the shared header inlined in place of its include.
    pub fn full_source(&self) -> String {
        self.source.replace("#include \"common.cuh\"", COMMON)
    }
}

/// The module that defines `kernel`.
pub fn module_of(kernel: &str) -> Option<&'static Module> {
    MODULES.iter().find(|m| m.kernels.contains(&kernel))
}
