"""The multi-node launcher's training entry: `alignrl train grpo --config config/nodes.yaml` under this file's name.

The launchers start it on every rank (scripts/launch_distributed.sh through `deepspeed`,
scripts/launch_training.sh through torchrun, `accelerate launch --config_file
config/accelerate_config.yaml src/train_grpo.py`), so `ps aux | grep train_grpo.py` finds the trainer.

    python src/train_grpo.py [--config FILE] [key.sub=value ...]

Default config: config/nodes.yaml of this checkout. A shim over alignrl.compat.deepspeed_launcher (train_main).
"""

import sys
from pathlib import Path

from alignrl.compat.deepspeed_launcher import train_main

if __name__ == "__main__":
    sys.exit(train_main(Path(__file__).resolve().parents[1] / "config" / "nodes.yaml"))
