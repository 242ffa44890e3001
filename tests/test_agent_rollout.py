"""Multi-turn search rollouts: Search-R1's action parsing, ids kept exactly as generated turn by turn
(scripted engine, embedded engine, generation server), observation handling and bad retriever input."""


import pytest
import torch

from alignrl.data.records import Rollout
from alignrl.interfaces import SamplingParams
from alignrl.models.logprobs import response_logprobs
from alignrl.rollout.agent import INFO_CLOSE, INFO_OPEN, INVALID_ACTION, AgentRollout, parse_action
from alignrl.rollout.hf_engine import HFRolloutEngine
from alignrl.rollout.remote import RemoteRolloutEngine
from alignrl.rollout.retriever import passages_text
from scripted_engine import ScriptedEngine as Scripted

pytestmark = pytest.mark.timeout(240)


def test_parse_action_reads_turns_as_search_r1():
    assert parse_action("<think>x</think><search> capital of France </search>") == ("search", "capital of France")
    assert parse_action("so <answer>Paris</answer> done") == ("answer", "Paris")
    assert parse_action("<search>a</search> then <answer>b</answer>") == ("search", "a")
    assert parse_action("<answer>b</answer><search>a</search>") == ("answer", "b")  # the first tag pair wins
    assert parse_action("<search>open only") == (None, "")
    assert parse_action("<search>a</answer>") == (None, "")
    assert parse_action("<answer>multi\nline</answer>") == ("answer", "multi\nline")


def test_passages_are_formatted_as_search_r1():
    hits = [{"document": {"id": "1", "contents": '"Paris"\nCapital of France.'}, "score": 3.0},
            {"contents": '"Lyon"\nA city.\nSecond line.'}]
    assert passages_text(hits) == ('Doc 1(Title: "Paris") Capital of France.\n'
                                   'Doc 2(Title: "Lyon") A city.\nSecond line.\n')


def _search_stops(params: SamplingParams) -> None:
    assert "</search>" in params.stop and "</answer>" in params.stop


def ScriptedEngine(tokenizer, script, truncate_turns=()):  # noqa: N802 (the shared engine with Search-R1's stops)
    return Scripted(script, truncate_turns, check=_search_stops)


class RecordingTool:
    def __init__(self, answers=None):
        self.calls: list[list[str]] = []
        self.answers = answers or {}

    def search(self, queries):
        self.calls.append(list(queries))
        return [self.answers.get(q, f'Doc 1(Title: "{q}") about {q}\n') for q in queries]


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _check_ids_as_generated(rollout: Rollout, calls, n_rows: int):
    """Every row's response is its turns' generated ids, each followed by whatever was appended, the
    loss mask marks exactly the generated ones, and each turn's context is prompt + response so far."""
    for i in range(n_rows):
        resp = rollout.response_ids[i][rollout.response_mask[i]].tolist()
        gen = rollout.loss_mask[i][rollout.response_mask[i]].tolist()
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i]].tolist()
        pos = 0
        for contexts, outs in calls:
            mine = [outs[k] for k, c in enumerate(contexts) if c == prompt + resp[:pos]]
            if not mine:
                continue
            # rows of one prompt can share a context; one of them generated this row's next ids
            out = next(o for o in mine if resp[pos:pos + len(o)] == o)
            assert all(gen[pos:pos + len(out)])
            pos += len(out)
            while pos < len(resp) and not gen[pos]:  # the observation after this turn
                pos += 1
        assert pos == len(resp)


def test_scripted_turns_keep_ids_observations_and_stats(tiny_model):
    _, tok = tiny_model
    pad = tok.pad_token_id
    a, b, c = 5, 6, 7  # first prompt ids tell the scripted engine which row it is answering
    script = {
        a: [_enc(tok, "<search> alpha </search>"), _enc(tok, "ok") + [pad] + _enc(tok, " <answer> x </answer>")],
        b: [_enc(tok, "no action here"), _enc(tok, "<search> beta </search>"), _enc(tok, "<search> late </search>")],
        c: [_enc(tok, "<answer> y </answer>")],
    }
    engine, tool = ScriptedEngine(tok, script, truncate_turns={(b, 0)}), RecordingTool()
    agent = AgentRollout(engine, tok, tool, max_turns=2, max_obs_length=200)
    ro = agent.generate([[a, 11, 12], [b, 13], [c]], SamplingParams(n=1, max_new_tokens=40, seed=3))
    assert tool.calls == [["alpha"], ["beta"]]  # one batched call per turn; the last turn never searches
    _check_ids_as_generated(ro, engine.calls, 3)
    obs_alpha = _enc(tok, f'{INFO_OPEN}Doc 1(Title: "alpha") about alpha{INFO_CLOSE}')
    row_a = ro.response_ids[0][ro.response_mask[0]].tolist()
    assert row_a == script[a][0] + obs_alpha + script[a][1]
    # a generated token equal to the pad id is still a trained token
    pad_at = len(script[a][0]) + len(obs_alpha) + len(_enc(tok, "ok"))
    assert row_a[pad_at] == pad and bool(ro.loss_mask[0, pad_at]) and bool(ro.response_mask[0, pad_at])
    row_b = ro.response_ids[1][ro.response_mask[1]].tolist()
    assert row_b[len(script[b][0]):len(script[b][0]) + len(_enc(tok, INVALID_ACTION))] == _enc(tok, INVALID_ACTION)
    # log-probs: the engine's on generated tokens, 0 on observations
    assert bool((ro.logprobs[~ro.loss_mask] == 0).all()) and bool((ro.logprobs[ro.loss_mask] < 0).all())
    st = {k: v.tolist() for k, v in ro.stats.items()}
    assert st["searches"] == [1, 1, 0] and st["turns"] == [2, 3, 1] and st["actions"] == [2, 3, 1]
    assert st["valid_actions"] == [2, 2, 1] and not ro.truncated.any()
    assert ro.group.tolist() == [0, 1, 2]


