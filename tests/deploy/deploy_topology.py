"""Reading docker-compose.yml, deploy/Dockerfile and deploy/k8s the way their tools do, so the
tests can check them and run their commands as processes on loopback.

- :func:`load_compose` parses the file and interpolates ``${VAR}``, ``${VAR:-default}`` and
  ``$$`` like ``docker compose`` does (given an environment).
- :class:`Dockerfile` knows each stage's ENTRYPOINT, USER, EXPOSE and COPY sources.
- :class:`Rewriter` maps container names/ports and container paths onto loopback ports and
  local paths, so a service's command and environment run unchanged otherwise.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
SCHEMA = Path(__file__).with_name("compose_spec.json")

_VAR = re.compile(
    r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group("name") or m.group("bare")
            got = env.get(name)
            return got if got else (m.group("default") or "")

        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    return interpolate(raw_compose(), env or {})


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def command(service: Mapping[str, Any], key: str = "command") -> list[str]:
    cmd = service.get(key) or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def profiles(doc: Mapping[str, Any]) -> list[str]:
    return sorted({p for s in doc["services"].values() for p in s.get("profiles", [])})


def profile_sets(doc: Mapping[str, Any]) -> list[set[str]]:
    names = profiles(doc)
    return [set(c) for n in range(len(names) + 1) for c in combinations(names, n)]


def active(doc: Mapping[str, Any], enabled: set[str]) -> dict[str, Any]:
    """Services ``docker compose --profile ...`` would start."""
    return {n: s for n, s in doc["services"].items() if not s.get("profiles") or enabled & set(s["profiles"])}


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: spec.get("condition", "service_started") for d, spec in deps.items()}


@dataclass
class Port:
    host: int | None
    container: int


def ports(service: Mapping[str, Any]) -> list[Port]:
    out = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.append(Port(p.get("published") and int(p["published"]), int(p["target"])))
            continue
        parts = str(p).split("/")[0].split(":")
        out.append(Port(int(parts[-2]) if len(parts) > 1 else None, int(parts[-1])))
    return out


@dataclass
class Mount:
    source: str
    target: str
    bind: bool


def mounts(service: Mapping[str, Any]) -> list[Mount]:
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out.append(Mount(v.get("source", ""), v["target"], v.get("type") == "bind"))
            continue
        source, target = str(v).split(":")[:2]
        out.append(Mount(source, target, source.startswith((".", "/"))))
    return out


# --- Dockerfile -------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    user: str = ""
    workdir: str = ""
    expose: list[int] = field(default_factory=list)
    copies: list[tuple[list[str], str]] = field(default_factory=list)  # (sources, dest), build context only
    healthcheck: list[str] = field(default_factory=list)


class Dockerfile:
    def __init__(self, path: Path = DOCKERFILE) -> None:
        self.stages: dict[str, Stage] = {}
        text = re.sub(r"\\\n", " ", path.read_text())
        stage: Stage | None = None
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            word, _, rest = line.partition(" ")
            word, rest = word.upper(), rest.strip()
            if word == "FROM":
                parts = rest.split()
                base = parts[0]
                name = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else str(len(self.stages))
                inherited = self.stages.get(base)
                stage = Stage(name, base)
                if inherited is not None:
                    stage.entrypoint, stage.cmd, stage.user, stage.workdir = (
                        inherited.entrypoint, inherited.cmd, inherited.user, inherited.workdir)
                    stage.expose = list(inherited.expose)
                self.stages[name] = stage
            elif stage is None:
                continue
            elif word in ("ENTRYPOINT", "CMD"):
                setattr(stage, word.lower() if word == "ENTRYPOINT" else "cmd", _exec_form(rest))
            elif word == "USER":
                stage.user = rest
            elif word == "WORKDIR":
                stage.workdir = rest
            elif word == "EXPOSE":
                stage.expose += [int(p.split("/")[0]) for p in rest.split()]
            elif word == "COPY":
                args = [a for a in shlex.split(rest) if not a.startswith("--")]
                if "--from" not in rest:
                    stage.copies.append((args[:-1], args[-1]))
            elif word == "HEALTHCHECK":
                stage.healthcheck = _exec_form(rest[rest.index("CMD") + 3 :].strip())


def _exec_form(text: str) -> list[str]:
    text = text.strip()
    return json.loads(text) if text.startswith("[") else ["/bin/sh", "-c", text]


# --- running compose services as processes -----------------------------------------------------


class Rewriter:
    """Replaces ``host:port`` and container paths inside strings (longest match first)."""

    def __init__(self, addresses: Mapping[str, str], paths: Mapping[str, Path]) -> None:
        self.pairs = sorted({**addresses, **{k: str(v) for k, v in paths.items()}}.items(), key=lambda kv: -len(kv[0]))

    def __call__(self, value: str) -> str:
        pattern = "|".join(re.escape(k) for k, _ in self.pairs)
        table = dict(self.pairs)
        return re.sub(pattern, lambda m: table[m.group(0)], value) if pattern else value

    def all(self, values: Iterable[str]) -> list[str]:
        return [self(v) for v in values]

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {k: self(v) for k, v in env.items()}


# --- a multi-service profile as processes ----------------------------------------------------------

_SERVICE_PORT = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z][\w.-]*|\d+\.\d+\.\d+\.\d+):(?P<port>\d{2,5})\b")


def strings(service: Mapping[str, Any]) -> list[str]:
    """Every string of a service's command, entrypoint, environment and healthcheck."""
    out = command(service) + command(service, "entrypoint") + list(environment(service).values())
    hc = service.get("healthcheck") or {}
    return out + [str(t) for t in hc.get("test", [])]


