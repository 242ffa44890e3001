"""model.ref_path, a reference model of its own (OpenRLHF's --ref_pretrain), and on-policy distillation on it: the
tiny student samples, the reference is a sharper teacher, the reward is the teacher's log-prob minus the student's
per token (KL in the reward, k1, coefficient 1, no task reward), and the student's reverse KL to the teacher falls.
The combinations that cannot take a reference of its own, and a folder that is not one, are one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from alignrl.config import ConfigError, load_config
from smallrun import overrides, weights

ROWS = [{"prompt": f"count from {i}", "completion": " ".join(str(i + k) for k in range(1 + i % 4))} for i in range(16)]
# the on-policy distillation recipe of docs/algorithms.md: one on-policy update a batch, advantage = per-token reward
OPD = ["algorithm.use_kl_in_reward=true", "algorithm.kl_coef=1", "algorithm.kl_penalty=k1",
       "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0", "algorithm.whiten_advantages=none",
       "actor.use_kl_loss=false", "actor.ppo_mini_batch_size=4", "actor.lr=3e-2", "actor.lr_scheduler=constant",
       "trainer.test_freq=0", "trainer.logger=[jsonl]"]


@pytest.fixture(scope="module")
def teacher(tiny_model_dir, tmp_path_factory) -> Path:
    """A sharper model of the same tokenizer: the tiny model after a few SFT epochs on the rows."""
    from alignrl.preference.sft_cli import sft_main

    tmp = tmp_path_factory.mktemp("teacher")
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert sft_main([f"model_path={tiny_model_dir}", f"train_files=[{tmp / 'train.jsonl'}]", "--output_dir",
                     str(tmp / "teacher"), "--logging_dir", str(tmp / "logs"), "batch_size=4", "epochs=4",
                     "learning_rate=1e-2", "warmup_ratio=0", "report_to=[jsonl]"]) == 0
    return tmp / "teacher"


@pytest.fixture(scope="module")
def zero_reward(tmp_path_factory) -> str:
    """No task reward: a reward function that scores every answer 0."""
    path = tmp_path_factory.mktemp("reward") / "zero.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    return f"{path}:score"


def _reverse_kl(student, teacher, cfg) -> float:
    """KL(student || teacher) over the whole vocabulary at each token of completions the student samples for the
    run's own prompts (a token mean; seeded, so before and after read comparable samples)."""
    from alignrl.data.prompts import PromptData, load_task_data

    tok = student[1]
    prompts = PromptData(tok, load_task_data(cfg, tok)[0], cfg.data.max_prompt_length)
    torch.manual_seed(0)
    kls = []
    for i in range(8):
        ids = torch.tensor([prompts.prompt(i)])
        out = student[0].generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=8,
                                  num_return_sequences=4, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            s, t = (torch.log_softmax(m(out).logits[:, ids.shape[1] - 1:-1], -1) for m in (student[0], teacher))
        kls.append(float((s.exp() * (s - t)).sum(-1).mean()))
    return sum(kls) / len(kls)


def test_on_policy_distillation_moves_the_student_toward_the_teacher(tiny_model_dir, teacher, zero_reward, tmp_path,
                                                                      monkeypatch):
    from alignrl.models.loader import load_model
    from alignrl.runner import train_grpo

    line = overrides(tiny_model_dir, tmp_path, "opd", 8, 8) + OPD + [f"model.ref_path={teacher}",
                                                                     f"algorithm.reward_fn={zero_reward}"]
    cfg = load_config(None, line)
    student, reference = load_model(str(tiny_model_dir)), load_model(str(teacher))[0]
    before = _reverse_kl(student, reference, cfg)
    summary = train_grpo(cfg)
    assert summary["steps"] == 8
    loaded = student[0].load_state_dict(weights(tmp_path / "opd", 8), strict=False)  # the tied head is not saved
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}
    after = _reverse_kl(student, reference, cfg)
    print(f"reverse KL to the teacher on the student's samples: {before:.4f} -> {after:.4f}")
    assert before > 0.5 and after < 0.75 * before
    # the checkpoint records its reference: a resume against the base policy instead is one line, said before any
    # model loads
    monkeypatch.setattr("alignrl.runner.place", lambda *a, **k: pytest.fail("the models loaded before the check"))
    again = [o for o in line if not o.startswith(("model.ref_path=", "trainer.total_training_steps="))]
    with pytest.raises(ConfigError, match=r"was trained against model.ref_path=.*gives none: resume with model.ref_"):
        train_grpo(load_config(None, [*again, "trainer.total_training_steps=9"]))


