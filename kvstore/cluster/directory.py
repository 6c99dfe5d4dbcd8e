"""The cluster directory: which node holds which block, and who is alive, in Redis or Redis Cluster.

Layout (every key starts with ``{key_prefix}:``):

- ``d:`` + namespace root (16 bytes) + block key (32 bytes), binary: a hash, one field per node that
  holds the block (the node id), valued with a sealed :class:`Record` (the node's incarnation,
  where the block lies on it, its size and checksum): a version byte, the 25 bytes of the record
  and a 16-byte MAC over them, the key and the node id with a key derived from the cluster token
  (:class:`~kvstore.cluster.cluster_key.ClusterKey`), 42 bytes in all. (The release before wrote a
  retained block's record with 9 bytes more, its retention's end and priority, 51 in all: read
  still, the trailing field ignored; no node writes it any more, and none ever adopted it: a
  fetcher takes a retention from the holder's answer.) A value that does not
  check out (written by someone without the token, moved from another key or node, or of an older
  version) is not read: counted in :attr:`Directory.rejected_records`, a miss. A node writes and
  deletes only its own fields; Redis drops the key with its last field. Keys spread over a Redis
  Cluster's slots by block, so a prompt's lookup is one pipeline that the cluster client sends to
  every shard at once.
- ``g:`` + namespace root (16 bytes) + block key (32 bytes), binary, spread over the slots as the
  ``d:`` keys: the cluster's ghost of a block, its use count as ASCII digits. A node that lets a
  block go writes the count its eviction policies have of it (:meth:`~kvstore.policy.base.EvictionPolicy.uses`)
  when it is :data:`~kvstore.policy.ghost.GHOST_MIN_USES` or more, for about as long as the node's own ghost would keep
  it (:class:`~kvstore.policy.ghost.GhostSpan`, at most ``cluster.ghost_ttl_s``; ``SET ... PX``); the next
  node to hold the block anew (it committed it, or fetched it from a peer) reads and deletes it
  (:data:`TAKE` on one Redis, any version; ``GETDEL`` on a Redis Cluster, 6.2 or later) and its
  policies resume the count (:meth:`~kvstore.policy.base.EvictionPolicy.resume`): a block
  evicted on one node and stored again on another is kept as long as on the first, as credit's
  own ghost list does on one node.
  Both ride in the pipeline of the records (:meth:`Directory.publish`: a command per key on a
  Redis Cluster, one script call each on one Redis); a re-publish of a block the node held
  already (a move between its tiers, everything after an outage) reads none.
- ``members``: a hash, node id -> ``2.mac@address|incarnation|expiry_ms``, the MAC (32 hex digits)
  over the prefix, the node id, the address, the incarnation and the expiry with the token's key:
  an entry without a good one (forged, or put together from parts of others) is left out of the
  members (counted in :attr:`Directory.rejected_members`), so a node never connects to an address,
  nor expects there an incarnation, that nobody holding the token wrote together. The expiry in the
  directory server's own clock (``TIME``), as the node estimates it, checked by each node's
  heartbeat (:data:`HEARTBEAT`, a script: one round trip writes this node's lease and reads
  everyone's, with the server's time, so no two hosts' clocks are compared; two when the node's
  estimate or its incarnation was off).

A record is offered only while its node's lease runs and its incarnation is the node's current one:
a node that restarts is a new incarnation, and every record of its past life is void at once.
Stale fields cost a miss (and are deleted by whoever meets them, and by each node's bounded walk
over the keys, :meth:`Directory.scan_keys` and :mod:`kvstore.cluster.sweep`), never a wrong block: the
fetch checks the bytes against the record's checksum. A key of another type is that key's error (a
miss, a refused record: :class:`Published`), never the directory's; a ``members`` entry this
version cannot read is skipped (:func:`parse_member`) and deleted after a lease; a ``members`` key
of another type is deleted by the next heartbeat, which writes the hash anew (:data:`HEARTBEAT`). A
``d:`` key piled with more fields than any block has holders is not read by a lookup (a miss:
:class:`Oversized`, :data:`FIELDS_MAX`); the sweep deletes its fields that do not check out
(:data:`CROWDED`).

A lease that ran out ends that incarnation too, though its process lives on (paused, cut off from
the directory, its heartbeat late): another node may have deleted its records meanwhile, as void.
So the heartbeat that renews a lapsed lease gives the node a new incarnation (:data:`HEARTBEAT`,
decided in the server's clock, atomically with the renewal), and the node publishes everything it
holds again under it. A deletion is a compare-and-delete (:data:`FORGET`): it removes only the
record that was read, never one written since (a new incarnation's).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import RedisError, ResponseError

from kvstore.cluster.cluster_key import MEMBER_VERSION, ClusterKey, frame
from kvstore.config import ClusterConfig
from kvstore.errors import Unavailable
from kvstore.policy.ghost import GHOST_MIN_USES
from kvstore.store.remote import MAX_HOLDERS
from kvstore.wire.resp_pipe import PipelinedLink, ReplyError, tcp_settings

_RECORD = struct.Struct("<QBQQ")  # incarnation, placement bits, size, checksum (0: not sealed)
# An optional trailing field that the release before wrote on a retained block's record: its
# retention's end in ms since the epoch (the holder's wall clock) and its priority. Parsed, so that
# a node of that release's records are read during a rolling update, and never used: no node
# writes it (the publisher's records have none) or adopts it (a directory writer can put back one
# its holder has ended since); a fetcher takes the retention from the holder's answer
# (kvstore/wire/peer.py).
_RETAIN = struct.Struct("<QB")
ROOT_BYTES = 16  # of the namespace root in a directory key: 2^128 namespaces is plenty
MEMBER_MARK = MEMBER_VERSION.encode()  # how a member entry of this version begins

# KEYS[1] the members hash; ARGV: node id, its sealed entry, the incarnation and expiry (ms) it
# seals, lease ms, forget-after ms, '1' to read the entry there ('0': the node found it is not one
# it sealed, a directory writer's, and it is passed over as if absent). Returns the server's time
# (ms), every member's entry, 1 when this node's entry was not there (a new member, or a directory
# that lost its data), the incarnation decided, and whether the entry was written. The incarnation
# decided is the one given, or the next one when this node's entry is of this life and its lease
# had run out (in the server's clock: anyone who read the members since may have deleted that
# life's records as void).
# "This life": the entry's incarnation is the one given, or one up to 1000 above it, which this
# script gave the node in a reply the node never read (a heartbeat that timed out at the node
# after it ran here): the node takes that one up at its next heartbeat. (A later start of a node
# with this id is at least seconds, thousands of ms, later.) The script cannot check a seal, so a
# directory writer could put an entry there that moves the node's incarnation (up to 999 a beat:
# a walk to any value, e.g. to a past life's); the node checks the entry behind an incarnation it
# did not ask for and, where it did not seal it, asks again passing it over
# (:meth:`Directory.heartbeat`). The node seals its whole entry
# (kvstore/cluster/cluster_key.py), so the script cannot write another incarnation or expiry into
# it: it writes the entry only when its incarnation is the one decided and its expiry (the node's
# estimate of the server's clock, plus a lease) is set and no more than two leases ahead; otherwise
# it writes nothing and the node seals the entry again from this reply (:meth:`Directory.heartbeat`).
# Drops entries long expired.
# A members key of another type (a directory writer's) is deleted first, so the hash is written
# anew and every node joins it again; its type is returned last ('' when it was a hash or none).
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', KEYS[1]) else kind = '' end
local created = 0
local written = 0
local incarnation = tonumber(ARGV[3])
local lease = tonumber(ARGV[5])
if ARGV[1] ~= '' then
  local entry = redis.call('HGET', KEYS[1], ARGV[1])
  if entry and ARGV[7] == '1' then
    local inc, expiry = string.match(entry, '|(%d+)|(%d+)$')
    inc, expiry = tonumber(inc), tonumber(expiry)
    if inc ~= nil and inc >= incarnation and inc < incarnation + 1000 then
      incarnation = inc
      if expiry < now then incarnation = inc + 1 end
    end
  end
  local expiry = tonumber(ARGV[4])
  if incarnation == tonumber(ARGV[3]) and expiry > 0 and expiry <= now + 2 * lease then
    created = redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    written = 1
  end
end
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  local expiry = tonumber(string.match(all[i + 1], '|(%d+)$'))
  if expiry ~= nil and expiry + tonumber(ARGV[6]) < now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return {now, out, created, string.format('%.0f', incarnation), kind, written}
"""
# KEYS[1] a block's directory key; ARGV: node id, the record read. Deletes that node's field only
# while it still holds that record: a record written since (a new incarnation's) stays.
FORGET = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""
# KEYS: the blocks' directory keys; ARGV[1]: the most fields a key is read with (FIELDS_MAX).
# Returns each one's HGETALL (a flat field, value list), false for a key it cannot read (of another
# type: that key's error, a miss; the others are read), its field count for a key with more fields
# than that (a directory writer's forgeries: not read, a miss, left to the sweep). A prompt's
# lookup on one Redis is this one command: one reply to parse instead of a pipeline's one per key,
# which in redis-py costs about as much as the round trip itself. (On a Redis Cluster: one call per
# key, in one pipeline.)
FIND = """
local out = {}
local most = tonumber(ARGV[1])
for i = 1, #KEYS do
  local n = redis.pcall('HLEN', KEYS[i])
  if type(n) ~= 'number' then out[i] = false
  elseif n > most then out[i] = n
  else out[i] = redis.call('HGETALL', KEYS[i]) end
end
return out
"""
# KEYS: ghost keys. Each one's count (false where there is none), deleted: the ghosts of blocks new
# on this node. On one Redis the ghosts of a publish are one call of this and one of LEAVE: a
# command per key costs redis-py about as much client time again as the records themselves. A key
# it cannot read (of another type) is that key's error, left alone: with redis.call the script
# stopped there, having deleted the ghosts before it unread and not reaching those after it.
TAKE = """
local out = {}
for i = 1, #KEYS do
  local v = redis.pcall('GET', KEYS[i])
  if type(v) == 'string' then redis.call('DEL', KEYS[i]) end
  out[i] = v
end
return out
"""
# KEYS: ghost keys; ARGV: the time to live (ms), how many of the keys (the first ones) are set over
# what is there, then each key's count. The keys after those are set only where no count is (NX:
# blocks this node let go before it read their ghosts). Returns how many were set.
LEAVE = """
local over = tonumber(ARGV[2])
local set = 0
for i = 1, #KEYS do
  if i <= over then
    redis.call('SET', KEYS[i], ARGV[i + 2], 'PX', ARGV[1])
    set = set + 1
  elseif redis.call('SET', KEYS[i], ARGV[i + 2], 'PX', ARGV[1], 'NX') then
    set = set + 1
  end
end
return set
"""
FORGET_AFTER_MS = 3_600_000  # a member silent this long leaves the members hash
# A d: key holds one field per node that holds its block: a key with more fields than any run goes
# through (MAX_HOLDERS) holds a directory writer's forgeries, and the sweep deletes its fields that do
# not check out (only there: a node given another token, or of an older version, writes one field
# per key, which is left alone, as it was). A lookup reads no key with far more (a miss, counted:
# Oversized) and leaves it to the sweep.
CROWDED = MAX_HOLDERS
FIELDS_MAX = 4 * MAX_HOLDERS
SWEEP_FIELDS = 256  # fields the sweep asks for in one HSCAN of a key (its COUNT)
ScanCursor = tuple[int, int]  # a walk over the d: keys (Directory.scan_keys): which primary, its SCAN cursor
SCAN_START: ScanCursor = (0, 0)


