"""The Safe-MM-DPO entry point, kept so its commands work as written from the repository root:

    torchrun --nproc_per_node=8 --master_port=29501 -m src.training.train_safe_mm_dpo \\
        --config configs/dpo_config.yaml --output_dir models/aligned --logging_dir logs/training/safe_mm_dpo

Everything lives in `alignrl.preference.dpo`, its command line in `alignrl.preference.cli` (also
`alignrl train dpo ...`); configs/dpo_config.yaml selects the safety-aware loss (`loss_type: safe`),
which needs the two scorers of train_rm.
"""

import sys

from alignrl.preference.cli import dpo_main

if __name__ == "__main__":
    sys.exit(dpo_main())
