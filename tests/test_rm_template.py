"""A reward model with its own tokenizer and chat template (verl's reward_model.model.input_tokenizer): the rows are
decoded with the policy's tokenizer and re-templated in the reward model's, scored as that text scored directly; a
reward model with the policy's tokenizer keeps the ids path; what cannot work is one line."""

import json
from pathlib import Path

import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.models.folder import ModelError

# a template unlike the policy's ChatML, with plain-text markers (the tiny tokenizer has no special tokens for them)
RM_TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n"
               "{% endfor %}{% if add_generation_prompt %}### assistant:\n{% endif %}")
QUESTIONS = [("What is 6 * 7?", "6 * 7 = 42\n#### 42"), ("Tom has 3 apples and gets 4 more.", "#### 7")]


def rm_tokenizer(out: Path, template: str | None = RM_TEMPLATE):
    """A byte-level BPE tokenizer of another vocabulary than the tiny policy's (other texts, another size)."""
    from transformers import PreTrainedTokenizerFast

    from alignrl.models.tokenizer import PAD, train_tokenizer

    texts = [f"### user:\nquestion {i} about {w}\n### assistant:\nanswer {i * 7} {w}"
             for i in range(200) for w in ("apples", "pears", "sums")]
    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(texts, 280), eos_token=PAD, pad_token=PAD)
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return tok


def save_rm(out: Path, tokenizer, seed: int = 0) -> Path:
    """A random sequence-classification model (one label) over `tokenizer`'s vocabulary, with it in the folder."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, num_labels=1,
                      pad_token_id=tokenizer.pad_token_id)
    Qwen2ForSequenceClassification(cfg).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def other_rm(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("other_rm")
    return save_rm(out, rm_tokenizer(out))


@pytest.fixture(scope="module")
def same_rm(tiny_model_dir, tmp_path_factory) -> Path:
    """A reward model of the policy's own tokenizer (and chat template)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("same_rm")
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(out)
    return out


def policy_rows(tok):
    """Two rows as the policy makes them: ChatML prompts left-padded, responses ending in eos, right-padded."""
    from alignrl.data.collate import left_pad, right_pad

    messages = [[{"role": "user", "content": q}] for q, _ in QUESTIONS]
    prompts = [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for m in messages]
    responses = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, a in QUESTIONS]
    return messages, (*left_pad(prompts, tok.pad_token_id), *right_pad(responses, tok.pad_token_id))


