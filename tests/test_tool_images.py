"""verl's tools that return images (`ToolResponse(image=[...])`, as verl's image_zoom_in_tool does) in the tool loop,
on the tiny Qwen2-VL model: the tool turn holds the images' tokens, later turns are generated with the prompt's images
and the tools', the trainer recomputes the engine's log-probs over them, observations with images are never cut inside
their image tokens, and what cannot be appended is one line."""

import asyncio
import sys

import pytest
import torch
from PIL import Image

from alignrl.data.collate import encode_prompts, left_pad, prompt_ids, right_pad
from alignrl.data.loaders import load_samples
from alignrl.data.records import Rollout, Sample
from alignrl.interfaces import SamplingParams
from alignrl.rollout.env_agent import EnvironmentStepError, EnvRollout, TaskPrompt
from alignrl.rollout.observation_images import observation_ids
from alignrl.rollout.tool_calls import ToolChat
from alignrl.rollout.verl_tools import ToolLoop, ToolResultError, tool_environment
from conftest import one_line
from visionrows import lmm_r1_row, write_jsonl

pytestmark = pytest.mark.timeout(240)

# a user's tool as verl's image tools are written: verl's modules imported by name, Pillow images in the response
ZOOM_TOOL = '''
from PIL import Image

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

COLORS = {"blue": (0, 0, 255), "green": (0, 255, 0)}


class ZoomTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        what = parameters["answer"]
        if what == "video":
            return ToolResponse(text="clip", video=[Image.new("RGB", (56, 56))]), 0.0, {}
        if what == "path":
            return ToolResponse(text="see", image=["/tmp/zoomed.png"]), 0.0, {}
        if what == "array":  # a dict response, as older verl tools return
            import torch

            return {"text": "see", "image": torch.zeros(2, 3)}, 0.0, {}
        if what == "wide":  # 112 x 56 pixels: twice the image tokens of a square one
            return ToolResponse(text="wide " * 20, image=[Image.new("RGBA", (112, 56), (0, 255, 0, 255))]), 0.0, {}
        return ToolResponse(text="zoomed", image=[Image.new("RGB", (56, 56), COLORS[what])]), 0.0, {}
'''
SCHEMA = """
    tool_schema: {type: function, function: {name: zoom, description: zoom in, parameters: {type: object,
                  properties: {answer: {type: string}}, required: [answer]}}}
"""
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture
def zoom_yaml(tmp_path, monkeypatch) -> str:
    """The tool config of ZoomTool, a module of the working folder (a name of its own per test)."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    monkeypatch.chdir(tmp_path)
    module = f"zoom_tools_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{module}.py").write_text(ZOOM_TOOL)
    path = tmp_path / "zoom.yaml"
    path.write_text(f'tools:\n  - class_name: "{module}.ZoomTool"\n    config: {{type: native}}' +
                    SCHEMA)
    return str(path)


def _call(answer: str) -> str:
    return f'<tool_call>{{"name": "zoom", "arguments": {{"answer": "{answer}"}}}}</tool_call>'


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


class FirstTurns:
    """Every row's first turn is `first` (an untrained policy never writes a tool call; log-probs 0 there), later turns
    `then`'s ids (cut to the turn's token limit) when given, else the wrapped engine's. Records every call's prompts."""

    def __init__(self, engine, first: list[int], then: list[int] | None = None):
        self.engine, self.first, self.then, self.calls = engine, first, then, []

    def generate(self, prompts, params: SamplingParams) -> Rollout:
        self.calls.append(list(prompts))
        if len(self.calls) > 1 and self.then is None:
            return self.engine.generate(prompts, params)
        # the first turn whole, as if the turn's token limit allowed it: the later turns' limit is the one tested
        ids = [self.first if len(self.calls) == 1 else self.then[: params.max_new_tokens] for _ in prompts]
        (pid, pm), (rid, rm) = left_pad(prompts, 0), right_pad(ids, 0)
        return Rollout(pid, pm, rid, rm, torch.zeros(rid.shape), torch.zeros(len(prompts), dtype=torch.bool),
                       torch.arange(len(prompts)))


def _prompts(tok, pictures, tmp_path) -> list[TaskPrompt]:
    """A prompt with a picture (LMM-R1's row) and a text prompt."""
    samples = load_samples(str(write_jsonl(tmp_path / "r.jsonl", [lmm_r1_row(pictures["red"], "Zoom in.")])),
                           prompt_key="message", label_key="answer")
    text = Sample([{"role": "user", "content": "Look closer."}], "5")
    return [TaskPrompt(encode_prompts(tok, samples, 96)[0], samples[0]), TaskPrompt(prompt_ids(tok, text), text)]


def test_a_tool_image_is_read_by_later_turns_and_the_trainer_recomputes_their_logprobs(vl, pictures, zoom_yaml,
                                                                                       tmp_path):
    from alignrl.rl.producer import batched_logprobs
    from alignrl.rollout.hf_engine import HFRolloutEngine

    model, tok = vl
    prompts = _prompts(tok, pictures, tmp_path)
    call = _enc(tok, _call("blue") + _call("wide"))
    engine = FirstTurns(HFRolloutEngine(model, tok, eos_token_ids=[-1]), call)
    loop = ToolLoop(max_parallel_calls=2, max_assistant_turns=2, max_tool_response_length=40)
    ro = EnvRollout(engine, tok, tool_environment(zoom_yaml, tok, loop), response_cap=400).generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5))
    # the observation: verl's multimodal tool messages, an image item before each text (the long one cut as text)
    blue, wide = Image.new("RGB", (56, 56), (0, 0, 255)), Image.new("RGB", (112, 56), (0, 255, 0))
    text = ToolChat(tok, []).feedback(["zoomed", ("wide " * 20)[:20] + "...(truncated)..." + ("wide " * 20)[-20:]],
                                      [1, 1])
    assert text.count(IMAGE) == 2 and "(truncated)" in text
    obs, tool_images = observation_ids(tok, text, [blue, wide], "zoom", ToolResultError)
    assert tool_images.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 8]]
    assert ro.stats["env/tool_calls"].tolist() == [2.0] * 4 and ro.stats["turns"].tolist() == [2.0] * 4
    for i in range(4):
        got = ro.response_ids[i][ro.response_mask[i]].tolist()
        assert got[:len(call) + len(obs)] == call + obs and len(got) == len(call) + len(obs) + 6
        images = ro.images.rows[i]  # the prompt's picture (rows 0 and 1), then the tools' two in order
        grids = ([[1, 4, 4]] if i < 2 else []) + [[1, 4, 4], [1, 4, 8]]
        assert images.image_grid_thw.tolist() == grids
        assert torch.equal(images.pixel_values[-48:], tool_images.pixel_values)
    answering = engine.calls[1]  # the second turn was generated with every image of its row, Pillow images too
    assert [p.images.image_grid_thw.shape[0] for p in answering] == [3, 3, 2, 2]
    assert [len(p.pictures) for p in answering] == [3, 3, 2, 2]
    after = ro.loss_mask.clone()
    after[:, :len(call)] = False  # the scripted call's log-probs are not the engine's
    assert int(after.sum()) == 4 * 6 and bool((ro.logprobs[after] < 0).all())  # the engine's own log-probs
    recomputed = batched_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, 1.0, 2,
                                  images=ro.images)
    assert (recomputed - ro.logprobs)[after].abs().max() < 1e-4


