"""algorithm.rollout_rs: rejection sampling against the rollout engine's log-probs, in verl 0.7's levels (token,
sequence, geometric, with rollout_rs_threshold and rollout_rs_threshold_lower as ratio bounds) or in current verl's
divergence options (`token_k1`, `seq_mean_k1`, `seq_max_k2`, ..., several comma-separated, all of which must pass)
with verl's threshold spec: one entry, or one per option, comma-separated; a k1 option's entry is `lower_upper` (or
`upper`, lower 1/upper), any other option's a single upper bound. `rs_options` reads them for the trainer
(`core.rollout_rejection.divergence_rejection_mask`); a spec verl would refuse is one line here."""

from __future__ import annotations

from typing import Any

from alignrl.errors import ConfigError

OLDER_LEVELS = ("token", "sequence", "geometric")  # verl 0.7's (core.rollout_rejection.REJECTION_LEVELS)

RsOption = tuple[str, "float | None", float]  # (option, lower bound of a k1 option, upper bound)


def rs_options(rs: str, threshold: Any) -> list[RsOption] | None:
    """The divergence options of `rs` with their bounds; None for none or a verl 0.7 level."""
    if rs in ("none", *OLDER_LEVELS):
        return None
    from alignrl.core.rollout_rejection import DIVERGENCE_OPTIONS  # torch: only for a config that asks for them

    names = list(dict.fromkeys(o.strip() for o in str(rs).split(",") if o.strip()))
    bad = [n for n in names if n not in DIVERGENCE_OPTIONS]
    if not names or bad:
        raise ConfigError(f"algorithm.rollout_rs={rs}: give none, token, sequence or geometric, or verl's "
                          f"options ({', '.join(DIVERGENCE_OPTIONS)}), comma-separated")
    if threshold is None or isinstance(threshold, bool):
        raise ConfigError(f"algorithm.rollout_rs={rs} needs algorithm.rollout_rs_threshold (e.g. 0.999_1.001 for a "
                          "k1 option, 0.01 for the others)")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ConfigError(f"algorithm.rollout_rs_threshold={threshold}: one bound for all of rollout_rs's "
                          f"{len(names)} options or one each, comma-separated")
    specs = specs * len(names) if len(specs) == 1 else specs
    return [_bounds(name, spec, threshold) for name, spec in zip(names, specs)]


def _bounds(name: str, spec: str, given: Any) -> RsOption:
    lower_text, sep, upper_text = spec.partition("_") if "_" in spec else ("", "", spec)
    if sep and not name.endswith("k1"):
        raise ConfigError(f"algorithm.rollout_rs_threshold={given}: {name} takes one upper bound, not "
                          f"lower_upper ({spec})")
    try:
        upper = float(upper_text)
        lower = float(lower_text) if sep else (1.0 / upper if name.endswith("k1") and upper > 0 else None)
    except ValueError:
        raise ConfigError(f"algorithm.rollout_rs_threshold={given}: {spec!r} is not a number (or lower_upper for "
                          "a k1 option)") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ConfigError(f"algorithm.rollout_rs_threshold={given}: the bounds of {name} must be positive")
    if lower is not None and lower > upper:
        raise ConfigError(f"algorithm.rollout_rs_threshold={given}: {name}'s lower bound {lower} is above its "
                          f"upper {upper}")
    return name, lower, upper


def rs_problem(alg) -> str | None:
    """What is wrong with the rejection settings, in one line, or None."""
    try:
        if rs_options(alg.rollout_rs, alg.rollout_rs_threshold) is not None or alg.rollout_rs == "none":
            return None
    except ConfigError as e:
        return str(e)
    upper = alg.rollout_rs_threshold if alg.rollout_rs_threshold is not None else alg.rollout_is_threshold
    if isinstance(upper, bool) or not isinstance(upper, (int, float)) or upper <= 0:
        return (f"algorithm.rollout_rs_threshold={upper} must be a number > 0 with rollout_rs={alg.rollout_rs} "
                "(verl's lower_upper spec goes with its k1 options, e.g. rollout_rs=token_k1)")
    low = alg.rollout_rs_threshold_lower
    if (low if low is not None else 1.0 / upper) > upper:
        return (f"algorithm.rollout_rs_threshold_lower={'default 1/upper' if low is None else low} exceeds the upper "
                f"bound {upper} (rollout_rs_threshold, else rollout_is_threshold): every token would be rejected")
    return None
