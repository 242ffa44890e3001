"""`alignrl doctor [--config FILE]`: checks a run's surroundings before a long job starts.

For each configured service, `/health` must answer `{"status": "healthy"}` (or an empty 200, as vLLM does), as
the configured kind when it names one (alignrl's services send `X-Alignrl-Service: generation`, ...); model folders
must exist;
the hostfile must parse (`host slots=N`, `#` comments) and each of its hosts must resolve (a host other
than this one is noted as reached over ssh, as DeepSpeed's launcher does); the rendezvous port must be free on this host
(or reachable on another); data files must exist. Prints a table and exits 1 on any failure (2 when the
config itself is invalid). Leaves out: GPU/driver checks and NCCL connectivity between nodes.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from alignrl.config import RunConfig, load_config
from alignrl.config.checks import data_files

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
HOSTFILE_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.:-]+)\s+slots=(?P<slots>\d+)$")


@dataclass(frozen=True)
class Check:
    name: str
    target: str
    ok: bool
    detail: str


def check_health(name: str, url: str, timeout: float, key: str = "") -> Check:
    """`/health` of the service configured at `key` as `name` ("generation service", ...)."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError as e:
        return Check(name, url, False, f"not reachable ({type(e).__name__}); is the service running on that host/port?")
    if r.status_code != 200:
        return Check(name, url, False, f"/health answered HTTP {r.status_code}")
    if not r.text.strip():  # vLLM's own server: healthy, its kind unsaid
        return Check(name, url, True, "healthy (empty 200, as vLLM answers)")
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or body.get("status") != "healthy":
        return Check(name, url, False, f"/health answered {r.text[:80]!r}, expected {{\"status\": \"healthy\"}}")
    from alignrl.wire.http_service import SERVICE_HEADER

    return service_kind(name, url, r.headers.get(SERVICE_HEADER), key)


def service_kind(name: str, url: str, service: object, key: str) -> Check:
    """Fails a healthy service that says it is another kind than `name` wants: swapped URLs pass /health and
    fail only at the first training request (a 404 on the reference's /v1/logprobs)."""
    wanted = name.split()[0]
    if service is None or service == wanted:
        return Check(name, url, True, "healthy" if service is None else f"healthy {wanted} service")
    return Check(name, url, False, f"{url} is a {service} service; {key or name} wants the {wanted} service "
                 "(swapped URLs?)")


def check_model(name: str, path: str) -> Check:
    if path == "demo":
        return Check(name, path, True, "embedded demo model (built on first use)")
    ok = (Path(path) / "config.json").is_file()
    return Check(name, path, ok, "HF model folder" if ok else "no config.json there: not a saved model folder")


def parse_hostfile(text: str) -> tuple[dict[str, int], list[str]]:
    """{host: slots} and one message per bad line."""
    hosts, errors = {}, []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = HOSTFILE_LINE.match(" ".join(line.split()))
        if not m or int(m["slots"]) < 1:
            errors.append(f"line {n}: {raw.strip()!r} is not 'hostname slots=N' with N >= 1")
        elif m["host"] in hosts:
            errors.append(f"line {n}: host {m['host']} is listed twice")
        else:
            hosts[m["host"]] = int(m["slots"])
    return hosts, errors


def host_lines(text: str) -> dict[str, int]:
    """{host: its line number} of a hostfile (the first line naming it)."""
    out: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if words:
            out.setdefault(words[0], n)
    return out


