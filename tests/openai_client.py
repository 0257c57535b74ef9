"""The official `openai` Python client against a running denoised daemon.

Run by tests/openai_client.rs (which starts the daemon and checks the images):
    python3 tests/openai_client.py edit URL IMAGE.png MASK.png OUT_PREFIX SIZE
    python3 tests/openai_client.py generate URL OUT_PREFIX
    python3 tests/openai_client.py instruct URL IMAGE.png MASK.png OUT_PREFIX  (a Kontext daemon)
Each writes OUT_PREFIX.0.png and OUT_PREFIX.1.png and prints the reply's model name
(a generation also prints each image's approx_cache extension, as JSON lines). Each
also streams one image with `stream=True, partial_images=2` and checks the events.
"""

import base64
import sys

import openai
from openai import OpenAI

import json
import time


def streamed(call, kind, plain_b64):
    """Streams `call` (stream=True, partial_images=2) until its partial images come
    (the daemon's preview factors are fitted in the background at its start), then
    checks the events: `kind.partial_image` x2 with indexes 0 and 1, then
    `kind.completed` whose image is the non-streamed one."""
    deadline = time.time() + 60
    while True:
        events = list(call())
        partial = [e for e in events if e.type == f"{kind}.partial_image"]
        if len(partial) == 2 or time.time() > deadline:
            break
        time.sleep(0.5)
    types = [e.type for e in events]
    assert [e.partial_image_index for e in partial] == [0, 1], types
    assert types[-1] == f"{kind}.completed", types
    for e in partial:
        assert e.output_format == "jpeg" and base64.b64decode(e.b64_json)[:2] == b"\xff\xd8", e
    assert events[-1].b64_json == plain_b64, "the streamed image is the plain one"
    print(json.dumps({"stream": types}), file=sys.stderr)


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
    streamed(
        lambda: client.images.generate(
            n=1, stream=True, partial_images=2,
            extra_body={"seed": 7, "steps": 6, "approx_cache": "off"}, **kw
        ),
        "image_generation",
        r.data[0].b64_json,
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
if mode == "instruct":
    # A FLUX.1 Kontext daemon: an instruction edit (no mask), then the same with a mask.
    image, mask, out = sys.argv[3:6]
    for i, with_mask in enumerate((False, True)):
        with open(image, "rb") as im:
            kw = {"mask": open(mask, "rb")} if with_mask else {}
            r = client.images.edit(model="any-name", image=im, prompt="make the walls blue",
                                   response_format="b64_json", extra_body={"seed": 3, "steps": 4}, **kw)
        with open(f"{out}.{i}.png", "wb") as f:
            f.write(base64.b64decode(r.data[0].b64_json))
    sys.exit(0)
image, mask, out, size = sys.argv[3:7]

# Two edits of the image where the mask is transparent; seed and steps are extensions.
with open(image, "rb") as im, open(mask, "rb") as mk:
    r = client.images.edit(
        model="any-name",
        image=im,
        mask=mk,
        prompt="a red ball",
        n=2,
        size=size,
        response_format="b64_json",
        extra_body={"seed": 3, "steps": 4},
    )
assert len(r.data) == 2, r


def stream_edit():
    with open(image, "rb") as im, open(mask, "rb") as mk:
        return list(client.images.edit(
            model="any-name", image=im, mask=mk, prompt="a red ball", n=1, size=size,
            stream=True, partial_images=2,
            extra_body={"seed": 3, "steps": 6, "use_auto_template": False},
        ))


with open(image, "rb") as im, open(mask, "rb") as mk:
    six = client.images.edit(
        model="any-name", image=im, mask=mk, prompt="a red ball", n=1, size=size,
        response_format="b64_json",
        # Both full runs (the image's second and third sightings would otherwise make
        # and read an auto template): the streamed image is the plain one.
        extra_body={"seed": 3, "steps": 6, "use_auto_template": False},
    )
streamed(stream_edit, "image_edit", six.data[0].b64_json)
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
