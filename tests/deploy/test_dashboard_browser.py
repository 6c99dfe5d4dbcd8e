"""The dashboard in a real headless browser (Debian's chromium driven by playwright): the page
loads with ``?token=``, the charts render, and every number shown equals /stats. Writes a
screenshot under the test's tmp dir; with KVSTORE_UPDATE_SCREENSHOT=1 also to docs/dashboard.png.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from collections.abc import Iterator

import deploy_topology as topo
import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from traffic import one_round

from kvstore.client import SyncClient
from kvstore.commands.stats import latency_rows, seconds
from tests.support.sidecar_args import loopback_args

CHROMIUM = os.environ.get("KVSTORE_CHROMIUM", "/usr/bin/chromium")
TOKEN = "dashboard-token"
TIERS = ("dram", "ssd", "redis", "s3")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} missing: run scripts/setup_env.sh"
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        yield b
        b.close()


def stats(http: str) -> dict:
    req = urllib.request.Request(f"http://{http}/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    return json.loads(urllib.request.urlopen(req).read())


# --- what the page should show, formatted as `kvstore stats` and the page do -----------------------


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def expected(doc: dict, path: str) -> tuple[float | str, str]:
    """(raw value, text) the element with data-stat=path must show."""
    derived = {
        "bytes_moved": sum(doc["tiers"][t][k] for t in TIERS for k in ("bytes_in", "bytes_out")),
        **{k: sum(doc["tiers"][t][k] for t in TIERS) for k in ("evictions", "demotions", "promotions")},
        "errors_total": sum(doc["errors"].values()),
    }
    if path in derived:
        v = derived[path]
    else:
        v = doc
        for part in path.split("."):
            v = v.get(part, 0) if isinstance(v, dict) else v[int(part)] if isinstance(v, list) else 0
    if path == "policy":
        return v, v
    if path in ("hit_rate",) or path.startswith("hit_rate_by_tier."):
        return v, pct(v)
    if path == "bytes_moved":
        return v, human_bytes(v)
    if path.startswith("latency.") and path.endswith("_s"):
        return v, seconds(v)  # as `kvstore stats` shows it
    return v, str(v)


def wait_for_calls(page: Page, calls: int) -> None:
    page.wait_for_function(
        "n => { const d = window.kvstoreDashboard.doc; return d && d.lookups.calls >= n; }", arg=calls
    )


def painted_pixels(page: Page, canvas_id: str) -> int:
    return page.evaluate(
        """id => { const c = document.getElementById(id);
                   const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                   let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""",
        canvas_id,
    )


def test_dashboard_renders_live_charts_that_match_stats(browser, serve_process, tmp_path):
    sc = serve_process(
        loopback_args(tmp_path / "d", 1 << 20),
        {"KVSTORE_SERVER__AUTH_TOKEN": TOKEN, "KVSTORE_DRAM__PAGE_BYTES": "65536"},
    )
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    resp = page.goto(f"http://{sc.http}/dashboard?token={TOKEN}&interval=250")
    assert resp is not None and resp.status == 200
    page.wait_for_function("window.kvstoreDashboard && window.kvstoreDashboard.renders >= 1")

    with SyncClient(sc.grpc, token=TOKEN) as client:  # live traffic: the page follows it round by round
        for r in range(16):
            one_round(client, r)
            wait_for_calls(page, r + 1)
    doc = stats(sc.http)
    wait_for_calls(page, doc["lookups"]["calls"])
    page.wait_for_function(
        "n => window.kvstoreDashboard.renders > n", arg=page.evaluate("window.kvstoreDashboard.renders")
    )

    # the numbers shown are /stats's numbers (the traffic has stopped, so they are stable)
    shown = page.eval_on_selector_all(
        "[data-stat]", "els => els.map(e => [e.dataset.stat, e.dataset.value, e.textContent.trim()])")
    assert len(shown) > 30
    for path, value, text in shown:
        if path == "uptime_s":
            continue
        want_value, want_text = expected(doc, path)
        assert (value if path == "policy" else float(value)) == pytest.approx(want_value), path
        assert text == want_text, path
    ns_rows = page.eval_on_selector_all(
        "#namespaces tbody tr",
        "rows => rows.map(r => [r.dataset.namespace, ...[...r.cells].slice(1).map(c => c.textContent)])",
    )
    assert ns_rows == [[label, str(c["calls"]), str(c["blocks_requested"]), str(c["blocks_hit"]), pct(c["hit_rate"])]
                       for label, c in doc["namespaces"].items()]
    # the latencies: every series timed, its p50 and p99 as `kvstore stats` prints them
    timed = page.eval_on_selector_all(
        "#latency tbody tr", "rows => rows.map(r => [...r.cells].slice(0, 5).map(c => c.textContent.trim()))")
    assert timed == [[f, labels, str(n), seconds(p50), seconds(p99)] for f, labels, n, p50, p99 in latency_rows(doc)]
    assert any(row[0] == "rpc" and row[1].endswith("Lookup ok") for row in timed)
    assert any(path.startswith("latency.rpc.") and path.endswith(".p99_s") for path, _, _ in shown)
    latest = page.eval_on_selector_all("#decisions tbody tr", "rows => rows.map(r => r.cells[1].textContent)")
    assert latest == [d["outcome"] for d in reversed(doc["decisions"]["recent"][-8:])]

    # the charts rendered: data points, and pixels on every canvas
    points = {
        c: int(page.get_attribute(f"#{c}", "data-points"))
        for c in ("chart-hitrate", "chart-occupancy", "chart-decisions")
    }
    # How many points the hit-rate line has depends on when the server's 2 s history samples
    # fell between the rounds (timing); a line needs at least two.
    assert points["chart-hitrate"] >= 2
    assert points["chart-occupancy"] == sum(doc["tiers"][t]["enabled"] for t in TIERS) == 2
    assert points["chart-decisions"] == len(doc["decisions"]["recent"]) == 14
    for canvas in points:
        assert painted_pixels(page, canvas) > 2000, canvas
    assert "live" in page.inner_text("#status")
    assert not problems, problems

    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    if os.environ.get("KVSTORE_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, topo.REPO / "docs" / "dashboard.png")
    page.close()


def test_dashboard_needs_the_token(browser, serve_process, tmp_path):
    sc = serve_process(
        loopback_args(tmp_path / "d", 1 << 20),
        {"KVSTORE_SERVER__AUTH_TOKEN": TOKEN, "KVSTORE_DRAM__PAGE_BYTES": "65536"},
    )
    page = browser.new_page()
    resp = page.goto(f"http://{sc.http}/dashboard")
    assert resp is not None and resp.status == 401
    page.close()