class Record(NamedTuple):
    """What the directory says of one node's copy of a block (a tuple: a lookup unpacks one per
    holder of every key, and a tuple is made several times faster than a frozen dataclass)."""

    incarnation: int  # the holder's start, in ms since the epoch: a later life has a larger one
    tiers: int  # placement bits on that node (kvstore.store.books.index: DRAM | SSD | REDIS | S3)
    size: int
    checksum: int  # 0 while the holder has not sealed it
    retain_until_ms: int = 0  # the release before's trailing field (0: none): read by no node
    retain_priority: int = 0

    def pack(self) -> bytes:
        base = _RECORD.pack(*self[:4])
        return base + _RETAIN.pack(*self[4:]) if self.retain_until_ms else base

    @staticmethod
    def unpack(raw: bytes) -> Record | None:
        if len(raw) == _RECORD.size:
            return Record(*_RECORD.unpack(raw))
        if len(raw) == _RECORD.size + _RETAIN.size:
            return Record._make(_RECORD.unpack_from(raw) + _RETAIN.unpack_from(raw, _RECORD.size))
        return None  # another version's record: not ours to read


@dataclass(slots=True, frozen=True)
class Member:
    node: str
    address: str  # HOST:PORT of its peer data path
    incarnation: int
    expiry_ms: int  # in the directory server's clock