def direct_score(folder: Path, text: str) -> float:
    """The reward model's score of `text` (tokenized without special tokens), read by transformers itself."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folder))(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def test_the_response_is_decoded_without_its_eos(tiny_model):
    from alignrl.models.rm_template import response_text

    tok = tiny_model[1]
    ids = tok("#### 42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert response_text(tok, ids) == "#### 42"


def test_a_reward_model_of_another_tokenizer_scores_the_retemplated_text(tiny_model, other_rm):
    from transformers import AutoTokenizer

    from alignrl.models.rm_template import RetemplatingScorer, reward_input
    from alignrl.models.value import ModelScorer

    tok = tiny_model[1]
    template = reward_input(tok, other_rm, retemplate=True, max_length=256)
    assert template is not None
    messages, (pids, pm, rids, rm) = policy_rows(tok)
    got = RetemplatingScorer(ModelScorer(str(other_rm)), tok, template).score(pids, pm, rids, rm, messages=messages)
    rm_tok = AutoTokenizer.from_pretrained(str(other_rm))
    for i, (q, a) in enumerate(QUESTIONS):
        text = rm_tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                          tokenize=False)
        assert text == f"### user:\n{q}\n### assistant:\n{a}\n"  # the eos left the response
        assert got[i].item() == pytest.approx(direct_score(other_rm, text), abs=1e-5)


def test_a_longer_conversation_keeps_its_first_tokens(tiny_model, other_rm):
    from alignrl.models.rm_template import RetemplatingScorer, reward_input, retemplated_ids
    from alignrl.models.value import ModelScorer

    tok = tiny_model[1]
    messages, (pids, pm, rids, rm) = policy_rows(tok)
    whole = retemplated_ids(tok, reward_input(tok, other_rm, True, 256), messages, rids, rm)
    cut = reward_input(tok, other_rm, True, 9)
    assert retemplated_ids(tok, cut, messages, rids, rm) == [ids[:9] for ids in whole]
    scorer = ModelScorer(str(other_rm))
    first = torch.tensor([ids[:9] for ids in whole])  # both rows are longer than 9 tokens
    want = scorer.score(first, torch.ones_like(first, dtype=torch.bool), first[:, :0], first[:, :0].bool())
    said = []
    cutting = RetemplatingScorer(scorer, tok, cut, said.append)
    assert torch.allclose(cutting.score(pids, pm, rids, rm, messages=messages), want)
    cutting.score(pids, pm, rids, rm, messages=messages)
    assert len(said) == 1 and "2 of 2 conversations are over 9 tokens" in said[0]  # said once


def test_the_policys_own_tokenizer_keeps_the_ids_path(tiny_model, tiny_model_dir, same_rm, tmp_path):
    """Re-templating asked for or not, a reward model of the policy's tokenizer scores the policy's ids, bit for bit
    what ModelScorer gives them; the loop's builder hands it out unwrapped."""
    from alignrl.models.rm_template import reward_input
    from alignrl.models.value import ModelScorer
    from alignrl.placements.build import reward_scorer

    tok = tiny_model[1]
    assert reward_input(tok, same_rm, True, 256) is None and reward_input(tok, same_rm, False, 256) is None
    messages, tensors = policy_rows(tok)
    for retemplate in (True, False):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", f"algorithm.reward_model={same_rm}",
                                 f"algorithm.reward_model_retemplate={retemplate}"])
        scorer = reward_scorer(cfg, tok, torch.device("cpu"))
        assert type(scorer) is ModelScorer
        assert torch.equal(scorer.score(*tensors), ModelScorer(str(same_rm)).score(*tensors))


def test_a_reward_model_loaded_elsewhere_is_given_the_retemplated_ids(tiny_model, tiny_model_dir, other_rm):
    """A Ray reward group (a scorer the rollout worker does not load) receives the rows in the reward model's own
    ids; without the key it receives the policy's, as before."""
    from alignrl.models.rm_template import RetemplatingScorer
    from alignrl.models.value import ModelScorer
    from alignrl.placements.build import build_rewards

    class Group:  # stands in for RayRewardScorer: records what it is sent, scores with the model
        def __init__(self):
            self.sent, self.model = [], ModelScorer(str(other_rm))

        def score(self, *tensors):
            self.sent.append(tensors)
            return self.model.score(*tensors)

    tok = tiny_model[1]
    messages, tensors = policy_rows(tok)
    group = Group()
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"algorithm.reward_model={other_rm}",
                             "algorithm.reward_model_retemplate=true"])
    stage = build_rewards(cfg, tok, torch.device("cpu"), group)
    assert isinstance(stage.reward_model, RetemplatingScorer) and stage.reward_model.inner is group
    want = RetemplatingScorer(group.model, tok, stage.reward_model.template).score(*tensors, messages=messages)
    assert torch.equal(stage.reward_model.score(*tensors, messages=messages), want)
    assert group.sent[0][2].shape[1] == 0  # the whole conversation comes as one "prompt"
    plain = build_rewards(load_config(None, [f"model.path={tiny_model_dir}", f"algorithm.reward_model={other_rm}"]),
                          tok, torch.device("cpu"), group)
    assert plain.reward_model is group  # the group's folder is checked and loaded where it lives


