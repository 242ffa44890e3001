"""The config section of the run itself: its folders, length, evaluation and checkpoints, logging, the training
engine and the processes' rendezvous."""

from __future__ import annotations

from dataclasses import dataclass

from alignrl.config.option import opt


@dataclass(frozen=True)
class TrainerConfig:
    experiment_name: str = opt("grpo", "run name: outputs go to <output_dir>/<experiment_name> (empty: <output_dir>)")
    output_dir: str = opt("output", "root of all run folders")
    checkpoint_dir: str = opt("checkpoints", "checkpoint folder inside the run folder")
    log_dir: str = opt("logs", "log folder inside the run folder")
    tensorboard_dir: str = opt("", "TensorBoard event folder (OpenRLHF's --use_tensorboard PATH: PATH/<run name>); "
                                   "relative to the run folder; empty: <log_dir>/tensorboard")
    total_training_steps: int = opt(50, "RL steps", ge=1)
    total_epochs: int = opt(0, "passes over the training files (verl): when > 0, the run stops after this many "
                               "epochs or total_training_steps, whichever comes first", ge=0)
    project_name: str = opt("alignrl", "project of the run in wandb (verl's trainer.project_name)")
    nnodes: int = opt(1, "nodes × n_gpus_per_node = ranks: without --nproc, `alignrl train` starts that many local "
                         "torchrun ranks (verl's trainer.nnodes)", ge=1)
    n_gpus_per_node: int = opt(1, "ranks per node (verl's trainer.n_gpus_per_node); see trainer.nnodes", ge=1)
    test_freq: int = opt(10, "held-out accuracy every N steps (greedy unless rollout.val_temperature > 0); "
                               "0 disables", ge=0)
    eval_pass_at_k: bool = opt(False, "before and after training, also report held-out pass@k at the rollout "
                                      "temperature (k = rollout.n) beside greedy pass@1, overall and by difficulty")
    save_freq: int = opt(10, "checkpoint every N steps; 0 keeps only the final one", ge=0)
    max_checkpoints: int = opt(2, "checkpoints kept on disk (oldest removed first); 0 keeps all (verl's "
                                  "default)", ge=0)
    resume_mode: str = opt("auto", "'auto' continues from the last checkpoint, 'disable' starts fresh",
                           choices=("auto", "disable"))
    seed: int = opt(0, "seed for data order, sampling and initialisation")
    logger: list = opt(["console", "jsonl", "tensorboard"], "metric sinks: console, jsonl, tensorboard, wandb "
                                                            "(offline without network or WANDB_API_KEY)")
    progress_bar: bool = opt(True, "show a progress bar on the console")
    rollout_data_dir: str | None = opt(None, "a folder: each step's rollouts as <step>.jsonl, one line per response "
                                             "(input, output, gts, score, step: verl's trainer.rollout_data_dir)")
    validation_data_dir: str | None = opt(None, "a folder: each held-out evaluation's answers as <step>.jsonl (0: the "
                                                "base model; verl's trainer.validation_data_dir)")
    log_val_generations: int = opt(0, "held-out answers logged at each evaluation, the same problems every time: to "
                                      "<log_dir>/val_generations.jsonl, TensorBoard text and a wandb table (verl's "
                                      "trainer.log_val_generations)", ge=0)
    threads: int = opt(0, "torch CPU threads; 0: OMP_NUM_THREADS when set, else the cores free to this run (its "
                          "affinity and cgroup quota, less what other processes keep busy), split among its processes",
                       ge=0)
    cpu_lanes: int = opt(2, "on a CPU, one process: up to this many micro-batches (policy and critic updates, "
                            "log-probs and values without gradients) run side by side, each on a share of the torch threads; never more "
                            "than the threads, so a run fitted to one free core runs one. 1: one at a time", ge=1)
    strategy: str = opt("auto", "training engine of actor and critic: auto (ddp under torchrun, else single), "
                        "single, ddp, fsdp2, fsdp (verl's name: fsdp2 on several ranks, single on one), deepspeed",
                        choices=("auto", "single", "ddp", "fsdp2", "fsdp", "deepspeed"))
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage (strategy=deepspeed)", ge=0, le=3)
    offload: bool = opt(False, "DeepSpeed: keep optimizer state on the CPU (ZeRO-Offload)")
    deepspeed_config: str = opt("", "DeepSpeed JSON config file (e.g. config/deepspeed/zero3.json); empty: "
                                "generated from these keys and saved in the run folder")
    master_addr: str = opt("127.0.0.1", "torchrun rendezvous host (seed layout: training.master_node)")
    master_port: int = opt(29500, "torchrun rendezvous port (training.master_port); `--nproc` uses it when the "
                                   "config file or the command line sets it, else MASTER_PORT, else a free port", ge=1, le=65535)
    hostfile: str = opt("", "DeepSpeed-style hostfile ('host slots=N' per line) checked by `alignrl doctor`")
    device: str = opt("auto", "auto (CUDA when available), cpu or cuda", choices=("auto", "cpu", "cuda"))
    max_nonfinite_updates: int = opt(3, "RL steps in a row whose updates were all skipped for a non-finite loss or "
                                     "gradient before the run stops", ge=1)
