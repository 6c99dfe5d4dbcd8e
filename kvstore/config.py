"""One typed configuration, nested by component.

Sources, later ones win: defaults < TOML file (``--config``) < environment
(``KVSTORE_<SECTION>__<FIELD>``, e.g. ``KVSTORE_DRAM__CAPACITY_BYTES=1073741824``) < CLI flags.
An invalid value fails at start with :class:`kvstore.errors.ConfigError` naming the field and
what is allowed.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from kvstore.errors import ConfigError
from kvstore.policy import DEFAULT_POLICY, policy_names
from kvstore.tier_table import LOWER, NAMES, ROWS
from kvstore.util.address import split_host_port

MiB = 1 << 20
GiB = 1 << 30
TIER_IN_FLIGHT = 16  # requests the sidecar's movers keep in flight to one lower tier
SSD_IO_THREADS = 4  # files of an SSD batch written at once
REDIS_PIPELINES = 8  # concurrent pipelines a Redis batch is split into
# Redis memory per chunk a block is cut into (fewer, larger SETs measured faster than 1 MiB)
REDIS_CHUNK_BYTES = 2 * MiB


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Section):
    grpc_address: str = Field("127.0.0.1:50051", description="HOST:PORT, or unix:/path for a Unix socket")
    local_socket: str = Field(
        "",
        description="Unix socket with the same calls for clients on this host (kvstore.server.local_server); "
        "empty: <data_dir>/kvstore.sock; off: none",
    )
    local_max_connections: int = Field(
        256, ge=1, description="local socket connections open at once (at most half the open-file limit); more refused"
    )
    local_hello_timeout_s: float = Field(5.0, gt=0, description="a local socket connection sends its hello within this")
    local_frame_timeout_s: float = Field(
        30.0, gt=0, description="a local socket frame, once begun, arrives in full (and an answer is taken) within this"
    )
    http_address: str = Field("127.0.0.1:8080", description="HOST:PORT of /stats, /metrics, /healthz, dashboard")
    http_max_connections: int = Field(
        256, ge=1, description="HTTP connections open at once (at most half the open-file limit); more answered 503"
    )
    http_probe_connections: int = Field(
        8, ge=1, description="HTTP connections past http_max_connections served /healthz, /readyz and /metrics "
        "only (any other path 503); when these are full too, the oldest of them is closed for a new one",
    )
    http_idle_timeout_s: float = Field(
        60.0, gt=0, description="an HTTP connection idle, or whose request head or body has not arrived in full, "
        "for this long is closed",
    )
    max_message_bytes: int = Field(64 * MiB, ge=1 * MiB, description="gRPC send/receive limit")
    max_batch_blocks: int = Field(65536, ge=1, description="most blocks in one request")
    stats_namespaces: int = Field(
        32,
        ge=1,
        description="namespaces with their own /stats and /metrics entry (the busiest); the rest sum as 'other'",
    )
    auth_token: str = Field("", description="bearer token required on gRPC and HTTP when set")
    tls_cert: str = Field("", description="PEM certificate for gRPC TLS")
    tls_key: str = Field("", description="PEM private key for gRPC TLS")
    shutdown_grace_s: float = Field(5.0, ge=0, description="how long in-flight gRPC calls may finish after SIGTERM")
    drain_s: float = Field(
        20.0, ge=0,
        description="at SIGTERM, after the gRPC grace: how long blocks only DRAM holds are written to the SSD, "
                    "hottest first, so a restart finds them (0: none)",
    )
    shutdown_watchdog_s: float = Field(
        15.0, gt=0,
        description="beyond shutdown_grace_s + drain_s: a shutdown still under way is ended, stacks logged (exit 70)",
    )

    def stop_bound_s(self) -> float:
        """The longest a SIGTERM's stop may take before the watchdog ends it: an orchestrator's
        grace period (Kubernetes' terminationGracePeriodSeconds, compose's stop_grace_period) must
        be longer."""
        return self.shutdown_grace_s + self.drain_s + self.shutdown_watchdog_s


class DramConfig(_Section):
    capacity_bytes: int = Field(1 * GiB, ge=64 * 1024, description="size of the shared-memory slab")
    page_bytes: int = Field(4 * MiB, ge=4096, description="slab page; each page holds slots of one size class")
    min_slot_bytes: int = Field(4096, ge=512, description="smallest size class; classes double up to page_bytes")
    prefault: bool = Field(True, description="touch every page at start so first writes don't fault")
    segment_prefix: str = Field("kvstore", description="POSIX shm name prefix")
    verify_local_reads: bool = Field(False, description="verify checksums before handing a DRAM slot to a reader")

    @field_validator("page_bytes", "min_slot_bytes")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v


class IndexConfig(_Section):
    policy: str = Field(DEFAULT_POLICY, description="eviction policy name (see `kvstore replay --help`)")
    allocation_ttl_ms: int = Field(30_000, ge=1, description="abandoned allocations are reclaimed after this")
    max_allocation_ttl_ms: int = Field(600_000, ge=1, description="longest ttl_ms an Allocate may ask for")
    lease_ttl_ms: int = Field(30_000, ge=1, description="default read-lease TTL")
    max_lease_ttl_ms: int = Field(600_000, ge=1, description="longest lease_ttl_ms a read may ask for")
    reaper_interval_ms: int = Field(500, ge=10)

    @model_validator(mode="after")
    def _defaults_within_their_caps(self) -> IndexConfig:
        """A default above its own cap would refuse every call that takes the default."""
        for default, cap in (("allocation_ttl_ms", "max_allocation_ttl_ms"), ("lease_ttl_ms", "max_lease_ttl_ms")):
            if getattr(self, default) > getattr(self, cap):
                raise ValueError(f"{default} ({getattr(self, default)}) exceeds {cap} ({getattr(self, cap)})")
        return self

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in policy_names():
            raise ValueError(f"unknown policy {v!r}; allowed: {policy_names()}")
        return v


class SsdConfig(_Section):
    enabled: bool = True
    path: str = Field("", description="directory for blocks; default <data_dir>/ssd")
    layout: Literal["files", "segments"] = Field(
        "segments",
        description="segments: segment files of many blocks and one index log (a start imports a files "
        "directory); files: one file per block (refuses a segments directory)",
    )
    checkpoint_records: int = Field(
        1 << 20, ge=16, description="segments: the index log is rewritten from its live records once it holds "
        "more than this many and twice the live ones",
    )
    capacity_bytes: int = Field(16 * GiB, ge=64 * 1024)
    direct_io: bool = Field(True, description="O_DIRECT where the filesystem allows it")
    io_threads: int = Field(
        SSD_IO_THREADS, ge=1, le=64, description="files of a batch written at once (device queue depth)"
    )
    fsync: bool = Field(
        True,
        description="make each batch durable (one fsync per directory); "
        "false: survives a sidecar crash, not a power loss",
    )
    recycle_fraction: float = Field(
        1.0,
        ge=0,
        le=1,
        description="files layout: deleted block files kept to be overwritten by the next puts (no new extents), "
        "up to this share of capacity_bytes; 0: unlink",
    )


class RedisConfig(_Section):
    enabled: bool = False
    url: str = Field("redis://127.0.0.1:6379/0", description="redis:// URL; with cluster=true any node of the cluster")
    cluster: bool = False
    key_prefix: str = "kvstore"
    ttl_s: int = Field(0, ge=0, description="expire blocks after this many seconds (0: never)")
    chunk_bytes: int = Field(
        REDIS_CHUNK_BYTES,
        ge=64 * 1024,
        le=2 * MiB * 8,
        description="Redis memory per chunk (a power of two fits a jemalloc size class); "
        "each carries 64 bytes less of the block",
    )
    retries: int = Field(3, ge=0, description="redis-py Retry attempts after a connection error")
    backoff_base_s: float = Field(0.05, gt=0, description="ExponentialBackoff base between retries")
    backoff_cap_s: float = Field(1.0, gt=0, description="ExponentialBackoff cap between retries")
    socket_timeout_s: float = Field(5.0, gt=0, description="connect and read timeout")
    pipelines: int = Field(
        REDIS_PIPELINES, ge=1, le=64, description="a batch is sent as this many concurrent pipelines (connections)"
    )
    direct_io: bool = Field(
        True, description="block bytes on raw sockets straight into and out of DRAM slots; false: through redis-py"
    )
    max_connections: int = Field(
        256, ge=1, description="connection pool size (per node in a cluster); >= 16 movers x pipelines"
    )

    @model_validator(mode="after")
    def _pool_fits_the_movers(self) -> RedisConfig:
        need = TIER_IN_FLIGHT * self.pipelines
        if self.max_connections < need:  # redis-py raises "Too many connections" past the pool
            raise ValueError(
                f"max_connections: {self.max_connections} < {need} "
                f"({TIER_IN_FLIGHT} requests in flight x pipelines {self.pipelines})"
            )
        return self


class S3Config(_Section):
    enabled: bool = False
    endpoint_url: str = Field("", description="empty for AWS; http://host:port for MinIO or moto")
    bucket: str = "kvstore"
    prefix: str = "blocks"
    region: str = "us-east-1"
    concurrency: int = Field(8, ge=1, le=256)
    multipart_threshold_bytes: int = Field(8 * MiB, ge=5 * MiB)
    part_bytes: int = Field(8 * MiB, ge=5 * MiB, description="multipart upload part size")
    max_attempts: int = Field(3, ge=1, description="botocore retry attempts (standard mode)")
    timeout_s: float = Field(10.0, gt=0, description="connect and read timeout")
    sign_payload: bool = Field(
        False,
        description="SigV4-sign every body (a SHA-256 of each block); "
        "off: headers signed, bodies checked by their own checksum",
    )


QUOTA_TIERS = NAMES  # the tiers a tenant quota may be set for: every row of kvstore.tier_table
# All tenants' retained bytes in a tier, at most this share of its capacity by default (the one
# place of the value: tenants.retained_fraction, and what kvstore replay's hints may hold), tuned
# by replay on the agentic and the shared traces (docs/eviction.md, "Hints the cache can afford").
RETAINED_FRACTION = 0.6
# tenants.retained_adaptive: on; over the hints table it meets the goal in all 72 cells (the lowest, the
# agentic trace's global cache of 8 x 5%, credit: 1.00006x), the fixed share (false) in 62; it gives up
# most of the fixed share's gains at 5% over 8 nodes, and a node's first hinted turns decide its share:
# docs/eviction.md.
RETAINED_ADAPTIVE = True

Bytes = Annotated[int, Field(ge=0)]
# A tier's own key, ``<tier>_<suffix>`` (``ssd_quota_bytes``), sets that tier's entry of the mapping.
_PER_TIER_KEYS = (("_quota_bytes", "quota_bytes", Bytes), ("_quotas", "quotas", dict[str, Bytes]),
                  ("_retained_bytes", "retained_bytes", Bytes))


def _per_tier_value(key: str, value: Any, kind: Any) -> Any:
    """One ``<tier>_<suffix>`` key's value, checked, or an error naming the key."""
    if isinstance(value, str) and kind is not Bytes:  # a table from the environment: JSON
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f'field "tenants": tenants.{key}: not a JSON table ({exc})') from None
    try:
        return TypeAdapter(kind).validate_python(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = "".join(f".{p}" for p in err["loc"])
        raise ValueError(f"tenants.{key}{where}: {err['msg']}") from None


class TenantsConfig(_Section):
    """Tenant quotas (kvstore/store/books/tenants.py): a tenant is a namespace's cache_salt. Each tier
    (a row of kvstore/tier_table.py) has a quota for every tenant (``quota_bytes``) and per-salt
    ones over it (``quotas``; a salt given 0 has none); absent or 0: no quota. A tier's own keys
    say the same: ``<tier>_quota_bytes``, ``<tier>_quotas``, ``<tier>_retained_bytes`` (e.g.
    ``ssd_quota_bytes = 1073741824``) set that tier's entry. :meth:`quota` is the one place that
    reads them."""

    quota_bytes: dict[str, Bytes] = Field(
        default_factory=dict, description="per tier: every tenant's share of it in bytes (DRAM: committed block "
        "bytes; SSD: block files' bytes, as ssd.capacity_bytes counts them; Redis, S3: block bytes this sidecar "
        "writes or knows of there); absent or 0: no quota; <tier>_quota_bytes = N sets one tier's"
    )
    quotas: dict[str, dict[str, Bytes]] = Field(
        default_factory=dict, description="per tier, per cache_salt ('' for none): its quota in bytes, over the "
        "tier's quota_bytes (0: none); <tier>_quotas = {salt = N} sets one tier's"
    )
    retained_bytes: dict[str, Bytes] = Field(
        default_factory=dict, description="per tier: every tenant's bound on its retained bytes there (retention "
        "hints, kvstore/store/books/retention.py): a hint past it is refused; absent or 0: no bound; "
        "<tier>_retained_bytes = N sets one tier's"
    )
    retained_fraction: float = Field(
        RETAINED_FRACTION, ge=0, le=1,
        description="all tenants' retained bytes together in a tier of a known capacity (DRAM, SSD): at most this "
        "share of it (a salt is free, so per-tenant bounds alone let many salts retain the whole cache); a hint "
        "past it is shortened to its leading blocks that fit, or refused (kvstore/store/books/hint_budget.py, "
        "docs/eviction.md); 1: no total bound (hints may hold a whole tier)",
    )
    retained_adaptive: bool = Field(
        RETAINED_ADAPTIVE,
        description="scale retained_fraction per node by what its hints were worth (kvstore/store/books/hint_worth.py: "
        "whole while they paid an eighth of what they cost, none at a sixteenth; a retention the client ended is "
        "judged only by a use here); false: the fixed share "
        "(docs/eviction.md, \"Hints the cache can afford\": what each gives, cell by cell)",
    )

    @model_validator(mode="before")
    @classmethod
    def _per_tier_keys(cls, data: Any) -> Any:
        """``<tier>_quota_bytes`` and its siblings into their mappings (the key wins over the
        mapping's entry: an override of it lands on a dumped configuration)."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key in list(out):
            for suffix, field, kind in _PER_TIER_KEYS:
                if key.endswith(suffix) and key.removesuffix(suffix) in NAMES:
                    merged = dict(out.get(field) or {})
                    merged[key.removesuffix(suffix)] = _per_tier_value(key, out.pop(key), kind)
                    out[field] = merged
                    break
        return out

    @field_validator("quota_bytes", "quotas", "retained_bytes")
    @classmethod
    def _known_tiers(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = [t for t in v if t not in NAMES]
        if unknown:
            raise ValueError(f"unknown tier {unknown[0]!r} (known: {', '.join(NAMES)})")
        return v

    def quota(self, tier: str) -> tuple[int, dict[str, int]]:
        """``tier``'s quota for every tenant and its per-salt quotas."""
        if tier not in NAMES:
            raise ConfigError(f"tenants: no quota for tier {tier!r} (known: {', '.join(NAMES)})")
        return self.quota_bytes.get(tier, 0), self.quotas.get(tier, {})

    def retained_bounds(self) -> dict[str, int]:
        """Each tier's bound on a tenant's retained bytes (0: none)."""
        return {tier: self.retained_bytes.get(tier, 0) for tier in NAMES}

    def retained_totals(self, capacities: Mapping[str, int]) -> dict[str, int]:
        """Each tier's bound on all tenants' retained bytes, from its capacity (tier -> bytes; 0:
        not known): ``retained_fraction`` of it; none at a fraction of 1 (the whole tier)."""
        f = self.retained_fraction
        return {tier: int(f * n) for tier, n in capacities.items() if f < 1 and n}


class ClusterConfig(_Section):
    """Many sidecars, one cache (kvstore/cluster/): a directory in Redis says which node holds each
    block; nodes fetch each other's blocks over the peer data path."""

    enabled: bool = False
    directory_url: str = Field(
        "redis://127.0.0.1:6379/0", description="redis:// URL of the directory; with directory_cluster any node of it"
    )
    directory_cluster: bool = Field(False, description="the directory is a Redis Cluster")
    key_prefix: str = Field("kvstore", description="prefix of the directory's keys (one cluster per prefix)")
    node_id: str = Field("", description="this node's name in the cluster, unique; empty: the host name")
    peer_address: str = Field("0.0.0.0:50061", description="HOST:PORT the peer data path listens on (port 0: any)")
    advertise_address: str = Field(
        "", description="HOST:PORT other nodes reach the peer data path at; empty: peer_address's host and bound port"
    )
    peer_encryption: bool = Field(
        True,
        description="encrypt the peer data path (AES-256-GCM over every request, answer head and block frame, keyed "
        "per connection by the hello); a connection is encrypted when either of its two nodes has this on "
        "(docs/security.md)",
    )
    token: str = Field(
        "",
        description="shared secret of the cluster (required; 16 or more random characters): the keys that seal the "
        "directory's records and member entries and prove each side of the peer hello are derived from it; never sent",
    )
    lease_ms: int = Field(
        6000, ge=500, le=60_000, description="a node that stops heartbeating stops being offered after this"
    )
    heartbeat_ms: int = Field(1000, ge=100, description="membership heartbeat interval (< lease_ms / 2)")
    publish_interval_ms: int = Field(5, ge=1, le=1000, description="directory writes are batched over this long")
    publish_records_per_s: int = Field(
        50_000,
        ge=0,
        description="directory records of blocks that only moved (a restart's recovery, a re-publish of everything "
        "after an outage) a node writes a second at most, publish_interval_ms at a time; blocks new on the node "
        "are never held back; 0: no limit",
    )
    fetch_timeout_s: float = Field(
        5.0,
        gt=0,
        description="deadline of one peer fetch (blocks not in by then are misses) and of reading a peer's request",
    )
    send_stall_s: float = Field(
        1.0,
        gt=0,
        description="an answer to a peer's fetch that the fetcher takes no byte of for this long, or too little "
        "over a window this long for the rest to go out by the send's deadline at that rate, is abandoned "
        "(its blocks' lease released, the connection closed): a send thread is not held for the whole deadline",
    )
    directory_timeout_s: float = Field(2.0, gt=0, description="deadline of one directory round trip")
    sweep_keys_per_s: int = Field(
        1000, ge=0, description="directory keys each node reads a second in its walk that deletes void records "
        "(of a past incarnation, a lapsed lease, a node gone); 0: no walk (lookups still delete those they meet)",
    )
    ghost_ttl_s: float = Field(
        3600.0,
        ge=0,
        le=30 * 86400,
        description="the longest the directory remembers the use count of a block a node let go, for the next "
        "node to store it to resume (the credit policy keeps a reused block longer); each count lasts about as "
        "long as in the node's own ghost at its current turnover (kvstore/policy/ghost.py), at most this; "
        "0: not remembered",
    )

    @field_validator("peer_address")
    @classmethod
    def _listen_address(cls, v: str) -> str:
        split_host_port(v, listen=True)
        return v

    @field_validator("advertise_address")
    @classmethod
    def _dial_address(cls, v: str) -> str:
        if v:  # (empty: derived from peer_address at start)
            split_host_port(v)
        return v

    @model_validator(mode="after")
    def _complete(self) -> ClusterConfig:
        if self.enabled and not self.token:
            raise ValueError("token: required when the cluster is enabled (cluster.token)")
        if self.heartbeat_ms * 2 > self.lease_ms:
            raise ValueError(f"heartbeat_ms: {self.heartbeat_ms} must be at most half of lease_ms ({self.lease_ms})")
        return self


class TieringConfig(_Section):
    chain: list[str] = Field(
        default_factory=lambda: list(LOWER),
        description="demotion order below DRAM (the tiers of kvstore/tier_table.py: ssd, redis, s3); tiers that "
        "are not enabled are skipped",
    )
    write_through: list[str] = Field(
        default_factory=list, description="remote tiers (redis, s3) written at commit so other hosts can read at once"
    )
    staging_bytes: int = Field(
        512 * MiB, ge=4096,
        description="most bytes of DRAM evictions staged for demotion at once; an eviction past it is dropped "
                    "(counted in /stats tiers.dram.drops.backlog)",
    )
    recover_batch: int = Field(
        4096, ge=1,
        description="at a restart, blocks of the lower tiers entered into the index between two yields to the "
                    "event loop: the sidecar serves while it recovers (a block not loaded yet is a miss; "
                    "/stats recovery)",
    )

    @field_validator("chain")
    @classmethod
    def _lower_tiers(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in LOWER]
        if unknown:
            raise ValueError(f"unknown tier {unknown[0]!r} (allowed: {', '.join(LOWER)})")
        return v

    @field_validator("write_through")
    @classmethod
    def _remote_tiers(cls, v: list[str]) -> list[str]:
        allowed = [r.name for r in ROWS if r.write_through]
        wrong = [t for t in v if t not in allowed]
        if wrong:
            raise ValueError(f"{wrong[0]!r} may not be written through (allowed: {', '.join(allowed)})")
        return v


class Config(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSTORE_", env_nested_delimiter="__", extra="forbid")

    data_dir: str = Field("./kvstore-data", description="where SSD blocks, the lock file and state live")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    server: ServerConfig = Field(default_factory=ServerConfig)
    dram: DramConfig = Field(default_factory=DramConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    ssd: SsdConfig = Field(default_factory=SsdConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    s3: S3Config = Field(default_factory=S3Config)
    tiering: TieringConfig = Field(default_factory=TieringConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    tenants: TenantsConfig = Field(default_factory=TenantsConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment overrides the file (passed as init kwargs); CLI flags are applied after.
        return env_settings, init_settings

    def tier_enabled(self, name: str) -> bool:
        """Whether the tier ``name`` is on: its section's ``enabled``; a tier with no section of its
        own (a registered one, kvstore/tier_table.py) is on when the chain names it."""
        section = getattr(self, name, None)
        return bool(section.enabled) if section is not None else name in self.tiering.chain

    @property
    def ssd_path(self) -> Path:
        return Path(self.ssd.path) if self.ssd.path else Path(self.data_dir) / "ssd"


def _deep_set(d: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults < file < environment < ``overrides`` (dotted names, e.g. ``server.grpc_address``)."""
    data: dict[str, Any] = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
    try:
        cfg = Config(**data)
        if overrides:
            merged = cfg.model_dump()
            for dotted, value in overrides.items():
                if value is not None:
                    _deep_set(merged, dotted, value)
            cfg = Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
    except SettingsError as exc:  # an environment value that does not parse (bad JSON for a table)
        raise ConfigError(f"invalid configuration: {exc}: {exc.__cause__}") from None
    return cfg


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        allowed = err.get("ctx", {}).get("expected")
        msg = f"{field}: {err['msg']}"
        if allowed:
            msg += f" (allowed: {allowed})"
        lines.append(msg)
    return "invalid configuration: " + "; ".join(lines)


def defaults_toml() -> str:
    """The default configuration as TOML (``kvstore config --print-defaults``)."""
    cfg = Config.model_construct()
    out: list[str] = []
    top = {k: v for k, v in Config().model_dump().items() if not isinstance(v, dict)}
    for k, v in top.items():
        out.append(f"{k} = {_toml_value(v)}")
    for section, values in Config().model_dump().items():
        if isinstance(values, dict):
            out.append(f"\n[{section}]")
            model = getattr(cfg, section, None)
            fields = type(model).model_fields if model is not None else {}
            for k, v in values.items():
                desc = fields[k].description if k in fields else None
                if desc:
                    out.append(f"# {desc}")
                out.append(f"{k} = {_toml_value(v)}")
    return "\n".join(out) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
