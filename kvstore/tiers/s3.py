"""S3 tier (AWS, MinIO, moto) through aioboto3.

One object per block at ``<prefix>/<ns hex 16>/<key hex 64>``; the object is
``encode_header(meta) + payload`` so :meth:`S3Tier.scan` rebuilds the index from ranged GETs of the
first bytes. Up to ``concurrency`` requests are in flight (one semaphore for the tier); blocks
above ``multipart_threshold_bytes`` go up as a multipart upload whose parts run concurrently.
The bucket is created on first use when missing. Connection failures and 5xx answers raise
:class:`~kvstore.errors.Unavailable` (botocore's own retries run first).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aioboto3
import aiohttp
from aiobotocore.config import AioConfig
from botocore import exceptions as bexc

from kvstore.config import S3Config
from kvstore.errors import ChecksumMismatch, InvalidArgument, Unavailable
from kvstore.tiers.base import (
    HEADER_FIXED,
    BlockMeta,
    BlockRef,
    TierBase,
    decode_header,
    encode_header,
    header_size,
)

_MISSING = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_RETRYABLE = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500"}
_CREATES = {"put_object", "create_multipart_upload"}  # writes that recreate a vanished bucket
_HEADER_PROBE = 4096  # bytes fetched by scan's ranged GET (covers any header with a short label)


def _code(exc: bexc.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _unavailable(exc: BaseException) -> bool:
    if isinstance(
        exc, (bexc.ConnectionError, bexc.HTTPClientError, aiohttp.ClientError, asyncio.TimeoutError, OSError)
    ):
        return True
    if isinstance(exc, bexc.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or _code(exc) in _RETRYABLE
    return False


def _span(header: bytes, data: memoryview, start: int, end: int) -> bytearray:
    """Bytes ``start:end`` of the object (header, then payload) in one buffer: one copy of that
    part of the payload. botocore takes no memoryview as a body."""
    body = bytearray(end - start)
    h = len(header)
    if start < h:
        body[: min(h, end) - start] = header[start:end]
    if end > h:
        lo = max(start, h)
        body[lo - start :] = data[lo - h : end - h]
    return body


def _missing(exc: BaseException) -> bool:
    return isinstance(exc, bexc.ClientError) and _code(exc) in _MISSING


def client_config(
    concurrency: int,
    max_attempts: int = 3,
    timeout_s: float = 10.0,
    path_style: bool = True,
    sign_payload: bool = False,
) -> AioConfig:
    """The botocore config the tier uses (the benchmark's raw baseline uses the same one).

    Bodies go out as ``UNSIGNED-PAYLOAD`` unless ``sign_payload``: SigV4 still signs every
    request's headers, but not a SHA-256 of each body, which costs more than sending it here
    (124 ms of CPU per 64 MiB on this machine's 2 cores). botocore signs bodies by default on
    plain HTTP, and on HTTPS too when no checksum header goes with them, as with the setting
    below. Blocks carry their own xxh3 checksum, verified whenever they are read back; TLS
    (an ``https://`` endpoint) protects them in transit.
    """
    return AioConfig(
        max_pool_connections=concurrency,
        retries={"max_attempts": max_attempts, "mode": "standard"},
        connect_timeout=timeout_s,
        read_timeout=timeout_s,
        s3={"addressing_style": "path" if path_style else "auto", "payload_signing_enabled": sign_payload},
        # Blocks carry their own xxh3 checksum, verified by the tiering layer.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


class S3Tier(TierBase):
    """Blocks as S3 objects.

    ``client`` is an aiobotocore S3 client that the caller opened and closes, or a zero-argument
    factory returning the async context manager ``aioboto3.Session().client("s3", ...)`` returns;
    the tier then enters it on first use (in the running event loop) and exits it on close.
    """

    name = "s3"

    def __init__(
        self,
        client: Any,
        *,
        bucket: str = "kvstore",
        prefix: str = "blocks",
        concurrency: int = 8,
        multipart_threshold_bytes: int = 8 << 20,
        part_bytes: int = 8 << 20,
        create_bucket: bool = True,
        region: str = "us-east-1",
    ) -> None:
        self._client_arg = client
        self._client: Any = client if hasattr(client, "get_object") else None
        self._stack = contextlib.AsyncExitStack()
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.concurrency = concurrency
        self.multipart_threshold_bytes = multipart_threshold_bytes
        self.part_bytes = part_bytes
        self.region = region
        self._create_bucket = create_bucket
        self._sem = asyncio.Semaphore(concurrency)
        self._ready = False
        self._ready_lock = asyncio.Lock()

    @classmethod
    def from_config(cls, cfg: S3Config) -> S3Tier:
        """Credentials come from botocore's usual chain (environment, ~/.aws, instance role)."""
        def client() -> Any:
            return aioboto3.Session().client(
                "s3",
                endpoint_url=cfg.endpoint_url or None,
                region_name=cfg.region,
                config=client_config(
                    cfg.concurrency,
                    cfg.max_attempts,
                    cfg.timeout_s,
                    path_style=bool(cfg.endpoint_url),
                    sign_payload=cfg.sign_payload,
                ),
            )

        return cls(
            client, bucket=cfg.bucket, prefix=cfg.prefix, concurrency=cfg.concurrency,
            multipart_threshold_bytes=cfg.multipart_threshold_bytes, part_bytes=cfg.part_bytes, region=cfg.region,
        )

    def object_key(self, ref: BlockRef) -> str:
        return f"{self.prefix}/{ref.name}" if self.prefix else ref.name

    # ---- plumbing ---------------------------------------------------------------------------

    async def _call(self, op: str, **kwargs: Any) -> Any:
        """One S3 request under the semaphore; connection failures become Unavailable."""
        async with self._sem:
            return await self._call_held(op, **kwargs)

    async def _call_held(self, op: str, **kwargs: Any) -> Any:
        """:meth:`_call` for a caller already holding the semaphore (it also reads the body:
        a response holds a pooled connection, so it must not wait for the semaphore again)."""
        for attempt in (0, 1):
            client = await self._ensure()
            try:
                return await getattr(client, op)(Bucket=self.bucket, **kwargs)
            except Exception as exc:
                if _unavailable(exc):
                    raise Unavailable(f"s3 {op}: {exc}") from exc
                gone = isinstance(exc, bexc.ClientError) and _code(exc) == "NoSuchBucket"
                if not gone or not self._create_bucket or op not in _CREATES or attempt:
                    raise
                self._ready = False  # the bucket vanished (a fresh MinIO/moto): make it again
        raise AssertionError("unreachable")

    async def _ensure(self) -> Any:
        if self._ready:
            return self._client
        async with self._ready_lock:
            if self._client is None:
                self._client = await self._stack.enter_async_context(self._client_arg())
            if self._create_bucket and not self._ready:
                try:
                    await self._client.head_bucket(Bucket=self.bucket)
                except Exception as exc:
                    if _unavailable(exc):
                        raise Unavailable(f"s3 head_bucket: {exc}") from exc
                    if not _missing(exc):
                        raise
                    await self._make_bucket()
            self._ready = True
            return self._client

    async def _make_bucket(self) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            await self._client.create_bucket(**kwargs)
        except bexc.ClientError as exc:
            if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    # ---- Tier -----------------------------------------------------------------------------

    async def contains(self, ref: BlockRef) -> bool:
        try:
            await self._call("head_object", Key=self.object_key(ref))
            return True
        except bexc.ClientError as exc:
            if _missing(exc):
                return False
            raise

    async def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        return list(await asyncio.gather(*(self.contains(r) for r in refs)))

    async def get(self, ref: BlockRef, into: memoryview) -> BlockMeta | None:
        async with self._sem:
            try:
                resp = await self._call_held("get_object", Key=self.object_key(ref))
            except bexc.ClientError as exc:
                if _missing(exc):
                    return None
                raise
            try:
                return await self._read_body(ref, resp, into)
            except (TimeoutError, bexc.HTTPClientError, aiohttp.ClientError) as exc:
                raise Unavailable(f"s3 get_object body: {exc}") from exc
            finally:
                resp["Body"].close()

    @staticmethod
    async def _read_into(body: Any, buf: memoryview) -> int:
        done = 0
        while done < len(buf):
            n = await body.readinto(buf[done:])
            if n == 0:
                break
            done += n
        return done

    async def _read_body(self, ref: BlockRef, resp: dict[str, Any], into: memoryview) -> BlockMeta:
        body, length = resp["Body"], int(resp["ContentLength"])
        head = bytearray(HEADER_FIXED)
        await self._read_into(body, memoryview(head))
        hsize = header_size(head)
        if hsize > HEADER_FIXED:
            label = bytearray(hsize - HEADER_FIXED)
            await self._read_into(body, memoryview(label))
            head += label
        meta = decode_header(head)
        if meta.ref != ref:
            raise ChecksumMismatch(f"s3 object for {ref.name} holds {meta.ref.name}")
        if meta.size > len(into):
            raise InvalidArgument(f"buffer of {len(into)} bytes for a block of {meta.size}")
        if length != hsize + meta.size or await self._read_into(body, into[: meta.size]) != meta.size:
            raise ChecksumMismatch(f"s3 object for {ref.name} is {length} bytes, header says {hsize}+{meta.size}")
        return meta

    async def get_many(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[BlockMeta | None]:
        return list(await asyncio.gather(*(self.get(r, b) for r, b in zip(refs, into))))

    async def put(self, meta: BlockMeta, data: memoryview) -> None:
        if len(data) != meta.size:
            raise InvalidArgument(f"block {meta.ref.name}: {len(data)} bytes, header says {meta.size}")
        header, key = encode_header(meta), self.object_key(meta.ref)
        total = len(header) + meta.size
        if total > self.multipart_threshold_bytes:
            await self._multipart(key, header, data)
            return
        async with self._sem:  # a body is made once its request can go: at most `concurrency` at a time
            await self._call_held("put_object", Key=key, Body=_span(header, data, 0, total))

    async def _multipart(self, key: str, header: bytes, data: memoryview) -> None:
        upload = await self._call("create_multipart_upload", Key=key)
        upload_id = upload["UploadId"]
        step, total = self.part_bytes, len(header) + len(data)

        async def part(number: int, offset: int) -> dict[str, Any]:
            async with self._sem:
                body = _span(header, data, offset, min(offset + step, total))
                resp = await self._call_held("upload_part", Key=key, UploadId=upload_id, PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": resp["ETag"]}

        try:
            parts = await asyncio.gather(*(part(i + 1, off) for i, off in enumerate(range(0, total, step))))
            await self._call("complete_multipart_upload", Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):
                await self._call("abort_multipart_upload", Key=key, UploadId=upload_id)
            raise

    async def put_many(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        await asyncio.gather(*(self.put(m, d) for m, d in items))

    async def delete(self, ref: BlockRef) -> None:
        await self.delete_many([ref])

    async def delete_many(self, refs: Sequence[BlockRef]) -> None:
        for i in range(0, len(refs), 1000):  # DeleteObjects takes at most 1000 keys
            objects = [{"Key": self.object_key(r)} for r in refs[i : i + 1000]]
            await self._call("delete_objects", Delete={"Objects": objects, "Quiet": True})

    async def close(self) -> None:
        await self._stack.aclose()
        if self._client is not self._client_arg:
            self._client = None
        self._ready = False

    async def scan(self) -> AsyncIterator[BlockMeta]:
        """Every block under ``prefix``: list_objects_v2, then a ranged GET of each header."""
        token: dict[str, Any] = {}
        while True:
            page = await self._call("list_objects_v2", Prefix=self.prefix + "/" if self.prefix else "", **token)
            keys = [o["Key"] for o in page.get("Contents", [])]
            for meta in await asyncio.gather(*(self._head_of(k) for k in keys)):
                if meta is not None:
                    yield meta
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    async def _head_of(self, key: str) -> BlockMeta | None:
        try:
            head = await self._range(key, _HEADER_PROBE)
            if len(head) >= HEADER_FIXED and header_size(head) > len(head):
                head = await self._range(key, header_size(head))
            return decode_header(head)
        except ChecksumMismatch:
            return None  # not a block (or a corrupted header): skip it
        except bexc.ClientError as exc:
            if _missing(exc):
                return None  # deleted since the listing
            raise

    async def _range(self, key: str, nbytes: int) -> bytes:
        async with self._sem:
            resp = await self._call_held("get_object", Key=key, Range=f"bytes=0-{nbytes - 1}")
            try:
                data: bytes = await resp["Body"].read()  # aiobotocore's StreamingBody: untyped
                return data
            except (TimeoutError, bexc.HTTPClientError, aiohttp.ClientError) as exc:
                raise Unavailable(f"s3 get_object body: {exc}") from exc
            finally:
                resp["Body"].close()
