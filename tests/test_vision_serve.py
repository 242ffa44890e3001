"""The generation service's `/v1/chat/completions` with OpenAI `image_url` content (data: URLs and paths on the
server) for a vision-language model, and its one-line 400s."""

import base64

import httpx
import pytest
from PIL import Image

from alignrl.serve.process import ServiceProcess


@pytest.fixture(scope="module")
def vl_service(tmp_path_factory):
    from alignrl.models.tiny_vl import build_tiny_vl

    root = tmp_path_factory.mktemp("vl_serve")
    folder = build_tiny_vl(root / "tiny-vl", seed=0)
    Image.new("RGB", (56, 56), (255, 0, 0)).save(root / "red.png")
    with ServiceProcess(["generate", "--model", str(folder)]) as gen:
        yield gen, root


def chat(url: str, content, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_image_url_content_is_generated_from(vl_service):
    gen, root = vl_service
    data = "data:image/png;base64," + base64.b64encode((root / "red.png").read_bytes()).decode()
    text = {"type": "text", "text": "Which color?"}
    by_data = chat(gen.url, [{"type": "image_url", "image_url": {"url": data}}, text], logprobs=True, top_logprobs=2)
    by_path = chat(gen.url, [{"type": "image_url", "image_url": {"url": f"file://{root / 'red.png'}"}}, text],
                   logprobs=True, top_logprobs=2)
    plain = chat(gen.url, [text])
    assert by_data.status_code == by_path.status_code == plain.status_code == 200, by_data.text
    a, b = by_data.json(), by_path.json()
    # the image's 4 tokens and its two markers are in the prompt
    assert a["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + 6
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    for entry in a["choices"][0]["logprobs"]["content"]:  # greedy: the top alternative (same forward) is the token
        assert abs(entry["top_logprobs"][0]["logprob"] - entry["logprob"]) < 1e-4


def test_bad_images_are_one_line_400s(vl_service, base_generation):
    gen, root = vl_service
    cases = [
        (gen.url, {"url": str(root / "missing.png")}, "image file not found"),
        (gen.url, {"url": "data:image/png;base64,@@@"}, "not base64"),
        (gen.url, {"url": "data:image/png;base64," + base64.b64encode(b"no picture").decode()}, "cannot be decoded"),
        (base_generation.url, {"url": str(root / "red.png")}, "needs a vision-language model"),
    ]
    for url, image, said in cases:
        r = chat(url, [{"type": "image_url", "image_url": image}, {"type": "text", "text": "x"}])
        assert r.status_code == 400 and said in r.text and "\n" not in r.json()["error"]["message"], r.text


def test_generate_tokens_takes_prompt_images(vl_service, tmp_path, monkeypatch):
    """/v1/generate_tokens with each prompt's images (`images_to_json`), as a trainer's remote engine sends them
    (`RemoteRolloutEngine`, a text prompt beside): the rollout carries the images, and the service's sampled log-probs
    are the local model's recomputed ones."""
    from alignrl.data.collate import encode_prompts
    from alignrl.data.images import images_to_json
    from alignrl.data.records import Sample
    from alignrl.interfaces import SamplingParams
    from alignrl.models.loader import load_model
    from alignrl.rl.producer import batched_logprobs
    from alignrl.rollout.remote import RemoteRolloutEngine

    gen, root = vl_service
    model, tok = load_model(str(root / "tiny-vl"))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which color?"}]}]
    prompt, text = encode_prompts(tok, [Sample(msgs, "", images=(str(root / "red.png"),)),
                                        Sample([{"role": "user", "content": "Which color?"}], "")], 64)
    ro = RemoteRolloutEngine(gen.url, tok).generate([prompt, text], SamplingParams(n=2, max_new_tokens=5, seed=1))
    assert [r is None for r in ro.images.rows] == [False, False, True, True]
    assert ro.response_mask.sum() > 0
    lp = batched_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, 1.0, 2,
                          images=ro.images)
    assert ((lp - ro.logprobs) * ro.response_mask).abs().max() < 1e-4
    from alignrl.rollout import remote

    # a request's pixel rows are bounded (the service refuses a body over its --max_body_mb in one line): here each
    # image prompt goes in a request of its own, text prompts together, and the rows come back in order
    monkeypatch.setattr(remote, "IMAGE_BODY_BYTES", 1)
    assert remote.request_slices([prompt, text, prompt, text, text], 8) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    ro = RemoteRolloutEngine(gen.url, tok).generate([prompt, text, prompt], SamplingParams(n=2, max_new_tokens=5,
                                                                                            seed=2))
    assert [r is None for r in ro.images.rows] == [False, False, True, True, False, False]
    lp = batched_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, 1.0, 2,
                          images=ro.images)
    assert ((lp - ro.logprobs) * ro.response_mask).abs().max() < 1e-4
    body = {"prompts": [list(prompt)], "images": [images_to_json(prompt.images)], "n": 2, "max_tokens": 5, "seed": 1}
    bad = {**body, "images": [{**body["images"][0], "shape": [3, 5]}]}
    r = httpx.post(f"{gen.url}/v1/generate_tokens", json=bad, timeout=60)
    assert r.status_code == 400 and "do not add up" in r.text
    r = httpx.post(f"{gen.url}/v1/generate_tokens", json={**body, "images": None}, timeout=60)  # ids alone
    assert r.status_code == 400 and "has 4 image tokens but its images make 0" in r.text, r.text


def test_a_vllm_server_refuses_image_prompts_sent_as_pixel_rows(vl_service):
    """vLLM reads pictures: a vLLM server answers a request whose images are pixel rows with a one-line 400 naming
    the picture form instead of sampling without the images, and vLLM's prompt builder refuses images without
    pictures (tests/test_vision_serve_pictures.py sends it pictures)."""
    from types import SimpleNamespace

    from alignrl.data.collate import encode_prompts
    from alignrl.data.images import ImagePrompt, images_to_json
    from alignrl.data.records import Sample
    from alignrl.models.loader import load_tokenizer
    from alignrl.rollout.vllm_engine import EngineUnavailable, request
    from alignrl.serve.generate import RequestError, TokensRequest, image_prompts

    _, root = vl_service
    tok = load_tokenizer(root / "tiny-vl")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which color?"}]}]
    prompt = encode_prompts(tok, [Sample(msgs, "", images=(str(root / "red.png"),))], 64)[0]
    req = TokensRequest(prompts=[list(prompt)], images=[images_to_json(prompt.images)])
    assert image_prompts(req, tok, SimpleNamespace())[0].images is not None  # the embedded engine reads rows
    with pytest.raises(RequestError, match="prompt 0: this server generates with vLLM, which reads images as "
                                           "pictures, not pixel rows; send its images as pictures"):
        image_prompts(req, tok, SimpleNamespace(needs_pictures=True))
    assert image_prompts(TokensRequest(prompts=[[1, 2]]), tok, SimpleNamespace(needs_pictures=True)) == [[1, 2]]
    assert request(prompt)["multi_modal_data"]["image"] == list(prompt.pictures)
    with pytest.raises(EngineUnavailable, match="pixel rows without their pictures"):
        request(ImagePrompt(list(prompt), prompt.images))
