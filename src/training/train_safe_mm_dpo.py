"""The Safe-MM-DPO entry point, kept so its commands work as written from the repository root:

    torchrun --nproc_per_node=8 --master_port=29501 -m src.training.train_safe_mm_dpo \\
        --config configs/dpo_config.yaml --output_dir models/aligned --logging_dir logs/training/safe_mm_dpo

Everything lives in `alignrl.preference.dpo`, its command line in `alignrl.preference.cli` (also
`alignrl train dpo ...`). The loss is Safe-MM-DPO (`loss_type: safe_mm_dpo`, the default; `alignrl.core.safe_mm_dpo`),
which needs the two scorers of train_rm; the Safe-MM-DPO project's own dpo_config.yaml (λ_init, β_ori, λ_lr, w, k,
use_lora + lora, ...) loads as it is.
"""

import sys

from alignrl.preference.cli import dpo_main

if __name__ == "__main__":
    sys.exit(dpo_main())
