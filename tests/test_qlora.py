"""QLoRA (model.load_in_4bit): the policy's base loads as bitsandbytes NF4 layers, only LoRA adapters train on it, the
rollout engine decodes through the 4-bit layers' own forward, the saved adapter folder loads onto the
full-precision base, and the keys and flags that cannot go with a 4-bit base are one line each."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from alignrl.config import ConfigError, load_config
from alignrl.models import lora
from alignrl.models.quantized import FourBit
from conftest import SMALL_GRPO, checkpoint_dir, run_settings, small_grpo, src_path

bnb = pytest.importorskip("bitsandbytes")

QLORA = ["model.load_in_4bit=true", "model.lora_rank=4", "model.lora_alpha=8", "model.lora_export=adapter"]


def _policy(model_dir, *extra):
    """The policy as a 4-bit run's actor trains it: loaded (load_policy), adapters on (trained_policy)."""
    from alignrl.placements.build import load_policy, trained_policy
    from alignrl.runtime.env import SINGLE

    cfg = small_grpo(model_dir, *QLORA, *extra)
    model, materialize = load_policy(cfg, model_dir, SINGLE, in_shards=False)
    assert materialize is None
    return cfg, trained_policy(cfg, model, None)


def test_the_base_is_4bit_and_only_adapters_train_and_the_loss_falls(tiny_model_dir):
    cfg, model = _policy(tiny_model_dir)
    inner = lora.base_model(model)
    projections = [layer.self_attn.q_proj for layer in inner.model.layers]
    assert all(isinstance(p.get_base_layer(), bnb.nn.Linear4bit) for p in projections)
    assert all(p.get_base_layer().weight.dtype == torch.uint8 for p in projections)  # packed codes, not a matrix
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (4, 12))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses  # the adapters fit the batch through the frozen 4-bit layers


@pytest.mark.parametrize("extra, codes, nested, storage", [
    ([], "nf4", True, torch.uint8),
    (["model.bnb_4bit_quant_type=fp4", "model.bnb_4bit_use_double_quant=false"], "fp4", False, torch.uint8),
    (["model.bnb_4bit_quant_storage=bfloat16"], "nf4", True, torch.bfloat16)])