def test_an_image_observation_that_does_not_fit_ends_the_episode_whole(vl, pictures, zoom_yaml, tmp_path):
    """verl's rule: a tool turn that would reach the response cap is not appended (nor its images), and the episode
    ends, cut; the prompt's images alone go to the trainer."""
    _, tok = vl
    prompts = _prompts(tok, pictures, tmp_path)[:1]
    call = _enc(tok, _call("blue"))
    obs, _ = observation_ids(tok, ToolChat(tok, []).feedback(["zoomed"], [1]), [Image.new("RGB", (56, 56))], "t",
                             ToolResultError)
    make = tool_environment(zoom_yaml, tok, ToolLoop())
    for cap, whole in ((len(call) + len(obs), False), (len(call) + len(obs) + 1, True)):
        engine = FirstTurns(None, call, then=_enc(tok, " blue"))
        ro = EnvRollout(engine, tok, make, response_cap=cap).generate(prompts, SamplingParams(max_new_tokens=50))
        got = ro.response_ids[0][ro.response_mask[0]].tolist()
        assert got == (call + obs + _enc(tok, " blue"))[:cap if whole else len(call)]
        assert whole or ro.truncated.tolist() == [True]  # the one that fits goes on to a turn, cut at the cap
        assert ro.images.rows[0].image_grid_thw.shape[0] == (2 if whole else 1)


