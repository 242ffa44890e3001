"""Start-up health checks of the HTTP services a run will ask (generation, reference, reward): each answers /health
before anything is placed or loaded, and a dead one is said in one line naming its URL."""

from __future__ import annotations

import os
import sys
import time

from alignrl.config import RunConfig
from alignrl.config.checks import needs_reference, reward_urls
from alignrl.rollout.remote import ServiceClient, ServiceError
from alignrl.rollout.remote_reward import reward_endpoint


def check_services(cfg: RunConfig, log=print, wait_s: float | None = None) -> None:
    """Every service the run will ask answers /health (ServiceError, one line, otherwise; the reference service only
    when a KL term needs it; each of several reward URLs). One that refuses connections is waited for up to
    services.wait_s, saying so once: a service binds its port only once its model is loaded. `wait_s` overrides
    services.wait_s (the Ray flags of OpenRLHF have no such setting)."""
    s = cfg.services
    wait = s.wait_s if wait_s is None else wait_s
    for kind in ("generation", "reference", "reward"):
        url = getattr(s, f"{kind}_url")
        if not url or (kind == "reference" and not needs_reference(cfg)):
            continue
        for one in reward_urls(url) if kind == "reward" else [url]:
            _wait_healthy(one, kind, s.timeout_s, s.retries, wait, log)


def _wait_healthy(url: str, kind: str, timeout_s: float, retries: int, wait: float, log) -> None:
    """check_services for one URL: its /health, waited for up to `wait` seconds while it refuses connections."""
    path = reward_endpoint(url)[1] if kind == "reward" else None
    client = ServiceClient(reward_endpoint(url)[0] if path else url, kind, min(timeout_s, 30.0), retries)
    deadline, said = time.monotonic() + wait, False
    try:
        while True:
            try:
                client.check(f"services.{kind}_url")
                return
            except ServiceError as e:
                if path and e.status == 404:  # an OpenRLHF-style reward server need not have /health: it answered
                    return
                if not e.down or "not reachable" not in str(e) or time.monotonic() >= deadline:
                    raise
                if not said and os.environ.get("RANK", "0") == "0":  # stderr: launch scripts read stdout
                    log(f"waiting up to {wait:g} s for the {kind} service at {url} (services.wait_s)",
                        file=sys.stderr, flush=True)
                    said = True
                time.sleep(1.0)
    finally:
        client.close()
