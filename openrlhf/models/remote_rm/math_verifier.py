"""`python -m openrlhf.models.remote_rm.math_verifier --dataset FILE --input_key message --prompt-template chatml`
(LMM-R1's remote reward, as seed scripts start it) is `alignrl serve reward --protocol openrlhf` with the same flags:
`POST /get_reward` on 127.0.0.1:5000 (`--port`, `--host`), 0.5 × format + math-verified accuracy."""

import sys

try:
    from alignrl.serve.reward import main
except ModuleNotFoundError as e:  # a Python without alignrl (a Ray started from another environment)
    if (e.name or "").split(".")[0] != "alignrl":
        raise
    sys.exit(f"python -m openrlhf.models.remote_rm.math_verifier: {sys.executable} cannot import {e.name}: alignrl is "
             "not installed in this Python; run it from the environment alignrl is installed in (`make install`)")

if __name__ == "__main__":
    sys.exit(main(["--protocol", "openrlhf", *sys.argv[1:]]))
