"""The one RL loop: the producer (prompts -> rollout -> scores -> reference log-probs), the trainer (advantages
-> policy and critic updates -> weight publish), the step that joins them, evaluation, and the runner that
sets up, resumes, logs and checkpoints a run."""
