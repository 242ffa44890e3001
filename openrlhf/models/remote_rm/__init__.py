"""LMM-R1's remote reward servers: `math_verifier`."""