def test_the_4bit_codes_and_double_quantization_are_the_configs(tiny_model_dir, extra, codes, nested, storage):
    """model.bnb_4bit_quant_type, model.bnb_4bit_use_double_quant and model.bnb_4bit_quant_storage reach every
    quantized layer (TRL's --bnb_4bit_quant_type, --use_bnb_nested_quant and --bnb_4bit_quant_storage; OpenRLHF's
    nf4 with double quantization in uint8 is the default). The storage dtype only packs the same codes: the loss is
    the default's to the last bit."""
    torch.manual_seed(0)
    _, model = _policy(tiny_model_dir, *extra)
    layers = [m for m in lora.base_model(model).modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and {(m.weight.quant_state.quant_type, m.weight.quant_state.nested, m.weight.dtype)
                       for m in layers} == {(codes, nested, storage)}
    ids = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    if storage != torch.uint8:
        torch.manual_seed(0)
        _, packed_in_bytes = _policy(tiny_model_dir)
        assert torch.equal(loss, packed_in_bytes(input_ids=ids, labels=ids).loss)
    from alignrl.models.loader import load_model
    from alignrl.models.quantized import weights_in

    # the parameter count the LoRA runs log counts the weights the packed codes hold, in any storage dtype
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    full = sum(p.numel() for p in load_model(str(tiny_model_dir))[0].parameters())
    assert sum(weights_in(p) for p in model.parameters()) == full + adapters


def test_the_rollout_engine_decodes_through_the_4bit_layers(tiny_model_dir):
    from alignrl.rollout.decoder import KVDecoder
    from alignrl.rollout.hf_engine import HFRolloutEngine
    from alignrl.interfaces import SamplingParams
    from alignrl.models.loader import load_tokenizer

    _, model = _policy(tiny_model_dir)
    assert not KVDecoder.supports(model)  # its fused matmuls would read packed bytes as weights
    engine = HFRolloutEngine(model, load_tokenizer(tiny_model_dir))
    out = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
    assert out.response_ids.shape[0] == 4 and out.response_ids.shape[1] <= 4
    assert bool((out.response_mask.sum(1) >= 1).all()) and bool(torch.isfinite(out.logprobs[out.response_mask]).all())


# peft's own loader asks transformers 5 for `is_gradient_checkpointing`, which warns that it is deprecated: not ours
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_4bit_grpo_run_saves_an_adapter_that_loads_onto_the_full_precision_base(tiny_model_dir, tmp_path):
    from peft import PeftModel

    from alignrl.models.loader import load_model
    from alignrl.runner import train_grpo

    train_grpo(small_grpo(tiny_model_dir, *QLORA, "actor.kl_loss_coef=0.1", "actor.use_kl_loss=true",
                          *run_settings(tmp_path, "run", 2), "trainer.save_freq=1"))
    ckpt = checkpoint_dir(tmp_path, "run", 2)
    folder = ckpt / "model"
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    trained = load_file(ckpt / "model_state" / lora.TRAINED_FILE)
    assert trained and all("lora_" in k for k in trained)
    rows = [json.loads(x) for x in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["actor/kl_loss"] < 1e-6 < rows[2]["actor/kl_loss"]  # the adapters moved it off the 4-bit base
    base, _ = load_model(str(tiny_model_dir))
    model = PeftModel.from_pretrained(base, str(folder))
    mine = dict(model.named_parameters())
    moved = [k for k, v in trained.items() if k in mine]
    assert moved and all(torch.equal(mine[k], trained[k]) for k in moved)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())  # the base is full precision again


def test_a_4bit_ppo_critic_is_quantized_and_a_resumed_run_equals_a_straight_one(tiny_model_dir, tmp_path):
    """OpenRLHF's --load_in_4bit quantizes the critic too: its backbone's linear layers are 4-bit, only its adapters
    and its new value head train, its checkpoint folder is PEFT's adapter folder (a merge into 4-bit codes would not
    be a model); a run halted after step 1 and resumed ends where a straight one does, policy and critic. The codes
    are packed in float16 (model.bnb_4bit_quant_storage), whose bytes read as floats are often NaN: no checkpoint is
    refused as non-finite for them."""
    from alignrl.placements.build import build_critic
    from alignrl.runner import train_grpo
    from alignrl.train.checkpoint import nonfinite

    ppo = ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.lr=1e-2",
           "model.bnb_4bit_quant_storage=float16"]
    critic = build_critic(small_grpo(tiny_model_dir, *QLORA, *ppo), "critic", None).model
    projections = [m for m in critic.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert projections and all(isinstance(p.base_layer, bnb.nn.Linear4bit) for p in projections)
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and all("lora_" in n or ".score." in n for n in trainable), trainable
    assert any(".score." in n for n in trainable)  # the value head, new, trains whole
    state = critic.state_dict()
    packed = [k for k, v in state.items() if v.dtype == torch.float16 and not bool(torch.isfinite(v).all())]
    assert packed and not nonfinite(state)  # the case the check must pass: packed codes that read as NaN
    state[sorted(trainable)[0]] = torch.full((2,), float("nan"))
    assert nonfinite(state) == [sorted(trainable)[0]]  # and a trained tensor that is NaN is still caught

    def run(name, steps, *extra):
        train_grpo(small_grpo(tiny_model_dir, *QLORA, *ppo, *run_settings(tmp_path, name, steps),
                              "trainer.save_freq=1", *extra))
        ckpt = checkpoint_dir(tmp_path, name, steps)
        folder = ckpt / "critic"
        assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
        return {part: load_file(ckpt / part / lora.TRAINED_FILE) for part in ("model_state", "critic_state")}

    straight = run("straight", 2)
    run("halted", 1)
    resumed = run("halted", 2, "trainer.resume_mode=auto")
    first = load_file(checkpoint_dir(tmp_path, "halted", 1) / "critic_state" / lora.TRAINED_FILE)
    assert any(not torch.equal(first[k], resumed["critic_state"][k]) for k in first)  # the critic trained on
    for part in straight:
        assert straight[part].keys() == resumed[part].keys()
        for k in straight[part]:
            torch.testing.assert_close(straight[part][k], resumed[part][k], rtol=0, atol=0, msg=f"{part}: {k}")


@pytest.mark.parametrize("keys, words", [
    (["model.lora_rank=0"], "model.load_in_4bit=true freezes a 4-bit base and trains LoRA adapters on it (QLoRA): "
                            "set model.lora_rank > 0"),
    (["trainer.strategy=fsdp2"], "trainer.strategy=fsdp2 shards the weights, and bitsandbytes' 4-bit weights do not "
                                 "shard"),
    (["trainer.strategy=deepspeed"], "trainer.strategy=deepspeed shards the weights"),
    (["model.lora_export=merged"], "model.lora_export=merged folds the adapters into the base weights, which with "
                                   "model.load_in_4bit are 4-bit codes: set model.lora_export=adapter"),
    (["services.generation_url=http://127.0.0.1:9"], "services.generation_url receives the policy's merged weights"),
    (["pipeline.placement=zmq"], "pipeline.placement=zmq sends the samplers the policy's merged weights"),
])
def test_keys_that_cannot_go_with_a_4bit_base_are_one_line(tiny_model_dir, keys, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*SMALL_GRPO, f"model.path={tiny_model_dir}", *QLORA, *keys])
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_without_bitsandbytes_4bit_is_one_line_naming_the_extra(tiny_model_dir, monkeypatch):
    from alignrl.models.loader import load_causal_lm

    class NotInstalled:  # an import of it now fails as if it were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "bitsandbytes":
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NotInstalled(), *sys.meta_path])
    with pytest.raises(ConfigError) as e:
        load_causal_lm(tiny_model_dir, four_bit=FourBit())
    assert "model.load_in_4bit: 4-bit loading needs the bitsandbytes package, which is not installed; " \
           "`pip install 'alignrl[qlora]'`" in str(e.value)