def _local_addresses() -> set[str]:
    addrs = set(LOCAL_HOSTS)
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            addrs |= {a[4][0] for a in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return addrs


def check_host(host: str, line: int, where: str = "hostfile", several: bool = False) -> Check:
    """Resolves `host` of hostfile line `line`; says whether it is this host or one reached over ssh. With `several`
    hosts in the file DeepSpeed's launcher reaches every one over ssh, this one too."""
    target = f"{host} ({where} line {line})"
    try:
        addrs = sorted({a[4][0] for a in socket.getaddrinfo(host, None)})
    except OSError:
        return Check("hostfile host", target, False, f"{where} line {line}: host {host} does not resolve")
    local = _local_addresses()
    if host in LOCAL_HOSTS or host in (socket.gethostname(), socket.getfqdn()) or any(
            a in local or a.startswith("127.") for a in addrs):
        return Check("hostfile host", target, True, "this host: DeepSpeed's launcher reaches it over ssh too, as "
                     "every host of a hostfile with several (passwordless ssh to itself needed)" if several else
                     "this host: its ranks start here, no ssh")
    return Check("hostfile host", target, True, f"resolves ({addrs[0]}); another host: ssh needed (passwordless "
                 "ssh from the launching node, pdsh, the same checkout path there)")


def check_hosts(path: str) -> list[Check]:
    p = Path(path)
    if not p.is_file():
        return []
    text = p.read_text()
    hosts, errors = parse_hostfile(text)
    if errors:
        return []
    lines = host_lines(text)
    return [check_host(h, lines[h], path, len(hosts) > 1) for h in hosts]


def check_hostfile(path: str) -> Check:
    p = Path(path)
    if not p.is_file():
        return Check("hostfile", path, False, "file not found")
    hosts, errors = parse_hostfile(p.read_text())
    if errors:
        return Check("hostfile", path, False, "; ".join(errors[:3]))
    if not hosts:
        return Check("hostfile", path, False, "no 'hostname slots=N' lines")
    return Check("hostfile", path, True, f"{len(hosts)} host(s), {sum(hosts.values())} slot(s)")


def check_port(host: str, port: int, timeout: float) -> Check:
    target = f"{host}:{port}"
    if host in LOCAL_HOSTS or host == socket.gethostname():
        with socket.socket() as s:
            # as the rendezvous store binds: the TIME_WAIT sockets a finished run leaves do not hold the port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return Check("rendezvous port", target, False, "in use on this host; pick another trainer.master_port")
        return Check("rendezvous port", target, True, "free")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return Check("rendezvous port", target, True, "reachable")
    except OSError as e:
        try:
            socket.getaddrinfo(host, port)
        except OSError:
            return Check("rendezvous port", target, False, "host name does not resolve")
        return Check("rendezvous port", target, True, f"host resolves; nothing listens yet ({e.strerror or e})")


def reward_checks(value: str, timeout: float) -> list[Check]:
    """Each reward service of services.reward_url (several, comma-separated, share a batch). An OpenRLHF-style one (a
    URL with a path, such as /get_reward) need not serve /health: its server is checked to answer at all."""
    import httpx

    from alignrl.config.checks import reward_urls
    from alignrl.rollout.remote_reward import reward_endpoint

    out = []
    for url in reward_urls(value or ""):
        base, path = reward_endpoint(url)
        if path is None:
            out.append(check_health("reward service", url, timeout, "services.reward_url"))
            continue
        try:
            httpx.get(base + "/health", timeout=timeout)
            out.append(Check("reward service", url, True, "its server answers (an OpenRLHF-style reward endpoint)"))
        except httpx.HTTPError as e:
            out.append(Check("reward service", url, False, f"not reachable ({type(e).__name__}); is the service "
                             "running on that host/port?"))
    return out


def run_checks(cfg: RunConfig, timeout: float) -> list[Check]:
    out: list[Check] = []
    s = cfg.services
    for kind in ("generation", "reference"):
        url = getattr(s, f"{kind}_url")
        if url:
            out.append(check_health(f"{kind} service", url, timeout, f"services.{kind}_url"))
    out += reward_checks(s.reward_url, timeout)
    out.append(check_model("policy model", cfg.model.path))
    for name, path in (("critic model", cfg.critic.model_path), ("cost model", cfg.safety.cost_model),
                       ("reward model", cfg.algorithm.reward_model)):
        if path:
            out.append(check_model(name, path))
    for name, files in (("train data", cfg.data.train_files), ("held-out data", cfg.data.val_files)):
        for path in data_files(files):
            out.append(Check(name, path, Path(path).is_file(), "exists" if Path(path).is_file() else "file not found"))
    if cfg.trainer.hostfile:
        out.append(check_hostfile(cfg.trainer.hostfile))
        out.extend(check_hosts(cfg.trainer.hostfile))
    out.append(check_port(cfg.trainer.master_addr, cfg.trainer.master_port, timeout))
    return out


def main(argv: list[str]) -> int:
    from alignrl.runtime.one_line import OneLineParser

    p = OneLineParser(prog="alignrl doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="run config (alignrl keys or the nodes.yaml layout)")
    p.add_argument("--hostfile", help="hostfile to check (default: trainer.hostfile)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per network check")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. services.generation_url=http://h:8000")
    args = p.parse_args(argv)
    overrides = list(args.overrides) + ([f"trainer.hostfile={args.hostfile}"] if args.hostfile else [])
    cfg = load_config(args.config, overrides)
    checks = run_checks(cfg, args.timeout)

    from rich.table import Table

    from alignrl.utils.tracking import console

    if console.is_terminal:
        table = Table(title="alignrl doctor")
        for col in ("check", "target", "result", "detail"):
            table.add_column(col, overflow="fold")  # wrapped, never cut: the detail is the diagnosis
        for c in checks:
            table.add_row(c.name, c.target, "[green]ok[/green]" if c.ok else "[red]FAIL[/red]", c.detail)
        console.print(table)
    else:  # a log or a pipe: one whole line per check, whatever the width
        for c in checks:
            print(f"{'ok  ' if c.ok else 'FAIL'} {c.name} {c.target}: {c.detail}")
    failed = [c for c in checks if not c.ok]
    console.print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
