"""The official `openai` Python client against a running denoised daemon.

Run by tests/openai_client.rs (which starts the daemon and checks the images):
    python3 tests/openai_client.py edit URL IMAGE.png MASK.png OUT_PREFIX
    python3 tests/openai_client.py generate URL OUT_PREFIX
Each writes OUT_PREFIX.0.png and OUT_PREFIX.1.png and prints the reply's model name
(a generation also prints each image's approx_cache extension, as JSON lines).
"""

import base64
import sys

import openai
from openai import OpenAI

import json


def generate(client, out):
    # Two images of a prompt (seeds 7 and 8: `seed`, `steps` are extensions), then the
    # first again, which the approximate cache serves from the first's noise states
    # (`exact`: only a state of the same prompt and seed).
    kw = dict(
        model="any-name",
        prompt="a lighthouse on a cliff at dusk",
        size="64x64",
        response_format="b64_json",
    )
    r = client.images.generate(n=2, extra_body={"seed": 7, "steps": 6}, **kw)
    assert len(r.data) == 2, r
    again = client.images.generate(
        n=1, extra_body={"seed": 7, "steps": 6, "approx_cache": "exact"}, **kw
    )
    for i, d in enumerate(list(r.data) + list(again.data)):
        with open(f"{out}.{i}.png", "wb") as f:
            f.write(base64.b64decode(d.b64_json))
        print(json.dumps(d.model_extra.get("approx_cache")))
    try:
        client.images.generate(prompt="x", size="63x64")
        sys.exit("a size off the model's grid was accepted")
    except openai.BadRequestError as e:
        assert "multiples of" in e.message, e.message
    print(r.model)


mode, url = sys.argv[1:3]
client = OpenAI(base_url=url + "/v1", api_key="unused")
if mode == "generate":
    generate(client, sys.argv[3])
    sys.exit(0)
image, mask, out = sys.argv[3:6]

# Two edits of the image where the mask is transparent; seed and steps are extensions.
with open(image, "rb") as im, open(mask, "rb") as mk:
    r = client.images.edit(
        model="any-name",
        image=im,
        mask=mk,
        prompt="a red ball",
        n=2,
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": 3, "steps": 4},
    )
assert len(r.data) == 2, r
for i, d in enumerate(r.data):
    with open(f"{out}.{i}.png", "wb") as f:
        f.write(base64.b64decode(d.b64_json))

# Errors come back in OpenAI's shape, which the client raises as its own exceptions.
with open(image, "rb") as im:
    try:
        client.images.edit(image=im, mask=open(mask, "rb"), prompt="x", size="512x512")
        sys.exit("a size other than the image's was accepted")
    except openai.BadRequestError as e:
        assert "differs from the image" in e.message, e.message

print(r.model)
