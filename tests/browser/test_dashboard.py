"""The live dashboard in headless Chromium, on a real ``meshnet up`` swarm (tracker, 3 llama.cpp
nodes, gateway on loopback): the layer map, the nodes, a streamed chat reply and a generation's
live progress, with no console error; and, on a swarm started with ``--api-keys``, the page's key
form. Screenshots (mid-generation, the chat, the key form) are kept in ``tests/artifacts/`` (or
``$MESHNET_ARTIFACTS_DIR``)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import pytest

from tests.browser.chromium import chromium, console_errors
from tests.procs import Proc, admin_client, local_swarm, tracker_url

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

ARTIFACTS = Path(os.environ.get("MESHNET_ARTIFACTS_DIR") or Path(__file__).resolve().parents[1] / "artifacts")
MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Greedy, and long enough (about 2 tokens a number) never to stop before max_tokens.
COUNTING = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]
LIVE_TOKENS = 384  # several seconds of decode: the page polls every 1-2 s and must see it run

T = TypeVar("T")

# The card of the generation named by arguments[0] (the page sets its state as data attributes).
CARD = (
    "const c = [...document.querySelectorAll('#generations .gen')].find(g => g.dataset.generationId === arguments[0]);"
)


def wait_until(probe: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.1) -> T:
    """Poll ``probe`` until it returns something truthy, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s}s: {what} (last: {got!r})")
        time.sleep(every_s)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    # First, so a machine without a browser skips before starting the swarm.
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    workdir = tmp_path_factory.mktemp("dashboard-swarm")
    with local_swarm(workdir) as proc:
        yield proc


@pytest.fixture(scope="module")
def page(browser: WebDriver, swarm: Proc) -> WebDriver:
    browser.get(f"{swarm.url}/")
    wait_until(
        lambda: browser.execute_script("return document.querySelectorAll('#layer-map .segment').length") == 3,
        30,
        "the layer map shows three nodes",
    )
    return browser