class Ghosts(NamedTuple):
    """What a publish did with the cluster's ghosts (the ``g:`` keys)."""

    written: int  # use counts remembered for the removes
    found: dict[int, int]  # index into the puts -> the use count remembered of it (read and deleted)
    error: str = ""  # a ghost command the directory refused (a g: key of another type; GETDEL on a Redis
    # Cluster before 6.2): the records landed


class Oversized(NamedTuple):
    """A ``d:`` key a lookup did not read: it holds more than :data:`FIELDS_MAX` fields."""

    fields: int


class Piece(NamedTuple):
    """A piece of a ``d:`` key the sweep read (:meth:`Directory.read_fields`)."""

    key: bytes
    cursor: int  # where its HSCAN goes on; 0: the key has been read through
    size: int  # the key's field count (HLEN) when the piece was read
    fields: int  # how many fields this piece had
    holders: dict[str, Record]  # node -> record, of the fields that check out
    forged: list[tuple[bytes, bytes]]  # field, value of those whose MAC fails


class Published(NamedTuple):
    """What a publish did: the ghosts, and the records the directory refused (their keys of
    another type): index into the puts (or the removes) -> the error. The others landed."""

    ghosts: Ghosts
    refused_puts: dict[int, str]
    refused_removes: dict[int, str]