def test_the_reference_is_the_ref_path_model_with_lora_too(tiny_model_dir, teacher):
    """Its log-probs are the teacher's, not the policy's with adapters off."""
    from alignrl.models import lora
    from alignrl.models.loader import load_model
    from alignrl.placements.build import build_ref, lora_of

    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"model.ref_path={teacher}", "model.lora_rank=4"])
    policy = lora.add_adapters(load_model(str(tiny_model_dir))[0], lora_of(cfg), task="CAUSAL_LM")
    ref = build_ref(cfg, torch.device("cpu"), policy=policy)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    theirs, ours = (build_ref(load_config(None, [f"model.path={path}"]), torch.device("cpu"))
                    for path in (teacher, tiny_model_dir))
    got = ref.logprobs(ids[:, :2], mask[:, :2], ids[:, 2:], mask[:, 2:])
    assert torch.allclose(got, theirs.logprobs(ids[:, :2], mask[:, :2], ids[:, 2:], mask[:, 2:]))
    assert not torch.allclose(got, ours.logprobs(ids[:, :2], mask[:, :2], ids[:, 2:], mask[:, 2:]))


def test_a_folder_that_is_no_model_or_of_another_vocabulary_is_one_line(tiny_model_dir, tmp_path):
    from alignrl.models.loader import ModelError
    from alignrl.placements.build import check_ref_folder

    with pytest.raises(ModelError, match=r"model.ref_path=.*is not a Hugging Face model folder"):
        check_ref_folder(load_config(None, [f"model.path={tiny_model_dir}", f"model.ref_path={tmp_path}"]))
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[-2:]  # two ids swapped: same size, other ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelError, match="its tokenizer is not the policy's"):
        check_ref_folder(load_config(None, [f"model.path={tiny_model_dir}", f"model.ref_path={other}"]))
    scorer = tmp_path / "scorer"  # a reward model's folder: no language-model head to score tokens with
    shutil.copytree(tiny_model_dir, scorer)
    (scorer / "alignrl_score.json").write_text(json.dumps({"model_type": "reward"}))
    with pytest.raises(ModelError, match="is a reward or cost model saved by `alignrl train rm`"):
        check_ref_folder(load_config(None, [f"model.path={tiny_model_dir}", f"model.ref_path={scorer}"]))


@pytest.mark.parametrize("extra, why", [
    (["services.reference_url=http://127.0.0.1:1"], "both name the reference"),
    (["actor.ref_sync_steps=2"], "is another model: set actor.ref_sync_steps=0"),
    (["actor.ref_sync_steps=2", "model.lora_rank=4"], "is another model: set actor.ref_sync_steps=0"),
    (["pipeline.placement=zmq"], "the ZeroMQ samplers check the weights they start from against model.path"),
    (["actor.use_kl_loss=false"], "is read only by a KL term or online DPO")])
def test_what_cannot_take_a_reference_of_its_own_is_one_line(extra, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, ["model.ref_path=/some/teacher", *extra])


def test_openrlhf_ref_pretrain_is_model_ref_path():
    from alignrl.compat import openrlhf_flags as F
    from alignrl.compat import openrlhf_keys as K

    def ref_path(*argv):
        args = F.parser().parse_args(["--pretrain", "demo", *argv])
        F.check(args)
        return load_config(None, K.overrides(args, False, 3)).model.ref_path

    assert ref_path("--ref_pretrain", "/teacher", "--init_kl_coef", "0.01") == "/teacher"
    assert ref_path("--ref_pretrain", "demo", "--init_kl_coef", "0.01") == ""  # --pretrain's own: the base as before
    assert ref_path("--ref_pretrain", "/teacher", "--init_kl_coef", "0") == ""  # no KL term loads no reference
    unused = K.unused_here(F.parser().parse_args(["--ref_pretrain", "/teacher", "--init_kl_coef", "0"]), False)
    assert "--ref_pretrain (--init_kl_coef 0 loads no reference)" in unused