def test_adapters_without_4bit_leave_bitsandbytes_unimported(tmp_path):
    """peft imports bitsandbytes whenever it is installed, and with it torch's compiler stack: a process that trains
    adapters over full weights keeps it out; one that asks for 4-bit weights afterwards still gets it."""
    code = (
        "import sys\n"
        "from alignrl.models import lora\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "base = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, "
        "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))\n"
        "model = lora.add_adapters(base, lora.lora_spec(4, target_modules=('q_proj', 'v_proj')))\n"
        "print('after adapters', sys.modules.get('bitsandbytes') is not None)\n"
        "import dataclasses\n"
        "from alignrl.preference.qlora_checks import with_4bit_checked\n"
        "cfg = dataclasses.make_dataclass('Offline', [('load_in_4bit', bool, True), ('use_lora', bool, True), "
        "('strategy', str, 'ddp'), ('lora_export', str, 'merged')])()\n"
        "print('offline check', with_4bit_checked(cfg, set()).lora_export)\n"  # it finds bitsandbytes all the same
        "from alignrl.models.quantized import require_bitsandbytes\n"
        "import peft.import_utils as probe\n"
        "print('after 4-bit', require_bitsandbytes() is sys.modules['bitsandbytes'], probe.is_bnb_4bit_available())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": src_path()})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "after adapters False" in done.stdout and "after 4-bit True True" in done.stdout, done.stdout
    assert "offline check adapter" in done.stdout, done.stdout


def test_a_4bit_start_prints_no_kernel_notice(tiny_model_dir):
    """bitsandbytes' CPU backend logs a missing optional kernel package at import; alignrl's loads silence it."""
    code = ("from alignrl.models.loader import load_causal_lm; from alignrl.models import lora; "
            "from alignrl.models.quantized import FourBit; "
            f"m = load_causal_lm({str(tiny_model_dir)!r}, four_bit=FourBit()); "
            "lora.add_adapters(m, lora.lora_spec(4)); print('loaded')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": src_path()})
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr
    assert "kernels" not in done.stderr and "Failed" not in done.stderr, done.stderr


