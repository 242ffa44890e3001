"""`python3 -m recipe.spin.main_spin <verl overrides>`: verl's SPIN recipe (recipe/spin, "online DPO inspired by
SPIN": each prompt's two sampled answers a DPO pair chosen by their rewards, a tie going to the first, the reference
replaced by the actor every `trainer.ref_update_freq` steps) as `alignrl train ppo` with
algorithm.adv_estimator=online_dpo, which is that update (docs/algorithms.md, online DPO).

The recipe's config (its spin_trainer.yaml) differs from verl's main_ppo where the line is silent: two answers a
prompt, no KL loss, 15 warm-up steps; its update reads no entropy, KL or clip setting and takes one optimizer step
over the whole batch, accumulating every micro-batch, whatever `ppo_mini_batch_size` says, so the mini-batch here is
the batch and those keys on the line are said at start to change nothing. verl's own keys of the recipe
(`algorithm.dpo_beta`, `algorithm.dpo_loss_type`) are alignrl's; `trainer.ref_update_freq=N` (also `+trainer...`) is
`actor.ref_sync_steps=N actor.ref_mixup_alpha=1.0`.
"""

from __future__ import annotations

import os
import sys

A = "actor_rollout_ref.actor."
# spin_trainer.yaml's values where verl's main_ppo defaults differ, and its update's: the DPO loss of each answer's
# summed log-probs alone (no entropy term, no PPO aggregation), one epoch
RECIPE = ["algorithm.adv_estimator=online_dpo", "actor_rollout_ref.rollout.n=2", A + "use_kl_loss=False",
          A + "entropy_coeff=0", A + "ppo_epochs=1", A + "loss_agg_mode=seq-mean-token-sum",
          A + "optim.lr_warmup_steps=15", "data.train_batch_size=1024"]
# actor keys the recipe's update reads none of: one optimizer step over the batch, the DPO loss alone
UNREAD = ("ppo_mini_batch_size", "ppo_epochs", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type",
          "loss_agg_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")


def spin_words(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the `alignrl train ppo` words for a SPIN line, the start lines saying what changed)."""
    unread = [w for w in argv if w.lstrip("+").split("=", 1)[0] in {A + k for k in UNREAD}]
    line = [w for w in argv if w not in unread]
    batches = [w.split("=", 1)[1] for w in [*RECIPE, *line] if w.lstrip("+").startswith("data.train_batch_size=")]
    lines = [f"{' '.join(unread)}: verl's SPIN recipe's update reads none of these (one optimizer step over the "
             f"whole batch of {batches[-1]} prompts, the DPO loss alone), and neither does this run"] if unread else []
    return ["train", "ppo", *RECIPE, *line, f"{A}ppo_mini_batch_size={batches[-1]}"], lines


def main(argv: list[str] | None = None) -> int:
    from alignrl.cli import main as alignrl

    words, lines = spin_words(list(sys.argv[1:] if argv is None else argv))
    if os.environ.get("RANK", "0") == "0":
        for said in lines:
            print(said, file=sys.stderr)
    return alignrl(words)
