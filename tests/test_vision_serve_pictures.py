"""/v1/generate_tokens with prompt images as PNG pictures (`data.picture_json`): the embedded engine's service makes
them into the pixel rows the trainer's processor made (same log-probs, same greedy tokens), a tiny fraction of the
pixel rows' bytes; a server that grids them otherwise, and a picture that is not one, are one-line 400s; a vLLM
service (a stand-in `vllm` module, no GPU) gets the very pictures as `multi_modal_data`."""

import base64
import dataclasses
import io
import json
import struct
import sys
import types
import zlib
from types import SimpleNamespace

import httpx
import pytest
import torch
from PIL import Image

from alignrl.serve.process import ServiceProcess

MSGS = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which color?"}]}]


def noise_picture(side: int, seed: int) -> Image.Image:
    """Random pixels: the worst case for PNG's compression."""
    g = torch.Generator().manual_seed(seed)
    return Image.frombytes("RGB", (side, side), bytes(torch.randint(0, 256, (side * side * 3,), generator=g,
                                                                    dtype=torch.uint8).tolist()))


@pytest.fixture(scope="module")
def served(vl_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pictures_serve")
    noise_picture(112, 0).save(root / "noise.png")
    Image.new("RGBA", (56, 84), (0, 128, 255, 100)).save(root / "clear.png")
    with ServiceProcess(["generate", "--model", str(vl_dir)]) as gen:
        yield gen, root


def image_prompt(tok, path):
    from alignrl.data.collate import encode_prompts
    from alignrl.data.records import Sample

    return encode_prompts(tok, [Sample(MSGS, "", images=(str(path),))], 64)[0]


def recording(engine) -> list[dict]:
    """The JSON bodies `engine` (a RemoteRolloutEngine) sends to /v1/generate_tokens, as it sends them."""
    bodies, send = [], engine.client.request

    def request(method, path, **kw):
        if path == "/v1/generate_tokens":
            bodies.append(kw["json"])
        return send(method, path, **kw)

    engine.client.request = request
    return bodies


def test_pictures_give_the_pixel_rows_samples_in_a_fraction_of_the_bytes(served, vl):
    from alignrl.data.collate import encode_prompts
    from alignrl.data.images import ImagePrompt
    from alignrl.data.records import Sample
    from alignrl.interfaces import SamplingParams
    from alignrl.rl.producer import batched_logprobs
    from alignrl.rollout.remote import RemoteRolloutEngine

    gen, root = served
    model, tok = vl
    pictured = [image_prompt(tok, root / "noise.png"), image_prompt(tok, root / "clear.png"),
                encode_prompts(tok, [Sample([{"role": "user", "content": "Which color?"}], "")], 64)[0]]
    assert [len(getattr(p, "pictures", ())) for p in pictured] == [1, 1, 0]
    rows_only = [ImagePrompt(list(p), p.images) if hasattr(p, "images") else p for p in pictured]  # no pictures
    for params in (SamplingParams(n=1, temperature=0.0, max_new_tokens=6),
                   SamplingParams(n=2, max_new_tokens=6, seed=3)):
        outs, sizes = [], []
        for prompts in (pictured, rows_only):
            engine = RemoteRolloutEngine(gen.url, tok)
            bodies = recording(engine)
            outs.append(engine.generate(prompts, params))
            assert len(bodies) == 1
            sizes.append(len(json.dumps(bodies[0]["images"])))
            assert ("pictures" in bodies[0]["images"][0]) == (prompts is pictured)
        a, b = outs
        assert torch.equal(a.response_ids, b.response_ids) and a.response_mask.sum() > 0
        assert ((a.logprobs - b.logprobs) * a.response_mask).abs().max() < 1e-4
        assert [r is None for r in a.images.rows] == [False] * (2 * params.n) + [True] * params.n
        lp = batched_logprobs(model, a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask, 1.0, 2,
                              images=a.images)
        assert ((lp - a.logprobs) * a.response_mask).abs().max() < 1e-4
        print(f"images in the body: pictures {sizes[0]} bytes, pixel rows {sizes[1]} bytes")
        assert sizes[0] * 4 < sizes[1], sizes


def test_requests_are_bounded_by_the_picture_bytes_they_send(served, vl, monkeypatch):
    from alignrl.data.picture_json import pictures_to_json
    from alignrl.interfaces import SamplingParams
    from alignrl.rollout import remote

    gen, root = served
    _, tok = vl
    prompt = image_prompt(tok, root / "noise.png")
    png = sum(map(len, pictures_to_json(prompt)["pictures"]))
    # room for two pictures, not for one prompt's pixel rows: two image prompts a request
    monkeypatch.setattr(remote, "IMAGE_BODY_BYTES", png * 5 // 2)
    assert remote.request_slices([prompt] * 4, 8) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert remote.request_slices([prompt] * 4, 8, [png] * 4) == [(0, 2), (2, 4)]
    engine = remote.RemoteRolloutEngine(gen.url, tok)
    bodies = recording(engine)
    ro = engine.generate([prompt] * 4, SamplingParams(n=1, max_new_tokens=3, seed=1))
    assert [len(b["prompts"]) for b in bodies] == [2, 2] and ro.response_ids.shape[0] == 4


def one_line_400(url: str, body: dict, said: str) -> None:
    r = httpx.post(f"{url}/v1/generate_tokens", json=body, timeout=120)
    message = r.json()["error"]["message"] if r.status_code == 400 else r.text
    assert r.status_code == 400 and said in message and "\n" not in message, r.text


def test_a_server_that_grids_pictures_otherwise_is_one_line_and_its_pixel_flags_fix_it(served, vl_dir):
    from fastapi.testclient import TestClient

    from alignrl.interfaces import SamplingParams
    from alignrl.models.loader import load_tokenizer
    from alignrl.rollout.remote import RemoteRolloutEngine, ServiceError
    from alignrl.serve import generate

    gen, root = served
    small = load_tokenizer(vl_dir, min_pixels=56 * 56, max_pixels=56 * 56)  # a trainer with data.max_pixels=3136
    prompt = image_prompt(small, root / "noise.png")
    assert prompt.images.image_grid_thw.tolist() == [[1, 4, 4]]  # the server's processor makes [1, 8, 8]
    with pytest.raises(ServiceError) as got:
        RemoteRolloutEngine(gen.url, small).generate([prompt], SamplingParams(n=1, max_new_tokens=2))
    said = str(got.value)
    assert got.value.status == 400 and "\n" not in said, said
    assert "resizes images otherwise than the trainer" in said and "--min_pixels/--max_pixels" in said, said
    svc = generate.load_service(generate.parser().parse_args(["--model", str(vl_dir), "--max_pixels", "3136"]))
    with TestClient(generate.build_app(svc, 64 << 20)) as client:
        engine = RemoteRolloutEngine(gen.url, small)
        engine.client.http = client  # the in-process app, on no port
        ro = engine.generate([prompt], SamplingParams(n=1, max_new_tokens=2, seed=0))
    assert ro.response_mask.sum() > 0


def test_pictures_that_are_not_images_are_one_line_400s(served, vl):
    from alignrl.data.images import images_to_json
    from alignrl.data.picture_json import PixelBudget, pictures_from_json, png_base64

    gen, root = served
    _, tok = vl
    prompt = image_prompt(tok, root / "clear.png")
    good = {"pictures": [png_base64(prompt.pictures[0])], "image_grid_thw": prompt.images.image_grid_thw.tolist()}
    body = {"prompts": [list(prompt)], "max_tokens": 2}
    sliver = Image.new("RGB", (300, 1))
    buf = io.BytesIO()
    prompt.pictures[0].save(buf, format="JPEG")
    jpeg = base64.b64encode(buf.getvalue()).decode()
    for images, said in [
        ({**good, "pictures": ["@@@"]}, "prompt 0: picture 0 is not a base64 PNG"),
        ({**good, "pictures": [base64.b64encode(b"no picture").decode()]}, "picture 0 is not a base64 PNG"),
        ({**good, "pictures": [jpeg]}, "picture 0 is not a base64 PNG"),
        # a header claiming 20000 x 20000 pixels (Pillow's own bomb check raises at opening) and 9000 x 9000
        ({**good, "pictures": [png_header(20000, 20000)]}, "picture 0 is over 67108864 pixels"),
        ({**good, "pictures": [png_header(9000, 9000)]}, "picture 0 is over 67108864 pixels"),
        ({"pictures": good["pictures"]}, "send {pictures: [base64 PNG, ...], image_grid_thw"),
        ({**good, "image_grid_thw": [[1, 2]]}, "images are not pictures with their grids"),
        ({**good, "pictures": [png_base64(sliver)]}, "the model's processor cannot read its pictures"),
        ("picture", "images.0: Input should be a valid dictionary"),
    ]:
        one_line_400(gen.url, {**body, "images": [images]}, said)
    one_line_400(gen.url, {**body, "images": [good, None]}, "images has 2 entries for 1 prompts")
    r = httpx.post(f"{gen.url}/v1/generate_tokens", json={**body, "images": [good]}, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{gen.url}/v1/generate_tokens", json={**body, "images": [images_to_json(prompt.images)]},
                   timeout=120)  # the pixel-row form is still read
    assert r.status_code == 200, r.text
    with pytest.raises(Exception, match="picture 0 is over 100 pixels"):
        pictures_from_json(good, "prompt 0", max_pixels=100)  # checked from the header, before decoding
    budget = PixelBudget(56 * 84 + 10)  # a request's pictures are counted together: the second one is over
    pictures_from_json(good, "prompt 0", budget=budget)
    with pytest.raises(Exception, match="prompt 1: picture 0: the request's pictures exceed 4714 pixels in all"):
        pictures_from_json(good, "prompt 1", budget=budget)


def png_header(width: int, height: int) -> str:
    """Base64 of a PNG whose header claims width x height pixels, a few dozen bytes in all."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(bytes(10))) + chunk(b"IEND", b""))
    return base64.b64encode(raw).decode()


class FakeLLM:
    """vllm.LLM as the engine uses it: what `generate` was given, two tokens per sample back."""

    def __init__(self, **kwargs):
        self.kwargs, self.prompts = kwargs, []
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))

    def generate(self, prompts, params, use_tqdm=True):
        self.prompts += prompts
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, 6], logprobs=None, finish_reason="stop")
                                         for _ in range(sp.n)]) for sp in params]


@pytest.fixture
def vllm_service(monkeypatch, vl_dir):
    """An in-process `alignrl serve generate --engine vllm` over a stand-in vllm module (no Ray, no GPU, no port)."""
    from fastapi.testclient import TestClient

    from alignrl.serve import generate

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, SimpleNamespace
    module.EngineArgs = dataclasses.make_dataclass("EngineArgs", [("model", str), ("logprobs_mode", str),
                                                                  ("mm_processor_kwargs", dict)])
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the engine sets it: restored after the test
    svc = generate.load_service(generate.parser().parse_args(["--model", str(vl_dir), "--engine", "vllm"]))
    with TestClient(generate.build_app(svc, 64 << 20)) as client:
        yield svc, client


def test_a_vllm_service_gets_the_pictures_as_multi_modal_data(vllm_service, vl, pictures):
    from alignrl.data.images import images_to_json
    from alignrl.interfaces import SamplingParams
    from alignrl.rollout.remote import RemoteRolloutEngine

    svc, client = vllm_service
    _, tok = vl
    prompts = [image_prompt(tok, p) for p in list(pictures.values())[:2]]
    engine = RemoteRolloutEngine("http://testserver", tok)
    engine.client.http = client
    ro = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert ro.response_ids.tolist() == [[5, 6]] * 4
    got = svc.engine.llm.prompts
    assert [g["prompt_token_ids"] for g in got] == [list(p) for p in prompts]
    for g, p in zip(got, prompts):
        sent, = g["multi_modal_data"]["image"]
        assert isinstance(sent, Image.Image) and sent.mode == "RGB" and sent.size == p.pictures[0].size
        assert sent.tobytes() == p.pictures[0].tobytes()
    body = {"prompts": [list(prompts[0])], "images": [images_to_json(prompts[0].images)], "max_tokens": 2}
    r = client.post("/v1/generate_tokens", json=body)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "\n" not in message, r.text
    assert "generates with vLLM, which reads images as pictures, not pixel rows; send its images as pictures" in message


def test_a_picture_is_encoded_once_for_every_prompt_and_call_that_holds_it(vl, tmp_path, monkeypatch):
    from alignrl.data import picture_json
    from alignrl.rollout import remote

    _, tok = vl
    Image.new("RGB", (56, 56), (200, 10, 10)).save(tmp_path / "red.png")
    prompt = image_prompt(tok, tmp_path / "red.png")
    calls = []
    encode = picture_json.png_base64
    monkeypatch.setattr(picture_json, "png_base64", lambda picture: calls.append(1) or encode(picture))
    first = remote.picture_forms([prompt, prompt])
    again = remote.picture_forms([prompt])  # a later turn or step holding the same picture
    assert len(calls) == 1 and first[0] == first[1] == again[0]
    assert first[0]["pictures"] == [encode(prompt.pictures[0])]
    crop = prompt.pictures[0].crop((0, 0, 28, 28))  # a picture made from it (a tool's zoom) is encoded anew
    assert remote.picture_forms([with_picture(prompt, crop)])[0]["pictures"] == [encode(crop)] and len(calls) == 2


def with_picture(prompt, picture):
    from alignrl.data.images import ImagePrompt

    return ImagePrompt(list(prompt), prompt.images, (picture,))