def test_trl_load_in_4bit_with_peft_is_qlora_and_without_it_one_line(tiny_model_dir):
    from alignrl.compat.trl_grpo_flags import TrlFlagError
    from alignrl.compat.trl_grpo_keys import from_line

    line = ["--model_name_or_path", str(tiny_model_dir), "--dataset_name", "d.jsonl", "--reward_funcs",
            "accuracy_reward", "--use_peft", "--lora_r", "4", "--load_in_4bit"]
    words, _ = from_line(line)
    assert "model.load_in_4bit=true" in words and "model.lora_export=adapter" in words and "model.lora_rank=4" in words
    cfg = load_config(None, [w for w in words if w.startswith(("model.", "trainer.strategy"))])
    assert cfg.model.load_in_4bit and cfg.model.lora_rank == 4 and cfg.model.lora_export == "adapter"
    assert "model.load_in_4bit=true" not in from_line([*line[:-1], "--load_in_4bit", "false"])[0]
    # TRL's ModelConfig: nf4 codes, double quantization off unless --use_bnb_nested_quant
    assert cfg.model.bnb_4bit_quant_type == "nf4" and not cfg.model.bnb_4bit_use_double_quant
    words, _ = from_line([*line, "--bnb_4bit_quant_type", "fp4", "--use_bnb_nested_quant"])
    assert {"model.bnb_4bit_quant_type=fp4", "model.bnb_4bit_use_double_quant=true"} <= set(words), words
    with pytest.raises(TrlFlagError, match="--bnb_4bit_quant_type int4: give nf4 or fp4"):
        from_line([*line, "--bnb_4bit_quant_type", "int4"])
    assert cfg.model.bnb_4bit_quant_storage == "uint8"  # TRL's ModelConfig default
    assert "model.bnb_4bit_quant_storage=bfloat16" in from_line([*line, "--bnb_4bit_quant_storage", "bfloat16"])[0]
    with pytest.raises(TrlFlagError, match="--bnb_4bit_quant_storage bf16: give one of uint8, int8, float16"):
        from_line([*line, "--bnb_4bit_quant_storage", "bf16"])
    with pytest.raises(TrlFlagError, match=r"--load_in_4bit quantizes the frozen base under LoRA adapters \(QLoRA\), "
                                           "and trains nothing without them: add --use_peft"):
        from_line([w for w in line if w != "--use_peft"])
    with pytest.raises(TrlFlagError, match="--load_in_4bit=maybe: give true or false"):
        from_line([*line[:-1], "--load_in_4bit=maybe"])
    from alignrl.compat import trl_online_dpo, trl_rloo  # their lines are read by the same splitter

    peft = ["--use_peft", "--lora_r", "4", "--load_in_4bit"]
    for other, own in ((trl_rloo, ["--reward_funcs", "accuracy_reward"]),
                       (trl_online_dpo, ["--reward_model_path", "org/rm"])):
        words, _ = other.from_line(["--dataset_name", "d.jsonl", *own, *peft])
        assert "model.load_in_4bit=true" in words and "model.lora_rank=4" in words, other.__name__


@pytest.mark.slow
def test_a_4bit_grpo_run_on_two_ddp_ranks(tiny_model_dir, tmp_path):
    from conftest import run_group

    cmd = [sys.executable, "-m", "alignrl", "train", "grpo", "--nproc", "2", *SMALL_GRPO,
           f"model.path={tiny_model_dir}",
           *QLORA, "data.train_batch_size=4", "trainer.strategy=ddp", *run_settings(tmp_path, "ddp", 1),
           "trainer.save_freq=1"]
    done = run_group(cmd, 240, env={**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60",
                                    "PYTHONPATH": src_path()})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "on 2 rank(s), strategy ddp" in done.stdout and "base quantized to 4-bit NF4" in done.stdout
    trained = load_file(checkpoint_dir(tmp_path, "ddp", 1) / "model_state" / lora.TRAINED_FILE)
    assert trained and all("lora_" in k for k in trained)
    assert (checkpoint_dir(tmp_path, "ddp", 1) / "model" / "adapter_config.json").is_file()


def test_openrlhf_ppo_ray_load_in_4bit_says_where_qlora_runs():
    from alignrl.compat import openrlhf_flags as F

    args = F.parser().parse_args(["--pretrain", "m", "--lora_rank", "8", "--load_in_4bit"])
    with pytest.raises(F.FlagError) as e:
        F.check(args)
    assert "ppo-ray's rollout engines load the policy's merged weights" in str(e.value)
    assert "alignrl train grpo model.load_in_4bit=true" in str(e.value) and "\n" not in str(e.value)


def test_openrlhf_opd_load_in_4bit_is_qlora_under_ddp(tmp_path):
    from alignrl.compat import openrlhf_opd as O

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"count from {i}"}) + "\n" for i in range(10)))
    line = ["--model.model_name_or_path", "student", "--teacher.model_name_or_path", "teacher",
            "--data.prompt_dataset", str(prompts), "--data.max_len", "2048", "--train.batch_size", "2",
            "--ds.load_in_4bit"]
    a = vars(O.parser().parse_args([*line, "--ds.lora.rank", "8"]))
    O.check(a)
    cfg = load_config(None, O.overrides(a, False))
    assert (cfg.model.load_in_4bit, cfg.model.lora_rank, cfg.model.lora_export) == (True, 8, "adapter")
    on_gpus = O.overrides(a, True)  # DeepSpeed's engine is left for DDP, which trains a 4-bit base
    assert "trainer.strategy=auto" in on_gpus and not any(k.startswith("trainer.zero_stage") for k in on_gpus)
    with pytest.raises(O.OpdFlagError, match=r"--ds.load_in_4bit quantizes the frozen base under LoRA adapters "
                                             r"\(QLoRA\), and trains nothing without them: add --ds.lora.rank"):
        O.check(vars(O.parser().parse_args(line)))
