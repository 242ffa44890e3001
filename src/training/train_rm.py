"""The reward-model entry point, kept so its commands work as written from the repository root:

    torchrun --nproc_per_node=8 --master_port=29500 -m src.training.train_rm \\
        --config configs/rm_config.yaml --task helpful --output_dir models/helpful_rm
    python -m src.training.train_rm --config configs/rm_config.yaml --task helpful --output_dir models/helpful_rm

Everything lives in `alignrl.preference.rm`, its command line in `alignrl.preference.cli` (also
`alignrl train rm ...`).
"""

import sys

from alignrl.preference.cli import rm_main

if __name__ == "__main__":
    sys.exit(rm_main())
