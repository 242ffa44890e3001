"""HTTP services reached by URL: generation (OpenAI-compatible, with weight sync), reference
log-probs, reward scoring and retrieval. Each module has `main(argv) -> int`; `alignrl serve NAME ...` runs it.

The clients that the RL loop plugs in instead of the in-process engines live in
`alignrl.rollout.remote`.
"""
