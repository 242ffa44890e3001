"""The reward-model entry point, kept so its commands work as written from the repository root:

    torchrun --nproc_per_node=8 --master_port=29500 -m src.training.train_rm \\
        --config configs/rm_config.yaml --task helpful --output_dir models/helpful_rm
    python -m src.training.train_rm --config configs/rm_config.yaml --task helpful --output_dir models/helpful_rm

Everything lives in `alignrl.preference.rm`, its command line in `alignrl.preference.cli` (also
`alignrl train rm ...`). The Safe-MM-DPO project's own rm_config.yaml (base_model_path, num_epochs,
classification_loss_weight, use_lora + lora, ...) loads as it is.
"""

import sys

from alignrl.preference.cli import rm_main

if __name__ == "__main__":
    sys.exit(rm_main())
