"""Writes a FluxFillPipeline directory at `flux-small` scale with diffusers' save_pretrained.

The per-role memory measurement (docs/operations.md) loads it into the daemon: each worker
must load only its role's components. The weights are random (seeded), f32, about 1.6 GB;
nothing is downloaded. The tokenizers are the reference fixture's (tests/fixtures), saved
again by the installed transformers (5.x writes tokenizer.json only).

    pip install torch diffusers transformers sentencepiece protobuf
    python benches/make_flux_small_dir.py OUT_DIR

Shapes mirror denoised's `builtin:flux-small` (FluxConfig::small, VaeConfig::flux1,
ClipTextConfig::clip_l, a T5 of width 768).
"""
import os
import pathlib
import sys

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxFillPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

out = pathlib.Path(sys.argv[1])
fixture = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/flux-fill-tiny"
torch.manual_seed(0)

clip_tok = CLIPTokenizer.from_pretrained(fixture / "tokenizer")
t5_tok = T5TokenizerFast.from_pretrained(fixture / "tokenizer_2")
text_encoder = CLIPTextModel(CLIPTextConfig(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=768,
    bos_token_id=0, eos_token_id=2, pad_token_id=1)).eval()
text_encoder_2 = T5EncoderModel(T5Config(
    vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu", is_encoder_decoder=True, pad_token_id=0, eos_token_id=1,
    tie_word_embeddings=False)).eval()
vae = AutoencoderKL(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
    act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
    shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True).eval()
transformer = FluxTransformer2DModel(
    patch_size=1, in_channels=384, out_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=64,
    num_attention_heads=12, joint_attention_dim=768, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 24, 24)).eval()
scheduler = FlowMatchEulerDiscreteScheduler(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096)
pipe = FluxFillPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=clip_tok,
                        text_encoder_2=text_encoder_2, tokenizer_2=t5_tok, transformer=transformer)
pipe.save_pretrained(out, safe_serialization=True)

total = 0
for d in sorted(p for p in out.iterdir() if p.is_dir()):
    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    total += size
    print(f"{d.name:16} {size / 1e6:9.1f} MB")
print(f"{'total':16} {total / 1e6:9.1f} MB")