class Beat(NamedTuple):
    """A heartbeat's answer."""

    now_ms: int  # the directory server's time
    members: dict[str, Member]
    unreadable: dict[bytes, bytes]  # the members entries this version cannot read (see Members)
    created: bool  # this node's entry was not there (a new member, or a directory that lost its data)
    incarnation: int  # this node's incarnation now: a later one when its lease had run out
    wrong_type: str = ""  # the type the members key was of, not a hash (deleted, written anew); "" when it was
    written: bool = True  # this node's entry was written (not: sealed with another incarnation or expiry)
    older: int = 0  # entries of an older version (``address|incarnation|expiry_ms`` without the version mark)


class Members(NamedTuple):
    """The ``members`` hash as read: the entries this version reads, and the rest."""

    members: dict[str, Member]
    unreadable: dict[bytes, bytes]  # field -> value of the entries it cannot read (not UTF-8, not
    # ``address|incarnation|expiry_ms``): skipped, and deleted once they outlast a lease (Membership)


def parse_member(field: bytes, value: bytes) -> Member | None:
    """One ``members`` entry, or None where it is none this version reads (a field or value that is
    not UTF-8, a value not ``address|incarnation|expiry_ms`` in decimal digits)."""
    try:
        node, text = field.decode(), value.decode()
    except UnicodeDecodeError:
        return None
    address, _, rest = text.rpartition("|")  # (rsplit without a list: 200 k entries a beat cost)
    address, _, incarnation = address.rpartition("|")
    if not (_digits(incarnation) and _digits(rest)) or not address:
        return None
    return Member(node, address, int(incarnation), int(rest))


def _digits(s: str) -> bool:
    return 0 < len(s) <= 20 and s.isascii() and s.isdigit()  # (str.isdigit alone: '²', which int() refuses)


def parse_members(
    entries: Sequence[Any], opened: Callable[[Member], Member | None] = lambda m: m
) -> Members:
    """The members hash from a flat field, value list (the :data:`HEARTBEAT` script's reply).
    ``opened``: the entry as it checks out (its sealed address opened), None where it does not:
    such an entry is unreadable too."""
    out: dict[str, Member] = {}
    unreadable: dict[bytes, bytes] = {}
    for i in range(0, len(entries) - 1, 2):
        field, value = _raw(entries[i]), _raw(entries[i + 1])
        m = parse_member(field, value)
        if m is not None:
            m = opened(m)
        if m is None:
            unreadable[field] = value
        else:
            out[m.node] = m
    return Members(out, unreadable)


def _refusal(reply: Exception | None) -> str:
    """A pipeline's per-command error: the key's own (``WRONGTYPE``: what it says), or the
    directory's (a lost connection, a read-only replica, out of memory, a cluster that is down):
    raised as :class:`~kvstore.errors.Unavailable`. None: the :data:`FIND` script's refused key."""
    if reply is None:
        return "WRONGTYPE: a key of another type"
    if type(reply) is ResponseError and "WRONGTYPE" in str(reply):
        return f"{type(reply).__name__}: {reply}"
    raise Unavailable(f"cluster directory: {type(reply).__name__}: {reply}")