@pytest.mark.timeout(240)
def test_a_reward_service_of_its_own_template_scores_as_in_process(tiny_model, tiny_model_dir, other_rm):
    """`alignrl serve reward --input_tokenizer POLICY` with the rows' messages sent along (services.reward_url with
    algorithm.reward_model_retemplate): the in-process re-templating scorer's scores."""
    from alignrl.models.rm_template import RetemplatingScorer, reward_input
    from alignrl.models.value import ModelScorer
    from alignrl.rollout.remote import ServiceError
    from alignrl.rollout.remote_reward import RemoteReward
    from alignrl.serve.process import ServiceProcess

    tok = tiny_model[1]
    messages, tensors = policy_rows(tok)
    want = RetemplatingScorer(ModelScorer(str(other_rm)), tok, reward_input(tok, other_rm, True, 256)).score(
        *tensors, messages=messages)
    with ServiceProcess(["reward", "--model", str(other_rm), "--input_tokenizer", str(tiny_model_dir),
                         "--max_length", "256"]) as svc:
        got = RemoteReward(svc.url, messages=True).score(*tensors, messages=messages)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        with pytest.raises(ServiceError, match="send the policy's token ids with each row's prompt") as e:
            RemoteReward(svc.url, retries=1).score(*tensors)  # no messages: a re-templating service says so
        assert "HTTP 400" in one_line(e)
    with pytest.raises(ServiceError, match="takes texts") as e:  # OpenRLHF's endpoint templates its texts itself
        RemoteReward("http://127.0.0.1:5000/get_reward", messages=True)
    one_line(e)


def test_a_reward_service_of_the_policys_ids_refuses_messages():
    import asyncio

    from alignrl.serve.common import RequestError
    from alignrl.serve.reward import RewardService, ScoreRequest

    svc = RewardService(scorer=None, tokenizer=None, pad_id=0, vocab_size=10, max_model_len=16, max_request_seqs=4)
    req = ScoreRequest(prompts=[[1]], responses=[[2]], messages=[[{"role": "user", "content": "hi"}]])
    with pytest.raises(RequestError, match="start it with --input_tokenizer"):
        asyncio.run(svc.score(req))


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_what_cannot_work_is_one_line(tiny_model, other_rm, tmp_path):
    from alignrl.models.rm_template import reward_input

    tok = tiny_model[1]
    with pytest.raises(ModelError) as e:  # another vocabulary read as the policy's ids: garbage, so refused
        reward_input(tok, other_rm, retemplate=False, max_length=256)
    assert "algorithm.reward_model_retemplate=true" in one_line(e)
    bare = tmp_path / "no_template"
    save_rm(bare, rm_tokenizer(bare, template=None))
    with pytest.raises(ModelError, match="no chat template") as e:
        reward_input(tok, bare, retemplate=True, max_length=256)
    one_line(e)
    no_tok = tmp_path / "no_tokenizer"
    save_rm(no_tok, rm_tokenizer(tmp_path / "elsewhere"))
    with pytest.raises(ModelError, match="no tokenizer files") as e:
        reward_input(tok, no_tok, retemplate=True, max_length=256)
    one_line(e)
    with pytest.raises(ModelError, match="fewer than the policy's") as e:  # no tokenizer, too few embeddings
        reward_input(tok, no_tok, retemplate=False, max_length=256)
    one_line(e)
    from alignrl.models.rm_template import chat_ids

    strict = rm_tokenizer(tmp_path / "strict", template="{{ raise_exception('roles must alternate\nuser/assistant') }}")
    with pytest.raises(ModelError, match="cannot render a row's conversation .*roles must alternate") as e:
        chat_ids(strict, [{"role": "user", "content": "hi"}], "hello", 64)
    one_line(e)


def test_the_cli_refuses_another_vocabulary_before_the_policy_loads(tiny_model_dir, other_rm, cli_in_process,
                                                                     tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = cli_in_process("train", "ppo", f"model.path={tiny_model_dir}", f"algorithm.reward_model={other_rm}",
                         f"trainer.output_dir={tmp_path / 'out'}")
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "reward_model_retemplate" in line]
    assert len(lines) == 1 and "Traceback" not in run.stderr


