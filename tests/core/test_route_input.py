"""/route inputs that do not parse are answered 400 naming the field, through the sidecar's real HTTP
server (issue 37, part 5). On 66d9839 an integer of 4,401 digits (past Python's 4,300-digit
conversion limit, or past a float for ``loads``) was answered 500, a boolean passed as a token id,
and a token list too long for ``server.max_batch_blocks`` was hashed whole before it was refused."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvstore.server.sidecar import Sidecar
from tests.conftest import small_config

NS = {"model": "m", "kvLayout": "raw", "dtype": "float16", "blockSize": 16}
KEY = "00" * 32
HUGE = "1" + "0" * 4400  # an integer literal of 4,401 digits (Python converts at most 4,300)



def raw(doc: object, number: str) -> str:
    """``doc`` as JSON with the literal ``number`` where it holds "@"."""
    return json.dumps(doc).replace('"@"', number)


# (raw JSON body, the field its 400 names first)
CASES = [
    (raw({"namespace": {"model": "m", "blockSize": "@"}, "keys": []}, HUGE), "namespace.blockSize"),
    (raw({"namespace": NS, "tokens": [1, "@"]}, HUGE), "tokens[1]"),
    (raw({"namespace": NS, "keys": [KEY], "loads": {"a": "@"}}, "1" + "0" * 400), "loads.a"),  # (no float)
    (raw({"namespace": NS, "keys": [KEY], "loads": {"a": "@"}}, "-" + HUGE), "loads.a"),
    (json.dumps({"namespace": NS, "tokens": [True] * 16}), "tokens"),
    (json.dumps({"namespace": {**NS, "blockSize": 1}, "tokens": [1] * 70_000}), "tokens"),
    (json.dumps({"namespace": NS, "tokens": [-1]}), "tokens"),
    (json.dumps({"namespace": NS, "tokens": "abc"}), "tokens"),
    (json.dumps({"namespace": NS, "keys": [1]}), "keys"),
    (json.dumps({"namespace": NS, "keys": [KEY], "loads": {"a": -1}}), "loads['a']"),
]


@pytest.fixture
async def sidecar_url(tmp_path: Path) -> AsyncIterator[str]:
    async with Sidecar(small_config(tmp_path)) as sc:
        yield f"http://127.0.0.1:{sc.http_port}/route"


async def test_route_inputs_that_do_not_parse_get_400_naming_the_field(sidecar_url: str) -> None:
    wrong = []
    async with aiohttp.ClientSession() as http:
        for body, field in CASES:
            for method, kwargs in (("POST", {"data": body, "headers": {"Content-Type": "application/json"}}),
                                   ("GET", {"params": {"q": body}})):
                if method == "GET" and len(body) > 6000:  # (a request line holds 8 KiB)
                    continue
                async with http.request(method, sidecar_url, **kwargs) as r:
                    text = await r.text()
                    error = json.loads(text).get("error", "") if r.status == 400 else text
                    if r.status != 400 or not error.startswith(field):
                        wrong.append((method, field, r.status, error[:120]))
        async with http.post(sidecar_url, json={"namespace": NS, "keys": [KEY]}) as r:  # (still serving)
            assert r.status == 200 and "nodes" in await r.json()
    assert wrong == []
