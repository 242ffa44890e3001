"""One rank of the evaluation-copy test (torchrun, two gloo ranks, FSDP2): what `place` builds for the held-out
evaluation beside producers in other processes, with and without an evaluation engine of theirs."""

import argparse
import json

import torch

from alignrl.algos.placement import place
from alignrl.algos.sinks import Fanout, SharedModule
from alignrl.config import load_config
from alignrl.dist.env import barrier, init_distributed
from alignrl.rollout.hf_engine import HFRolloutEngine


class Evaluator:
    """The producers' engine (Ray's rollout engines): never asked to generate here."""

    def generate(self, prompts, params):
        raise AssertionError("no evaluation in this test")

    def load_weights(self, named_tensors):
        raise AssertionError("the producers' engines get weights through their own sink")


class Producers:
    """RemoteProducers whose sink sends nothing, with or without an evaluation engine."""

    def __init__(self, evaluator):
        self.evaluator_ = evaluator

    def sink(self, actor, env):
        return SharedModule()

    def source(self, sampler, trainer, env):
        raise AssertionError("not used")

    def critics(self, cfg, resume, env):
        return None

    def evaluator(self, pad_id):
        return self.evaluator_


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    env = init_distributed("cpu")
    cfg = load_config(None, [f"model.path={a.model}", "trainer.strategy=fsdp2", "trainer.progress_bar=false"])
    out = {}
    for name, evaluator in (("own", None), ("producers", Evaluator())):
        placed = place(cfg, cfg.model.path, None, env, Producers(evaluator))
        actor, engine = placed.trainer.actor, placed.eval_engine
        copy = isinstance(engine, HFRolloutEngine) and engine.model is not actor.model
        with torch.no_grad():  # the policy moves; the publish must bring rank 0's copy along
            for p in actor.model.parameters():
                p.add_(0.5)
        placed.sink.publish(1)  # collective on every rank
        full = actor.engine.full_state_dict()
        same = copy and all(torch.equal(v, full[k]) for k, v in engine.model.state_dict().items() if k in full)
        out[name] = {"copy": copy, "copy_follows": same, "evaluator": engine is evaluator,
                     "fanout": isinstance(placed.sink, Fanout)}
    with open(f"{a.out}.{env.rank}.json", "w") as f:
        json.dump(out, f)
    barrier(env)  # no rank leaves while the other may still be in a collective
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