class Shows:
    """An environment (OpenRLHF's protocol) whose steps show a picture: alignrl's "environment_images"."""

    def __init__(self, images, text: str = IMAGE + "look", done: bool = False):
        self.images, self.text, self.done = images, text, done

    async def reset(self, states):
        return {"observation": states["observation"]}

    async def step(self, states):
        return {"rewards": 0.0, "environment_feedback": self.text, "environment_images": self.images,
                "done": self.done}


def _shows(*args, **kwargs):
    async def make():
        return Shows(*args, **kwargs)

    return make


def test_a_done_steps_image_feedback_is_appended_whole_or_left_out(vl, pictures, tmp_path):
    _, tok = vl
    prompts = _prompts(tok, pictures, tmp_path)[1:]  # a text prompt: the picture is the row's only image
    act = _enc(tok, " ok")
    obs, _ = observation_ids(tok, IMAGE + "look", [Image.new("RGB", (56, 56))], "t", EnvironmentStepError)
    for room, appended in ((len(obs), True), (len(obs) - 1, False)):
        engine = FirstTurns(None, act)
        ro = EnvRollout(engine, tok, _shows([Image.new("RGB", (56, 56))], done=True), response_cap=len(act) + room,
                        max_turns=3).generate(prompts, SamplingParams(max_new_tokens=len(act)))
        got = ro.response_ids[0][ro.response_mask[0]].tolist()
        assert got == act + (obs if appended else []) and ro.truncated.tolist() == [False]
        assert (ro.images is not None) == appended  # never a cut image: whole, or not at all


def test_what_cannot_be_appended_is_one_line(vl, tiny_model, pictures, zoom_yaml, tmp_path):
    _, tok = vl

    def step(tokenizer, answer):
        env = asyncio.run(tool_environment(zoom_yaml, tokenizer, ToolLoop())())
        return asyncio.run(env.step({"observation_text": "", "action_text": _call(answer), "label": None}))

    assert step(tok, "blue")["environment_feedback"].count(IMAGE) == 1
    for tokenizer, answer, expect in ((tok, "video", "tool 'zoom' returned video"),
                                      (tok, "path", "tool 'zoom' returned image str '/tmp/zoomed.png', not a Pillow"),
                                      (tok, "array", "tool 'zoom' returned image Tensor 'tensor([[0., 0., 0.],\\n"),
                                      (tiny_model[1], "blue", "tool 'zoom' returned image, but the policy is a "
                                                              "text-only model")):
        with pytest.raises(ToolResultError) as err:
            step(tokenizer, answer)
        assert expect in one_line(str(err.value))
    prompts = _prompts(tok, pictures, tmp_path)[1:]
    for make, expect in ((_shows("a.png"), "returned image str 'a.png'"),
                         (_shows(torch.zeros(4, 4, 3)), "returned image Tensor"),
                         (_shows([Image.new("RGB", (56, 56))], text="look"), "holds 0 image placeholder(s)"),
                         (_shows([]), "returned 0 image(s) but its observation text holds 1 image placeholder"),
                         (_shows([Image.new("RGB", (3000, 5))]), "an image the model's processor cannot read")):
        with pytest.raises(EnvironmentStepError) as err:
            EnvRollout(FirstTurns(None, _enc(tok, " ok")), tok, make, response_cap=100).generate(
                prompts, SamplingParams(max_new_tokens=4))
        assert expect in one_line(str(err.value))


