"""`python3 -m recipe.spin.main_spin <verl overrides>` is `alignrl train ppo` with verl's SPIN recipe's online DPO
(alignrl.compat.verl_spin): its reference updated from the actor every trainer.ref_update_freq steps."""

import sys

from alignrl.compat.verl_spin import main

if __name__ == "__main__":
    sys.exit(main())
