"""The official `openai` Python client against a running denoised daemon.

Run by tests/openai_client.rs (which starts the daemon and checks the images):
    python3 tests/openai_client.py URL IMAGE.png MASK.png OUT_PREFIX
Writes OUT_PREFIX.0.png and OUT_PREFIX.1.png and prints the reply's model name.
"""

import base64
import sys

import openai
from openai import OpenAI

url, image, mask, out = sys.argv[1:5]
client = OpenAI(base_url=url + "/v1", api_key="unused")

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