def test_eos_without_an_action_gets_the_corrective_observation_and_goes_on(tiny_model):
    """Search-R1: a turn without </search> or </answer> is an invalid action whatever ended it (eos
    included): the corrective observation follows and the row takes the next turn, up to max_turns."""
    _, tok = tiny_model
    eos = tok.eos_token_id
    first = _enc(tok, "thinking") + [eos]
    script = {5: [first, _enc(tok, "more") + [eos], _enc(tok, "<answer> z </answer>"), _enc(tok, "never")],
              6: [first, _enc(tok, "<search> q </search>"), _enc(tok, "<answer> w </answer>")]}
    engine, tool = ScriptedEngine(tok, script), RecordingTool()
    ro = AgentRollout(engine, tok, tool, max_turns=2, max_obs_length=200).generate(
        [[5], [6]], SamplingParams(n=1, max_new_tokens=40))
    fix = _enc(tok, INVALID_ACTION)
    row5 = ro.response_ids[0][ro.response_mask[0]].tolist()
    assert row5 == first + fix + script[5][1] + fix + script[5][2]  # ids as generated, eos kept in place
    gen5 = ro.loss_mask[0][ro.response_mask[0]].tolist()
    assert gen5 == [True] * len(first) + [False] * len(fix) + [True] * len(script[5][1]) + [False] * len(fix) + \
        [True] * len(script[5][2])  # the loss mask is 1 on generated tokens only
    assert tool.calls == [["q"]] and engine.seen == {5: 3, 6: 3}  # the answer ended row 5 on its turn 3
    st = {k: v.tolist() for k, v in ro.stats.items()}
    assert st["turns"] == [3, 3] and st["valid_actions"] == [1, 2] and st["searches"] == [0, 1]
    _check_ids_as_generated(ro, engine.calls, 2)
    assert not ro.truncated.any()
    # on the last turn (max_turns reached) an eos without an action ends the row, as Search-R1's final turn
    ro = AgentRollout(ScriptedEngine(tok, script), tok, tool, max_turns=1, max_obs_length=200).generate(
        [[5]], SamplingParams(n=1, max_new_tokens=40))
    assert ro.stats["turns"].tolist() == [2] and ro.response_mask.sum() == len(first) + len(fix) + len(script[5][1])


def test_truncation_and_caps(tiny_model):
    _, tok = tiny_model
    script = {5: [_enc(tok, "<answer> a </answer>")], 6: [_enc(tok, "<search> q </search>"), _enc(tok, "aaaa bbbb")]}
    engine = ScriptedEngine(tok, script, truncate_turns={(6, 1)})
    agent = AgentRollout(engine, tok, RecordingTool(), max_turns=1, max_obs_length=200, max_start_length=1)
    ro = agent.generate([[1, 2, 5], [3, 6]], SamplingParams(n=1, max_new_tokens=40))
    assert ro.stats["turns"].tolist() == [1, 2] and ro.truncated.tolist() == [False, True]
    assert ro.prompt_ids[ro.prompt_mask].tolist() == [5, 6]  # max_start_length keeps the prompt's end
    # an overall cap: no room left after the observation ends the row there, truncated
    engine = ScriptedEngine(tok, script)
    agent = AgentRollout(engine, tok, RecordingTool(), max_turns=1, max_obs_length=200,
                         max_response_length=len(script[6][0]) + 3)
    ro = agent.generate([[6, 3]], SamplingParams(n=1, max_new_tokens=40))
    assert ro.response_mask.sum() == len(script[6][0]) and ro.truncated.tolist() == [True]