def skywork_hhrlhf(model: str, rm: str, train: str) -> list[str]:
    """examples/grpo_trainer/run_mistral13b_skyworkrm_hhrlhf.sh (volcengine/verl), `python3 -m
    verl.trainer.main_ppo`: shrunk in paths, GPU counts, batch sizes, lengths and steps only."""
    return ["algorithm.adv_estimator=grpo", f"data.train_files={train}", f"data.val_files={train}",
            "data.train_batch_size=2", "data.prompt_key=prompt", "data.return_raw_chat=True",
            "data.max_prompt_length=128", "data.max_response_length=6", "data.filter_overlong_prompts=True",
            "data.truncation=error", f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.use_kl_loss=False",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True", "reward_model.enable=True",
            "reward_model.model.fsdp_config.param_offload=True", f"reward_model.model.path={rm}",
            f"reward_model.model.input_tokenizer={model}", "reward_model.micro_batch_size_per_gpu=4",
            "algorithm.use_kl_in_reward=False", "trainer.logger=['console']", "trainer.val_before_train=False",
            "trainer.project_name=verl_full_hh_rlhf_examples", "trainer.experiment_name=grpo_skywork_hhrlhf",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.save_freq=10", "trainer.test_freq=-1",
            "trainer.total_epochs=5"]


def test_verls_keys_map_onto_retemplating(tmp_path):
    from test_verl07_scripts import write_math

    train = write_math(tmp_path / "train.parquet")
    cfg = load_config(None, skywork_hhrlhf("demo", "rm_folder", train))
    a = cfg.algorithm
    assert (a.reward_model, a.reward_model_retemplate, a.reward_model_max_length) == ("rm_folder", True, 0)
    # verl's default input_tokenizer is the policy's path: it re-templates unless told null
    unset = [o for o in skywork_hhrlhf("demo", "rm_folder", train) if not o.startswith("reward_model.model.input_")]
    assert load_config(None, unset).algorithm.reward_model_retemplate
    # null: the reward model shares the policy's tokenizer (verl's ids path); max_length read for the template
    cfg = load_config(None, skywork_hhrlhf("demo", "rm_folder", train)
                      + ["reward_model.model.input_tokenizer=null", "reward_model.max_length=512"])
    assert (cfg.algorithm.reward_model_retemplate, cfg.algorithm.reward_model_max_length) == (False, 512)
    with pytest.raises(ConfigError, match="reward_model.max_length=0 must be a positive whole number"):
        load_config(None, skywork_hhrlhf("demo", "rm_folder", train) + ["reward_model.max_length=0"])


@pytest.mark.timeout(300)
def test_a_step_scored_by_a_reward_model_of_its_own_template(tiny_model_dir, other_rm, tmp_path, cli_in_process,
                                                             monkeypatch):
    """verl's command line with a reward model of another vocabulary: one step trains, every row scored through
    the reward model's own template."""
    from test_verl07_scripts import write_math

    from alignrl.models.rm_template import RetemplatingScorer

    scored = []
    score = RetemplatingScorer.score
    monkeypatch.setattr(RetemplatingScorer, "score", lambda self, *a, **k: scored.append(len(k["messages"])) or
                        score(self, *a, **k))
    monkeypatch.chdir(tmp_path)
    train = write_math(tmp_path / "train.parquet")
    run = cli_in_process("train", "ppo", *skywork_hhrlhf(str(tiny_model_dir), str(other_rm), train),
                         "trainer.total_training_steps=1", "trainer.progress_bar=false",
                         f"trainer.output_dir={tmp_path / 'out'}", "trainer.logger=[console,jsonl]")
    assert run.returncode == 0, run.stderr[-3000:]
    assert scored and scored[0] == 4  # 2 prompts x 2 samples
    rows = [json.loads(line) for line in next((tmp_path / "out").rglob("metrics.jsonl")).read_text().splitlines()]
    step = [r for r in rows if r.get("step") == 1][-1]
    assert step["reward/std"] > 0, step  # the random model's scores, where the rule reward of 6 tokens is all 0
