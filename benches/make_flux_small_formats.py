"""Writes the flux-small transformer (denoised's `FluxConfig::small`: hidden 768, 4 double + 8 single
blocks) with seeded weights in the checkpoint files users hold, for `denoised bench weights` and the
memory figures in docs/performance.md ("Checkpoint formats"):

  OUT/flux-small-f32.safetensors   BFL layout, f32
  OUT/flux-small-bf16.safetensors  BFL layout, bf16
  OUT/flux-small-Q8_0.gguf         city96's layout, Q8_0 where rows are whole 32-value blocks
  OUT/flux-small-Q4_K.gguf         Q4_K where rows are whole 256-value super-blocks, F16 otherwise

The layout conversion and the quantisers are tests/fixtures/gen_format_fixtures.py's. Nothing is
downloaded; about 1.4 GB in all.

    pip install torch diffusers gguf safetensors numpy
    python3 benches/make_flux_small_formats.py OUT
"""
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
import gen_format_fixtures as g  # noqa: E402
from diffusers import FluxTransformer2DModel  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
cfg = dict(patch_size=1, in_channels=384, out_channels=64, num_layers=4, num_single_layers=8,
           attention_head_dim=64, num_attention_heads=12, joint_attention_dim=768,
           pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 24, 24])
m = g.seed_weights(FluxTransformer2DModel(**cfg).eval())
bfl = g.to_bfl(m.state_dict(), cfg["num_layers"], cfg["num_single_layers"])
save_file(bfl, os.path.join(out, "flux-small-f32.safetensors"))
save_file({k: v.to(torch.bfloat16) for k, v in bfl.items()}, os.path.join(out, "flux-small-bf16.safetensors"))
for ty in (Q.Q8_0, Q.Q4_K):
    g.write_gguf(os.path.join(out, f"flux-small-{ty.name}.gguf"), g.gguf_tensors(bfl, ty))
for f in sorted(os.listdir(out)):
    print(f, os.path.getsize(os.path.join(out, f)))