def js(driver: WebDriver, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def screenshot(driver: WebDriver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.execute_script("window.scrollTo(0, 0)")  # typing into the chat box scrolls it into view
    assert driver.save_screenshot(str(path)), path
    return path


def chat(page: WebDriver, text: str, max_tokens: int) -> tuple[dict[str, Any], list[int]]:
    """Send ``text`` from the chat box; the last reply's state once it ended, and its lengths as it grew."""
    from selenium.webdriver.common.by import By

    limit = page.find_element(By.ID, "chat-max")
    limit.clear()
    limit.send_keys(str(max_tokens))
    page.find_element(By.ID, "chat-input").send_keys(text)
    page.find_element(By.ID, "chat-send").click()

    lengths: list[int] = []
    deadline = time.monotonic() + 120
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = js(
            page,
            """const m = document.querySelector('#chat-log .msg.assistant:last-child');
            return m ? {length: m.querySelector('.text').textContent.length, chunks: Number(m.dataset.chunks),
                        done: m.dataset.done || null, gid: m.dataset.generationId || null,
                        text: m.querySelector('.text').textContent,
                        status: document.getElementById('chat-status').textContent} : {}""",
        )
        if state.get("length"):
            lengths.append(state["length"])
        if state.get("done"):
            break
        time.sleep(0.05)
    return state, lengths


# Chromium logs each refused fetch as a console error; with API keys on, only these are expected.
REFUSED = re.compile(
    r"\S+/(v1/\S+|dashboard/key) - Failed to load resource: the server responded with a status of 401 \(Unauthorized\)"
)


def unexpected_console_errors(driver: WebDriver) -> list[str]:
    return [m for m in console_errors(driver) if not REFUSED.fullmatch(m)]


def requests_made(driver: WebDriver) -> int:
    return js(driver, "return performance.getEntriesByType('resource').filter(e => e.name.includes('/v1/')).length")


def all_cookies(page: Any) -> list[dict[str, Any]]:
    """Every cookie the browser holds, whatever its path: WebDriver's own list has only those the open
    page's path would send, and the key's (``Path=/v1/``) is not among them on ``/``."""
    return list(page.execute_cdp_cmd("Network.getAllCookies", {})["cookies"])


def test_with_api_keys_the_page_asks_for_a_key_and_then_works(tmp_path: Path) -> None:
    """A gateway with ``--api-keys``: the page asks for a key, refuses a wrong one with the gateway's
    own message, and with the right one shows the swarm and streams a chat (the key in the
    ``meshnet_api_key`` cookie the gateway sets, HttpOnly, on every fetch and EventSource). First in the module,
    with a browser of its own: its swarm is gone before the module's starts, and its cookie with it."""
    from selenium.webdriver.common.by import By

    key = f"sk-dashboard-{uuid.uuid4().hex}"
    keys = tmp_path / "api-keys"
    keys.write_text(f"# the dashboard test's key\n{key}\n", encoding="utf-8")
    workdir = tmp_path / "swarm"
    with (
        chromium() as page,
        local_swarm(workdir, "--api-keys", str(keys)) as swarm,
    ):
        refused = httpx.get(f"{swarm.url}/v1/models", timeout=30)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = f"sk-wrong-{uuid.uuid4().hex}"
        wrong_message = httpx.get(
            f"{swarm.url}/v1/models", headers={"Authorization": f"Bearer {wrong}"}, timeout=30
        ).json()["error"]["message"]

        def form() -> dict[str, Any]:
            return js(
                page,
                """return {shown: !document.getElementById('auth').hidden,
                    message: document.getElementById('key-message').textContent,
                    input: document.getElementById('key-input').type,
                    conn: document.getElementById('conn').dataset.state,
                    forget: !document.getElementById('key-forget').hidden,
                    cookie: document.cookie, segments: document.querySelectorAll('#layer-map .segment').length}""",
            )

        # No key: the form, with the gateway's message, and the polling stops.
        page.get(f"{swarm.url}/")
        seen = wait_until(lambda: (f := form())["shown"] and f, 15, "the page asks for an API key")
        assert seen["message"] == refused.json()["error"]["message"]
        assert seen["input"] == "password" and seen["conn"] == "locked" and not seen["forget"]
        assert seen["segments"] == 0
        time.sleep(0.5)  # the other loop's refused request may still be on its way
        settled = requests_made(page)
        time.sleep(2.5)  # longer than both polling periods
        assert requests_made(page) == settled, "the page kept polling without a key"
        assert unexpected_console_errors(page) == []

        def use(text: str) -> None:
            field = page.find_element(By.ID, "key-input")
            field.clear()
            field.send_keys(text)
            page.find_element(By.ID, "key-use").click()

        # A wrong key: the gateway's answer, and the key is not kept.
        use(wrong)
        seen = wait_until(lambda: (f := form())["message"] == wrong_message and f, 15, "the wrong key is refused")
        assert seen["shown"] and "meshnet_api_key" not in seen["cookie"] and not seen["forget"]
        screenshot(page, "dashboard-key.png")

        # The right key: the swarm, the cookie, and a streamed chat whose live events arrive.
        use(key)
        seen = wait_until(lambda: (f := form())["segments"] == 3 and f, 30, "the layer map shows three nodes")
        # the gateway's cookie: HttpOnly (no script sees it), SameSite=Strict, for its API only
        assert not seen["shown"] and seen["forget"] and "meshnet_api_key" not in seen["cookie"]
        (cookie,) = [c for c in all_cookies(page) if c["name"] == "meshnet_api_key"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/v1/"
        wait_until(lambda: form()["conn"] == "live", 15, "the page is live")
        state, lengths = chat(page, "Write a short poem about the sea.", 32)
        assert state.get("done") == "1", state
        assert len(set(lengths)) >= 2 and state["text"].strip()
        hops = wait_until(
            lambda: js(
                page,
                CARD
                + """return c && c.dataset.phase === 'completed' ?
                    [...c.querySelectorAll('tr[data-hop]')].map(r => r.dataset.computeMs) : null""",
                state["gid"],
            ),
            15,
            "the chat's generation completes on the page",
        )
        # per-hop compute times come only from the generation's events: the EventSource got in
        assert len(hops) == 3 and all(float(ms) > 0 for ms in hops), hops

        # Forget key: the cookie goes, and the page asks again.
        page.find_element(By.ID, "key-forget").click()
        seen = wait_until(lambda: (f := form())["shown"] and f, 15, "the page asks for a key again")
        assert "meshnet_api_key" not in seen["cookie"] and not seen["forget"]
        assert not [c for c in all_cookies(page) if c["name"] == "meshnet_api_key"]
        assert unexpected_console_errors(page) == []


def test_the_page_draws_every_node_of_the_swarm_on_the_layer_bar(page: WebDriver, swarm: Proc) -> None:
    assert page.title == "Meshnet dashboard"
    view = httpx.get(f"{swarm.url}/v1/swarm", timeout=30).json()
    expected = {n["node_id"]: (n["layers"], n["backend"]) for n in view["nodes"]}
    assert sorted(layers for layers, _ in expected.values()) == ["0:10", "10:20", "20:30"]

    segments = js(
        page,
        """return [...document.querySelectorAll('#layer-map .segment')].map(s => ({
            id: s.dataset.nodeId, layers: s.dataset.layers, backend: s.dataset.backend, state: s.dataset.state,
            text: s.textContent, left: s.offsetLeft / s.parentElement.clientWidth,
            width: s.offsetWidth / s.parentElement.clientWidth}))""",
    )
    assert {s["id"]: (s["layers"], s["backend"]) for s in segments} == expected
    for s in segments:
        start, stop = (int(x) for x in s["layers"].split(":"))
        assert s["state"] == "up"
        assert s["id"] in s["text"] and s["layers"] in s["text"] and s["backend"] in s["text"]
        # drawn to scale on the 30-layer bar
        assert s["left"] == pytest.approx(start / 30, abs=0.02)
        assert s["width"] == pytest.approx((stop - start) / 30, abs=0.02)

    rows = js(
        page,
        """return [...document.querySelectorAll('#nodes-body tr[data-node-id]')].map(r => ({
            id: r.dataset.nodeId, layers: r.dataset.layers, state: r.dataset.state, text: r.textContent}))""",
    )
    assert {r["id"]: r["layers"] for r in rows} == {k: v[0] for k, v in expected.items()}
    assert all(r["state"] == "up" and "MiB" in r["text"] for r in rows)  # free KV shown
    assert js(page, "return document.querySelector('[data-stat=coverage] .stat-value').textContent") == "30 / 30"
    assert js(page, "return document.getElementById('conn').dataset.state") == "live"
    assert js(page, "return document.getElementById('model-id').textContent") == MODEL
    assert console_errors(page) == []


def test_the_chat_box_streams_a_reply(page: WebDriver, swarm: Proc) -> None:
    state, lengths = chat(page, "Write a short poem about the sea.", 64)
    assert state.get("done") == "1", state
    assert len(set(lengths)) >= 2, f"the reply did not grow while streaming: {lengths}"
    assert lengths == sorted(lengths)
    assert state["chunks"] >= 3 and state["text"].strip()

    # The chat's own generation is on the page with its telemetry, and ends within max_tokens.
    gid = state["gid"]
    assert gid
    card = wait_until(
        lambda: js(
            page,
            CARD
            + """return c && c.dataset.phase === 'completed' ? {tokens: Number(c.dataset.completionTokens),
                chat: c.classList.contains('from-chat')} : null""",
            gid,
        ),
        15,
        "the chat's generation completes on the page",
    )
    assert card["chat"] and 0 < card["tokens"] <= 64
    screenshot(page, "dashboard-chat.png")
    assert console_errors(page) == []


def test_a_chat_refused_for_its_keys_limits_shows_the_gateways_message(page: WebDriver) -> None:
    """A 429 (a key past its limits) is an error in the chat, not a crash: the gateway's answer is
    stood in for by a stub of the page's fetch, as only a keyed gateway under load sends one."""
    message = "key 'key-1' has 4 generations in flight, its limit; retry when one ends"
    js(
        page,
        """const message = arguments[0];
        window.__fetch = window.fetch;
        window.fetch = (path, init) => path === '/v1/chat/completions'
            ? Promise.resolve(new Response(JSON.stringify({error: {message, type: 'rate_limit_error', param: null,
                                                                     code: 'rate_limit_exceeded'}}),
                {status: 429, headers: {'Content-Type': 'application/json', 'Retry-After': '1'}}))
            : window.__fetch(path, init);""",
        message,
    )
    try:
        state, _ = chat(page, "Hello?", 8)
    finally:
        js(page, "window.fetch = window.__fetch")
    assert state.get("done") == "error", state
    shown = js(
        page,
        """const m = document.querySelector('#chat-log .msg.assistant:last-child');
        return {error: m.querySelector('.gen-error').textContent,
                status: document.getElementById('chat-status').textContent,
                send: document.getElementById('chat-send').disabled, form: !document.getElementById('auth').hidden}""",
    )
    assert shown == {"error": f"error: {message}", "status": f"error: {message}", "send": False, "form": False}
    assert console_errors(page) == []


def test_a_running_generation_shows_live_progress(page: WebDriver, swarm: Proc) -> None:
    gid = f"dash-live-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": COUNTING, "max_tokens": LIVE_TOKENS, "temperature": 0}
    headers = {"X-Meshnet-Generation-Id": gid}
    read_card = (
        CARD
        + """return c ? {
            phase: c.dataset.phase, tokens: Number(c.dataset.completionTokens), prefill: Number(c.dataset.prefillDone),
            hops: [...c.querySelectorAll('tr[data-hop]')].map(r => [r.dataset.nodeId, r.dataset.layers,
                                                                     r.dataset.computeMs]),
            session: [...document.querySelectorAll('#sessions tbody tr')]
                .some(r => r.textContent.includes(arguments[0])),
        } : null"""
    )
    running: list[int] = []
    seen_session = False
    shot = None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, f"{swarm.url}/v1/chat/completions", json=body, headers=headers, timeout=180)
        deadline = time.monotonic() + 180
        while not future.done() and time.monotonic() < deadline:
            card = js(page, read_card, gid)
            if card and card["phase"] in ("queued", "prefill", "decode"):
                running.append(card["tokens"])
                seen_session = seen_session or card["session"]
                if shot is None and card["tokens"] > LIVE_TOKENS // 3 and seen_session:
                    shot = screenshot(page, "dashboard.png")
            time.sleep(0.1)
        response = future.result(timeout=max(1.0, deadline - time.monotonic()))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == LIVE_TOKENS

    progress = sorted({t for t in running if t > 0})
    assert len(progress) >= 2, f"the page never showed the token count growing while it ran: {running}"
    assert running == sorted(running)  # never backwards
    assert seen_session, "the running session never appeared under routes & sessions"

    final = wait_until(
        lambda: (c := js(page, read_card, gid)) and c["phase"] == "completed" and c,
        15,
        "the generation shows as completed",
    )
    assert final["tokens"] == LIVE_TOKENS
    assert final["prefill"] == usage["prompt_tokens"]
    # per-hop timings from the final route.health: every hop, each with its compute time per token
    # (meshnet up's nodes are placed by the tracker: which node holds which range is its choice)
    assert [h[1] for h in final["hops"]] == ["0:10", "10:20", "20:30"]
    assert sorted(h[0] for h in final["hops"]) == ["node-0", "node-1", "node-2"]
    assert all(float(h[2]) > 0 for h in final["hops"])
    if shot is None:  # a machine too fast to catch it mid-run: keep the finished state instead
        shot = screenshot(page, "dashboard.png")
    assert shot.stat().st_size > 10_000
    assert console_errors(page) == []


HOSTILE = '<img src=x onerror="window.__pwned=1">'


def test_text_from_nodes_and_telemetry_is_shown_as_text(page: WebDriver) -> None:
    """Node ids, reasons and routes come from untrusted nodes: they must render as text, never
    markup. A synthetic node and a finished generation with a route repair are fed to the page's
    own renderers (so nothing is ever streamed for them)."""
    gid = f"dash-hostile-{uuid.uuid4().hex[:8]}"
    js(
        page,
        """const [gid, evil] = arguments;
        const node = {node_id: evil, url: 'http://127.0.0.1:9', layers: '0:30', backend: evil, trusted: false,
                      health: {status: 'ok', sessions: 0, kv_bytes_free: 1048576, kv_bytes_used: 0}};
        mergeNodes({tracker: state.swarm.tracker, nodes: [...state.swarm.nodes, node]});
        renderSwarm();
        const gen = track(gid, 'api');
        const hops = [{node: 'node-0', url: 'u0', layers: '0:15'}, {node: evil, url: 'u1', layers: '15:30'}];
        for (const e of [
            {type: 'route.accepted', t: 0, session_id: 's', route_id: 'r', nodes: hops},
            {type: 'prefill.started', t: 0.01, prompt_tokens: 10},
            {type: 'prefill.completed', t: 0.1, prompt_tokens: 10, seconds: 0.1, tokens_per_second: 100},
            {type: 'decode.started', t: 0.1},
            {type: 'route.retry', t: 0.2, kind: 'repair', attempt: 1, reason: evil, failed_node: evil,
             replayed_positions: 12, seconds: 0.05, session_id: 's', route_id: 'r2', nodes: hops},
            {type: 'generation.failed', t: 0.3, reason: evil, code: 'engine_error'},
        ]) applyEvent(gen, e);
        renderGenerations();""",
        gid,
        HOSTILE,
    )
    card = js(
        page,
        CARD
        + """return {retries: c.dataset.retries, phase: c.dataset.phase, text: c.textContent,
                hop: c.querySelector('tr[data-hop="1"]').dataset.nodeId}""",
        gid,
    )
    assert card["phase"] == "failed" and card["retries"] == "1"
    assert f"{HOSTILE} failed: {HOSTILE}" in card["text"] and "replayed 12 positions" in card["text"]
    assert card["hop"] == HOSTILE
    # read in one script: the swarm poll re-renders the table every 2 s (an element found before it is stale)
    row = js(
        page,
        """const r = [...document.querySelectorAll('#nodes-body tr')].find(r => r.dataset.nodeId == arguments[0]);
        return r ? r.innerText : null""",
        HOSTILE,
    )
    assert row is not None and HOSTILE in row
    # a trust field appears as its own column
    assert "untrusted" in row and "Trust" in js(page, "return document.getElementById('nodes-head').textContent")
    assert js(page, "return document.querySelectorAll('img').length") == 0
    assert js(page, "return window.__pwned === undefined")
    assert console_errors(page) == []


def test_meshnet_up_with_audit_rate_audits_every_session_and_the_page_shows_the_verdicts(
    browser: WebDriver, tmp_path: Path
) -> None:
    """``meshnet up --audit-rate 1``: one auditor per range (trusted members of its private swarm,
    never routed: not on the layer bar, badged in the nodes table); every hop of a chat passes its
    audit, on the gateway, on the tracker, and in the page's Audits panel."""
    with local_swarm(tmp_path / "audited", "--audit-rate", "1") as swarm:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8}
        assert httpx.post(f"{swarm.url}/v1/chat/completions", json=body, timeout=120).status_code == 200
        browser.get(f"{swarm.url}/")
        rows = "return [...document.querySelectorAll('#audits tr[data-verdict]')].map(r => r.dataset.verdict)"

        def listed() -> list[str] | None:
            found: list[str] = js(browser, rows)
            return found if len(found) >= 3 else None

        verdicts = wait_until(listed, 60, "the Audits panel lists the chat's 3 hops")
        assert verdicts == ["pass"] * 3, verdicts
        assert "100.0% of sessions" in js(browser, "return document.getElementById('audits-caption').textContent")
        assert js(browser, "return document.querySelectorAll('#layer-map .segment').length") == 3
        badges = js(browser, "return [...document.querySelectorAll('#nodes-body .badge')].map(b => b.textContent)")
        assert badges.count("auditor") == 3, badges
        with admin_client(swarm) as admin:
            kept = admin.get(f"{tracker_url(swarm)}/v1/audits").json()
        assert sorted(a["verdict"] for a in kept["audits"]) == ["pass"] * 3 and not kept["suspended"]
        assert console_errors(browser) == []