def test_long_observation_is_cut_keeping_its_tags(tiny_model, capsys):
    _, tok = tiny_model
    script = {5: [_enc(tok, "<search> q </search>"), _enc(tok, "<answer> a </answer>")]}
    tool = RecordingTool({"q": "word " * 300})
    agent = AgentRollout(ScriptedEngine(tok, script), tok, tool, max_turns=1, max_obs_length=30)
    ro = agent.generate([[5]], SamplingParams(n=1, max_new_tokens=40))
    obs = ro.response_ids[0][ro.response_mask[0] & ~ro.loss_mask[0]].tolist()
    assert len(obs) == 30 and obs[-len(_enc(tok, INFO_CLOSE)):] == _enc(tok, INFO_CLOSE)
    assert obs[: len(_enc(tok, INFO_OPEN))] == _enc(tok, INFO_OPEN) and ro.stats["obs_truncated"].tolist() == [1]
    out = capsys.readouterr().out
    assert out.count("data.max_obs_length=30") == 1 and len(out.strip().splitlines()) == 1


def _hf_agent(model, tok, tool):
    return AgentRollout(HFRolloutEngine(model, tok), tok, tool, max_turns=2, max_obs_length=40)


class Recorder:
    """A RolloutEngine proxy that records each call's contexts and generated ids."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, prompts, params):
        ro = self.inner.generate(prompts, params)
        outs = [ro.response_ids[i][ro.response_mask[i]].tolist() for i in range(len(ro.group))]
        self.calls.append(([list(p) for p in prompts], outs, ro))
        return ro

    def load_weights(self, named_tensors):
        self.inner.load_weights(named_tensors)


def test_embedded_engine_ids_and_logprobs_line_up_with_the_trainer(tiny_model):
    model, tok = tiny_model
    prompts = [_enc(tok, "What is 3 + 4?"), _enc(tok, "Name a city.")]
    rec = Recorder(HFRolloutEngine(model, tok))
    agent = AgentRollout(rec, tok, RecordingTool(), max_turns=2, max_obs_length=40)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=11)
    ro = agent.generate(prompts, params)
    assert len(rec.calls) >= 2 and ro.group.tolist() == [0, 0, 1, 1]
    _check_ids_as_generated(ro, [(c, o) for c, o, _ in rec.calls], 4)
    assert (~ro.loss_mask & ro.response_mask).any()  # observations were appended
    # the trainer's forward over the final sequences gives the engine's log-probs on generated tokens
    lp, _ = response_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, 1.0)
    torch.testing.assert_close(lp[ro.loss_mask], ro.logprobs[ro.loss_mask], atol=2e-4, rtol=0)
    again = AgentRollout(HFRolloutEngine(model, tok), tok, RecordingTool(), 2, 40).generate(prompts, params)
    assert torch.equal(again.response_ids, ro.response_ids) and torch.equal(again.loss_mask, ro.loss_mask)


def test_generation_server_gives_the_embedded_ids(tiny_model, base_generation):
    model, tok = tiny_model
    prompts = [_enc(tok, "What is 3 + 4?"), _enc(tok, "Name a city."), _enc(tok, "Hello")]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    local = _hf_agent(model, tok, RecordingTool()).generate(prompts, params)
    remote = AgentRollout(RemoteRolloutEngine(base_generation.url, tok), tok, RecordingTool(), 2,
                          40).generate(prompts, params)
    for name in ("prompt_ids", "response_ids", "response_mask", "loss_mask", "truncated"):
        assert torch.equal(getattr(local, name), getattr(remote, name)), name
    torch.testing.assert_close(remote.logprobs, local.logprobs, atol=2e-4, rtol=0)


def test_a_prompt_s_images_go_with_it_into_every_turn_and_onto_the_rollout(tiny_model):
    from alignrl.data.images import ImagePrompt, PromptImages

    _, tok = tiny_model
    a, b = 5, 6
    script = {a: [_enc(tok, "<search> alpha </search>"), _enc(tok, "<answer> x </answer>")],
              13: [_enc(tok, "<answer> y </answer>")]}  # [b, 13] is cut to its last token
    pictures = PromptImages(torch.randn(4, 8), torch.tensor([[1, 2, 2]]))
    engine = ScriptedEngine(tok, script)
    seen = []
    generate = engine.generate

    def recording(prompts, params):
        seen.append([getattr(p, "images", None) for p in prompts])
        return generate(prompts, params)

    engine.generate = recording
    agent = AgentRollout(engine, tok, RecordingTool(), max_turns=2, max_obs_length=200, max_start_length=1)
    ro = agent.generate([ImagePrompt([a, 11, 12], pictures), [b, 13]], SamplingParams(n=1, max_new_tokens=40))
    assert seen[0] == [pictures, None] and seen[1] == [pictures]  # turn 2: row a only, with its images again
    assert engine.calls[0][0][0] == [a, 11, 12]  # a prompt with images is never cut by max_start_length
    assert engine.calls[0][0][1] == [13]  # a text prompt is
    assert ro.images is not None and ro.images.rows == [pictures, None]
    text = AgentRollout(ScriptedEngine(tok, script), tok, RecordingTool(), max_turns=2, max_obs_length=200)
    assert text.generate([[a, 11, 12]], SamplingParams(n=1, max_new_tokens=40)).images is None  # as before