def _raw(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def _node_name(field: Any) -> str | None:
    """The node id a record's field names; None when it is not text (no node writes it)."""
    try:
        return _text(field)
    except UnicodeDecodeError:
        return None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Directory:
    """The directory's Redis calls; every one is a single round trip (a pipeline or a script).
    A Redis that cannot be reached raises :class:`~kvstore.errors.Unavailable`."""

    def __init__(
        self, client: Redis | RedisCluster, prefix: str, node: str, ghost_ttl_ms: int = 0, *, token: str = ""
    ) -> None:
        """``token``: the cluster token, whose key seals and checks every record and member entry
        (every node of a cluster gives the same; the sidecar's is never empty, see ClusterConfig)."""
        self.client = client
        self.prefix = prefix.encode()
        self.node = node
        self.sealer = ClusterKey(token)
        self.rejected_records = 0  # record values met that did not check out (forged, moved, older versions)
        self.rejected_members = 0  # member entries read that did not check out, summed over heartbeats
        self.ghost_ttl_ms = ghost_ttl_ms  # how long a ghost (``g:`` key) lives; 0: none written or read
        self.members_key = prefix + ":members"
        self._clustered = isinstance(client, RedisCluster)
        self._heartbeat = client.register_script(HEARTBEAT)
        # a Redis Cluster spreads the keys over slots one script cannot span: a pipeline there.
        # On one Redis the lookup is the FIND script on a lean pipelined connection where one can
        # connect as redis-py does (kvstore.wire.resp_pipe: about half redis-py's time a call).
        self._find = None if isinstance(client, RedisCluster) else client.register_script(FIND)
        self._link: PipelinedLink | None = None
        if not isinstance(client, RedisCluster) and (settings := tcp_settings(client)) is not None:
            kw = client.connection_pool.connection_kwargs
            self._link = PipelinedLink(kw.get("host", "localhost"), int(kw.get("port", 6379)), **settings)

    @classmethod
    def from_config(cls, cfg: ClusterConfig, node: str) -> Directory:
        timeout = cfg.directory_timeout_s
        options: dict[str, Any] = {
            "socket_timeout": timeout, "socket_connect_timeout": timeout, "decode_responses": False,
        }
        client: Redis | RedisCluster
        if cfg.directory_cluster:
            client = RedisCluster.from_url(cfg.directory_url, **options)
        else:
            client = Redis.from_url(cfg.directory_url, retry_on_timeout=False, **options)
        ghost_ttl_ms = max(1, round(cfg.ghost_ttl_s * 1000)) if cfg.ghost_ttl_s else 0
        return cls(client, cfg.key_prefix, node, ghost_ttl_ms, token=cfg.token)

    def key(self, root: bytes, key: bytes) -> bytes:
        return self.prefix + b":d:" + root[:ROOT_BYTES] + key

    def value(self, root: bytes, key: bytes, node: str, rec: Record) -> bytes:
        """``node``'s record of the block (``root``, ``key``) as the directory holds it: sealed."""
        return self.sealer.seal_record(rec.pack(), self.key(root, key), node.encode())

    def _member_opened(self, m: Member) -> Member | None:
        """``m`` with its address opened, or None (counted) where its seal does not check out."""
        address = self.sealer.open_member(self.prefix.decode(), m.node, m.address, m.incarnation, m.expiry_ms)
        if address is None:
            self.rejected_members += 1
            return None
        return Member(m.node, address, m.incarnation, m.expiry_ms)

    def ghost_key(self, root: bytes, key: bytes) -> bytes:
        return self.prefix + b":g:" + root[:ROOT_BYTES] + key

    async def _pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        if not commands:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            return list(await pipe.execute(raise_on_error=False))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"cluster directory: {type(exc).__name__}: {exc}") from exc

    async def heartbeat(self, address: str, incarnation: int, lease_ms: int, expiry_ms: int = 0) -> Beat:
        """Renew this node's lease (see :data:`HEARTBEAT`) until ``expiry_ms``, the node's estimate
        of the server's clock plus ``lease_ms`` (0: none yet). The entry is sealed whole, so where
        the script decides another incarnation, or the estimate is off, it writes nothing and a
        second call writes the entry sealed from its reply."""
        reply = await self._beat(address, incarnation, lease_ms, expiry_ms)
        forged = False
        if not reply[5]:  # (not written: sealed again with the incarnation decided and the server's time)
            decided, expiry_ms = int(reply[3]), int(reply[0]) + lease_ms
            # Another incarnation comes from the entry under this node's name: one this node sealed
            # (a reply it never read, or its own lease run out), or a directory writer's, passed over.
            forged = decided != incarnation and not self._sealed_here(reply[1])
            reply = await self._beat(address, incarnation if forged else decided, lease_ms, expiry_ms, not forged)
        now, entries, created, decided, kind, written = reply
        # (an entry of this node's not its own is as good as gone: whoever read it may have taken
        # this node's records for void, so the node publishes them again, as after a lost entry)
        created = created or forged
        members, unreadable = parse_members(entries, self._member_opened)
        older = sum(1 for f, v in unreadable.items() if not v.startswith(MEMBER_MARK) and parse_member(f, v))
        return Beat(int(now), members, unreadable, bool(created), int(decided), _text(kind), bool(written), older)

    async def _beat(
        self, address: str, incarnation: int, lease_ms: int, expiry_ms: int, read_entry: bool = True
    ) -> list[Any]:
        sealed = self.sealer.seal_member(self.prefix.decode(), self.node, address, incarnation, expiry_ms)
        args: list[str | int] = [self.node, sealed, incarnation, expiry_ms, lease_ms, FORGET_AFTER_MS, int(read_entry)]
        try:
            return list(await self._heartbeat(keys=[self.members_key], args=args))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"cluster directory: {type(exc).__name__}: {exc}") from exc

    def _sealed_here(self, entries: Sequence[Any]) -> bool:
        """Whether this node's entry among ``entries`` (a flat field, value list) is one it sealed."""
        me = self.node.encode()
        for i in range(0, len(entries) - 1, 2):
            if _raw(entries[i]) == me:
                m = parse_member(me, _raw(entries[i + 1]))
                prefix = self.prefix.decode()
                return m is not None and (
                    self.sealer.open_member(prefix, m.node, m.address, m.incarnation, m.expiry_ms) is not None
                )
        return False

    async def leave(self) -> None:
        """Take this node out of the members now (a clean stop); its records die with it."""
        try:
            await self.client.hdel(self.members_key, self.node)
        except (RedisError, OSError) as exc:
            raise Unavailable(f"cluster directory: {type(exc).__name__}: {exc}") from exc

    async def forget_members(self, entries: Sequence[tuple[bytes, bytes]]) -> int:
        """Delete ``members`` entries (field, value), each only while it still holds that value
        (:data:`FORGET`: an entry rewritten since stays). How many went."""
        return await self.forget_fields([(self.members_key.encode(), f, v) for f, v in entries])

    async def forget_fields(self, entries: Sequence[tuple[bytes, bytes, bytes]]) -> int:
        """Delete hash fields (key, field, value), each only while it still holds that value
        (:data:`FORGET`). How many went."""
        replies = await self._pipeline([("EVAL", FORGET, 1, k, f, v) for k, f, v in entries])
        return sum(r == 1 for r in replies)

    async def publish(
        self,
        puts: Sequence[tuple[bytes, bytes, Record]],
        removes: Sequence[tuple[bytes, bytes]],
        *,
        fresh: Sequence[bool] = (),
        uses: Sequence[int] = (),
        unread: Sequence[bool] = (),
        ttl_ms: int | None = None,
    ) -> Published:
        """This node holds ``puts`` (root, key, record) and no longer holds ``removes`` (root, key).

        With ghosts on (``ghost_ttl_ms``), in the same pipeline: the ghosts of the puts that
        ``fresh`` marks (aligned with ``puts``: new on this node, not a re-publish) are read and
        deleted, and the removes' use counts (``uses``, aligned with ``removes``) of
        :data:`GHOST_MIN_USES` or more are remembered, for ``ttl_ms`` (default, and at most:
        ``ghost_ttl_ms``; 0: none written). The removes that ``unread`` marks (aligned with
        ``removes``: stored and let go again before a publish read their ghosts) are remembered
        only where no count is (``SET NX``): a count another node left, which this node never saw,
        is not overwritten by this node's own. A ghost command the directory refuses fails no
        record: it is told in :attr:`Ghosts.error`."""
        node = self.node.encode()
        cmds: list[tuple[Any, ...]] = [("HSET", self.key(r, k), node, self.value(r, k, self.node, rec))
                                       for r, k, rec in puts]
        cmds += [("HDEL", self.key(r, k), node) for r, k in removes]
        records = len(cmds)
        read: list[int] = []
        written: list[tuple[bytes, int, bool]] = []  # key, count, only where none is
        if self.ghost_ttl_ms:
            read = [i for i, new in enumerate(fresh) if new]
            taken = [self.ghost_key(puts[i][0], puts[i][1]) for i in read]
            ttl = self.ghost_ttl_ms if ttl_ms is None else min(ttl_ms, self.ghost_ttl_ms)
            if ttl > 0:  # (0: this pass keeps no count, as a node whose policies keep no ghost)
                written = [
                    (self.ghost_key(r, k), n, j < len(unread) and unread[j])
                    for j, ((r, k), n) in enumerate(zip(removes, uses))
                    if n >= GHOST_MIN_USES
                ]
                written.sort(key=lambda w: w[2])  # (LEAVE: those set over what is there first)
            cmds += self._ghost_commands(taken, written, ttl)
        replies = await self._pipeline(cmds)
        refused = {i: _refusal(r) for i, r in enumerate(replies[:records]) if isinstance(r, Exception)}
        ghosts = self._ghosts(read, len(written), replies[records:]) if read or written else Ghosts(0, {})
        n = len(puts)
        return Published(ghosts, {i: e for i, e in refused.items() if i < n},
                         {i - n: e for i, e in refused.items() if i >= n})

    def _ghost_commands(
        self, taken: list[bytes], written: list[tuple[bytes, int, bool]], ttl: int
    ) -> list[tuple[Any, ...]]:
        """The commands that read and delete the ghosts ``taken`` and set ``written`` (key, count,
        only where none is; those last): a command per key on a Redis Cluster (the keys lie on many
        slots), one :data:`TAKE` and one :data:`LEAVE` on one Redis; ``ttl`` in ms."""
        if self._clustered:
            sets = [("SET", k, n, "PX", ttl, *(("NX",) if nx else ())) for k, n, nx in written]
            return [*(("GETDEL", k) for k in taken), *sets]
        cmds: list[tuple[Any, ...]] = []
        if taken:
            cmds.append(("EVAL", TAKE, len(taken), *taken))
        if written:
            over = sum(not nx for _, _, nx in written)
            cmds.append(("EVAL", LEAVE, len(written), *(w[0] for w in written), ttl, over, *(w[1] for w in written)))
        return cmds

    def _ghosts(self, read: list[int], written: int, replies: list[Any]) -> Ghosts:
        """What :meth:`_ghost_commands`' ``replies`` say (``read``: the puts whose ghosts were
        taken, ``written``: how many were set)."""
        if self._clustered:
            got, sets = replies[: len(read)], replies[len(read) :]
            written = sum(bool(r) and not isinstance(r, Exception) for r in sets)  # (NX: None where not set)
        else:
            got = replies[0] if read and isinstance(replies[0], list) else []
            if written:
                written = replies[-1] if isinstance(replies[-1], int) else 0
        found = {i: int(raw) for i, raw in zip(read, got)  # (a count, not any run of digits someone wrote:
                 if isinstance(raw, bytes) and 0 < len(raw) <= 9 and raw.isdigit()}  # int() refuses 4,300+)
        refused = next((r for r in (*replies, *got) if isinstance(r, Exception)), None)  # (TAKE's: per key)
        return Ghosts(written, found, f"{type(refused).__name__}: {refused}" if refused is not None else "")

    async def find(self, root: bytes, keys: Sequence[bytes]) -> list[dict[str, Record] | Oversized | None]:
        """Every node's record of each key (empty where none; None where the directory refuses
        the key, of another type: that key's error, not the directory's; :class:`Oversized`
        where it holds more than :data:`FIELDS_MAX` fields, not read): one script call on a
        Redis, one pipeline of a call per key (to every shard at once) on a Redis Cluster."""
        names = [self.key(root, k) for k in keys]
        if self._find is None:
            calls = await self._pipeline([("EVAL", FIND, 1, k, FIELDS_MAX) for k in names])
            replies: list[Any] = [r[0] if isinstance(r, list) and r else r for r in calls]
        else:
            try:
                replies = await (self._link.script(FIND, names, [FIELDS_MAX]) if self._link
                                 else self._find(keys=names, args=[FIELDS_MAX]))
            except (RedisError, OSError, ReplyError) as exc:
                raise Unavailable(f"cluster directory: {type(exc).__name__}: {exc}") from exc
        out: list[dict[str, Record] | Oversized | None] = []
        for name, reply in zip(names, replies):
            if reply is None or isinstance(reply, Exception):
                _refusal(reply)  # (raises where the directory, not the key, failed)
                out.append(None)
            elif isinstance(reply, int):
                out.append(Oversized(reply))
            else:
                out.append(self._read(name, reply)[0])
        return out

    def _read(self, name: bytes, reply: Any) -> tuple[dict[str, Record], list[tuple[bytes, bytes]]]:
        """The fields ``reply`` of the ``d:`` key ``name`` (a dict, or a flat field, value list):
        node -> record, and the fields (field, value) whose MAC fails. A record that does not
        check out (forged, moved, of an older version: counted) or a field that is not UTF-8 is
        none this version wrote: skipped (a miss). (One whose MAC holds but that this version
        cannot unpack, a later version's, is not forged.)"""
        items = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2])
        holders: dict[str, Record] = {}
        forged: list[tuple[bytes, bytes]] = []
        where = frame(name)
        for field, raw in items:
            node = field if isinstance(field, bytes) else str(field).encode()
            fields = self.sealer.open_framed(raw, where + frame(node)) if isinstance(raw, bytes) else None
            rec = Record.unpack(fields) if fields is not None else None
            if rec is None:
                self.rejected_records += 1
                if fields is None:
                    forged.append((node, _raw(raw)))
                continue
            holder = _node_name(field)
            if holder is not None:
                holders[holder] = rec
        return holders, forged

    async def forget(self, stale: Sequence[tuple[bytes, bytes, str, Record]]) -> None:
        """Delete records (root, key, node, record) found void (a past incarnation's), each only
        while the directory still holds that record (:data:`FORGET`)."""
        await self.forget_keys([(self.key(r, k), n, rec) for r, k, n, rec in stale])

    async def forget_keys(self, stale: Sequence[tuple[bytes, str, Record]]) -> int:
        """:meth:`forget` by directory key (key, node, record); how many went. (The record is
        compared as the directory holds it: sealed, as :meth:`value` seals it.)"""
        seal = self.sealer.seal_record
        cmds = [("EVAL", FORGET, 1, k, n.encode(), seal(rec.pack(), k, n.encode())) for k, n, rec in stale]
        replies = await self._pipeline(cmds)
        return sum(r == 1 for r in replies)

    async def scan_keys(self, cursor: ScanCursor, count: int) -> tuple[ScanCursor, list[bytes]]:
        """A step of a walk over every ``d:`` key: about ``count`` keys from ``cursor`` (the walk
        begins and ends at :data:`SCAN_START`), one SCAN. On a Redis Cluster the walk goes
        through each primary in turn."""
        node_index, at = cursor
        pattern = self.prefix + b":d:*"
        try:
            if self._clustered:
                assert isinstance(self.client, RedisCluster)
                primaries = sorted(self.client.get_primaries(), key=lambda n: n.name)
                if node_index >= len(primaries):
                    return SCAN_START, []
                nxt, keys = await self.client.execute_command(
                    "SCAN", at, "MATCH", pattern, "COUNT", count, target_nodes=primaries[node_index])
                nxt = next(iter(nxt.values())) if isinstance(nxt, dict) else nxt  # (per node: the one asked)
                after = (node_index, int(nxt)) if int(nxt) else (node_index + 1, 0)
                after = SCAN_START if after[0] >= len(primaries) else after
            else:
                nxt, keys = await self.client.scan(at, match=pattern, count=count)
                after = (0, int(nxt))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"cluster directory: {type(exc).__name__}: {exc}") from exc
        return after, list(keys)

    async def read_fields(self, keys: Sequence[tuple[bytes, int]], count: int = SWEEP_FIELDS) -> list[Piece]:
        """The next piece of each ``d:`` key (key, HSCAN cursor: 0 to begin), about ``count``
        fields each (a small hash whole), and its field count, in one pipeline. A key of another
        type is skipped (that key's error; the directory down: raised)."""
        cmds = [c for k, at in keys for c in (("HLEN", k), ("HSCAN", k, at, "COUNT", count))]
        replies = await self._pipeline(cmds)
        out: list[Piece] = []
        for (key, _), size, reply in zip(keys, replies[::2], replies[1::2]):
            if isinstance(reply, Exception) or reply is None:
                _refusal(reply)
                continue
            nxt, fields = reply
            holders, forged = self._read(key, fields)
            out.append(Piece(key, int(nxt), size if isinstance(size, int) else 0, len(fields), holders, forged))
        return out

    async def close(self) -> None:
        if self._link is not None:
            self._link.close()
        await self.client.aclose()
