"""`opt`: a config field with its help text and allowed range in `metadata`, read by the checks and the reference."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, choices: tuple | None = None) -> Any:
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)
