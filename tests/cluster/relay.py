"""A party on the path between two nodes: a real TCP relay on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from tests.cluster.listening import LoopbackServer


@dataclass
class Relay(LoopbackServer):
    """Forwards every byte both ways to ``target`` (a port on 127.0.0.1, set once known) and records
    what the fetcher sent and what came back. ``flip_back``: the offset (in all the bytes that came
    back) of one byte it flips on the way, as a party that changes what it relays would (None: none).
    ``drop_back``: the offsets (in all the bytes that came back) it does not pass on, as a party
    that drops a frame would (recorded all the same). ``flip_sent``: as ``flip_back``, in what the
    fetcher sends."""

    target: int = 0
    sent: bytearray = field(default_factory=bytearray)  # fetcher -> holder
    back: bytearray = field(default_factory=bytearray)  # holder -> fetcher
    upstreams: list[asyncio.StreamWriter] = field(default_factory=list)  # to the holder: to inject bytes on
    flip_back: int | None = None
    drop_back: range = range(0)
    flip_sent: int | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        self.upstreams.append(up_w)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, log: bytearray, flip: bool) -> None:
            with contextlib.suppress(ConnectionError):
                while chunk := await r.read(65536):
                    at = len(log)
                    log += chunk
                    where = self.flip_back if flip else self.flip_sent
                    if where is not None and at <= where < at + len(chunk):
                        changed = bytearray(chunk)
                        changed[where - at] ^= 0x01
                        chunk = bytes(changed)
                    if flip and self.drop_back:
                        lo, hi = self.drop_back.start - at, self.drop_back.stop - at
                        chunk = chunk[: max(0, lo)] + chunk[max(0, hi) :] if lo < len(chunk) and hi > 0 else chunk
                    w.write(chunk)
                    await w.drain()
            w.close()

        await asyncio.gather(pipe(reader, up_w, self.sent, False), pipe(up_r, writer, self.back, True))