def test_remax_greedy_baseline_regenerates_from_the_prompts_not_the_rows_images(vl, pictures, zoom_yaml, tmp_path):
    """A row's images hold its tool observations' after its prompt's: ReMax's greedy episode starts again from the
    prompt as the samples did (its own images only), not from the rollout row's images."""
    from types import SimpleNamespace

    from alignrl.rl.producer import RolloutMaker

    _, tok = vl
    prompts = _prompts(tok, pictures, tmp_path)
    make = tool_environment(zoom_yaml, tok, ToolLoop(max_assistant_turns=2))
    engine = FirstTurns(None, _enc(tok, _call("blue")), then=_enc(tok, " blue"))
    ro = EnvRollout(engine, tok, make, response_cap=200).generate(prompts, SamplingParams(n=2, max_new_tokens=4))
    assert [r.image_grid_thw.shape[0] for r in ro.images.rows] == [2, 2, 1, 1]  # prompt + tool, tool alone
    greedy_engine = FirstTurns(None, _enc(tok, " red"))
    seen = []
    maker = SimpleNamespace(engine=EnvRollout(greedy_engine, tok, make, response_cap=200),
                            cfg=SimpleNamespace(rollout=SimpleNamespace(stop=(), max_new_tokens=4,
                                                                        repetition_penalty=1.0)),
                            rewards=SimpleNamespace(score=lambda g, rows: seen.append(g) or
                                                    SimpleNamespace(rewards=torch.tensor([1.0, 2.0]))))
    baseline = RolloutMaker.greedy_baseline(maker, ro, [p.sample for p in prompts], prompts)
    assert baseline.tolist() == [1.0, 1.0, 2.0, 2.0]
    first_turn = greedy_engine.calls[0]
    assert [list(p) for p in first_turn] == [list(p) for p in prompts]
    assert first_turn[0].images.image_grid_thw.tolist() == [[1, 4, 4]] and not hasattr(first_turn[1], "images")
    assert len(seen) == 1 and seen[0].images.rows[1] is None  # the greedy text episode: no image of another row


def test_transparent_pixels_are_white_in_prompts_and_tool_images_as_the_processor_makes_them(vl, tmp_path):
    """An RGBA picture (a diagram on a transparent background) reads as transformers' processor reads it, on white:
    Pillow's convert("RGB") made the background black, a picture the processor would not have shown the model."""
    from alignrl.data.images import decode_image
    from alignrl.models.vision import processor_of
    from alignrl.rollout.observation_images import pictures_of

    _, tok = vl
    picture = Image.new("RGBA", (56, 56), (0, 0, 0, 0))
    picture.paste((200, 30, 30, 255), (14, 14, 42, 42))  # an opaque square on a transparent ground
    picture.save(tmp_path / "diagram.png")
    decoded = decode_image("row 1", str(tmp_path / "diagram.png"))
    tool = pictures_of([picture], "tool 'zoom'", ToolResultError)[0]
    assert decoded.mode == tool.mode == "RGB"
    assert decoded.getpixel((0, 0)) == tool.getpixel((0, 0)) == (255, 255, 255)
    assert decoded.getpixel((20, 20)) == tool.getpixel((20, 20)) == (200, 30, 30)
    processor = processor_of(tok).image_processor
    own = processor(images=[picture], return_tensors="pt")["pixel_values"]
    assert torch.equal(processor(images=[decoded], return_tensors="pt")["pixel_values"], own)