def references(service: Mapping[str, Any], names: Iterable[str]) -> set[tuple[str, int]]:
    """The (service, port) pairs a service's strings name, as ``host:port`` with a service as host."""
    names = set(names)
    return {(m["host"], int(m["port"])) for s in strings(service) for m in _SERVICE_PORT.finditer(s)
            if m["host"] in names}


def listens(service: Mapping[str, Any]) -> set[int]:
    """Ports a service binds by the wildcard address in its strings (``0.0.0.0:P``)."""
    return {int(m["port"]) for s in strings(service) for m in _SERVICE_PORT.finditer(s) if m["host"] == "0.0.0.0"}


def networks(service: Mapping[str, Any]) -> set[str]:
    nets = service.get("networks")
    if service.get("network_mode"):
        return set()
    if nets is None:
        return {"default"}
    return set(nets)


class Loopback:
    """Each (service, container port) of a set of services on its own free loopback port, and a
    :class:`Rewriter` per service: other services' ``name:port``, its own ``0.0.0.0:port`` and
    ``127.0.0.1:port`` (its healthcheck), and its mounts' container paths (bind mounts: the file
    in the repository; volumes: a directory under ``root/volumes``, shared by name)."""

    def __init__(self, services: Mapping[str, Any], names: Iterable[str], root: Path,
                 free_port: Any) -> None:
        self.services = services
        self.names = list(names)
        self.root = root
        self.ports: dict[tuple[str, int], int] = {}
        for name in self.names:
            svc = services[name]
            for key in references(svc, self.names) | {(name, p) for p in listens(svc)}:
                if key not in self.ports:
                    self.ports[key] = free_port()

    def addr(self, name: str, port: int) -> str:
        return f"127.0.0.1:{self.ports[(name, port)]}"

    def volume(self, name: str) -> Path:
        path = self.root / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def paths(self, name: str) -> dict[str, Path]:
        return {m.target: REPO / m.source if m.bind else self.volume(m.source) for m in mounts(self.services[name])}

    def rewriter(self, name: str, extra: Mapping[str, str] | None = None) -> Rewriter:
        addresses = {f"{svc}:{port}": f"127.0.0.1:{local}" for (svc, port), local in self.ports.items()}
        for (svc, port), local in self.ports.items():
            if svc == name:
                addresses[f"0.0.0.0:{port}"] = addresses[f"127.0.0.1:{port}"] = f"127.0.0.1:{local}"
        return Rewriter({**addresses, **(extra or {})}, self.paths(name))
