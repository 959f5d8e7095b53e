"""The web pages in a real browser (Debian's chromium, driven by Playwright, no browser
download) against the real gateway and engine: the playground loads without console errors,
streams an answer equal to the API's for the same settings and shows its time to first token and
tokens per second; Stop leaves the engine idle; the dashboard's numbers move while requests run;
a server with keys asks for one, and the pages then work with it. Without a browser: the feed's
samples (their arithmetic, and live), its protection (as /metrics: open unless
--protect-health-metrics, then the key as a header, query parameter or cookie), its clean end
when the gateway drains, and --no-webui. Screenshots of both pages are left in
test-artifacts/webui/ (git-ignored)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from common.grpc_stubs.folio.v1 import engine_pb2
from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

from common.config import GatewayServerConfig
from common.flags import from_args
from folio.cli import build_parser
from gateway.front.dashboard import Reading
from gateway.front.dashboard import sample as dashboard_sample
from gateway_helpers import (
    check_error,
    engine_stats,
    start_gateway,
    wait_engine_idle,
)
from grpc_helpers import TIMEOUT
from services.supervisor import ServeConfig, Supervisor

CHROMIUM = "/usr/bin/chromium"
# Headless, offline: nothing may reach for the network (the machines have none).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "webui"
KEY = "sk-folio-webui-test-0123456789"
UNFINISHABLE = 900  # tokens: only Stop can end such an answer while the test watches
FEED_FIELDS = {
    "time",
    "interval",
    "engine_up",
    "running",
    "waiting",
    "kv_cache_usage",
    "num_kv_blocks",
    "prefix_cache_hit_rate",
    "draft_acceptance_rate",
    "generation_tokens_per_second",
    "prompt_tokens_per_second",
    "steps_per_second",
    "step_phase_ms",
    "kv_tier_hits",
    "kv_tier_usage",
    "lora_requests",
    "resident_lora_adapters",
}


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: the set-up installs it (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Tab:
    """A page in a fresh browser context, with the console errors it logged."""

    def __init__(self, browser: Browser) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 860})
        self.page: Page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT * 1000)
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 10_000  # a rendered page, not an empty image
        return path


@pytest.fixture
def tab(browser):
    tab = Tab(browser)
    yield tab
    tab.context.close()


def wait_until(page: Page, condition: str, seconds: float = TIMEOUT) -> None:
    """Poll `condition` (a JavaScript function's text) in the page until it returns true. Not
    page.wait_for_function: that evaluates its predicate with eval, which the pages'
    Content-Security-Policy forbids (and the tests keep it on, to catch what it would block)."""
    deadline = time.monotonic() + seconds
    while not page.evaluate(condition):
        assert time.monotonic() < deadline, f"not true within {seconds} s: {condition}"
        time.sleep(0.05)


def open_playground(tab: Tab, url: str) -> Page:
    page = tab.page
    page.goto(url + "/")
    wait_until(page, "() => document.getElementById('model').textContent !== ''")
    return page


def set_settings(page: Page, system: str, temperature: str, max_tokens: str, seed: str) -> None:
    page.get_by_label("System prompt").fill(system)
    page.get_by_label("Temperature").fill(temperature)
    page.get_by_label("Max tokens").fill(max_tokens)
    page.get_by_label("Seed").fill(seed)


def send(page: Page, text: str) -> None:
    page.get_by_role("textbox", name="Message").fill(text)
    page.get_by_role("button", name="Send").click()


def record_answer_lengths(page: Page) -> None:
    """Keep window.answerLengths: each length the newest answer's text had, as it grew."""
    page.evaluate(
        """() => {
            window.answerLengths = [];
            const log = document.querySelector('[role=log]');
            new MutationObserver(() => {
                const answers = log.querySelectorAll('.message.assistant .content');
                if (!answers.length) return;
                const length = answers[answers.length - 1].textContent.length;
                const seen = window.answerLengths;
                if (seen[seen.length - 1] !== length) seen.push(length);
            }).observe(log, {subtree: true, childList: true, characterData: true});
        }"""
    )


def last_answer(page: Page) -> tuple[str, dict[str, str]]:
    """The newest answer's text and its stats line's data, once the answer has ended."""
    page.locator(".message.assistant .stats").last.wait_for()
    answer = page.locator(".message.assistant").last
    stats = answer.locator(".stats")
    data = stats.evaluate("element => ({...element.dataset, text: element.textContent})")
    return answer.locator(".content").inner_text(), data


def test_the_playground_streams_an_answer(gateway, tab):
    page = open_playground(tab, gateway.url)
    system, question, max_tokens, seed = "You answer in one short sentence.", "Name a color.", 8, 7
    set_settings(page, system, "0", str(max_tokens), str(seed))
    record_answer_lengths(page)
    send(page, question)
    answer, stats = last_answer(page)

    # The same conversation through the API, not streamed: the page sent what its fields say.
    reference = httpx.post(
        gateway.url + "/v1/chat/completions",
        timeout=TIMEOUT,
        json={
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "temperature": 0,
            "max_tokens": max_tokens,
            "seed": seed,
        },
    ).json()
    assert answer == reference["choices"][0]["message"]["content"].strip() != ""
    # It came in pieces: the text was seen at several lengths before its last.
    lengths = page.evaluate("window.answerLengths")
    assert len([n for n in lengths if 0 < n < len(answer)]) >= 2, lengths
    assert int(stats["tokens"]) == reference["usage"]["completion_tokens"]
    assert float(stats["ttftMs"]) > 0 and float(stats["tokensPerSecond"]) > 0
    assert "time to first token" in stats["text"] and "tokens/s" in stats["text"]
    assert answer in page.get_by_role("log").inner_text()
    # A follow-up carries the conversation so far.
    page.get_by_label("Max tokens").fill("2")
    with page.expect_request("**/v1/chat/completions") as follow_up:
        send(page, "And another one?")
    assert follow_up.value.post_data_json["messages"] == [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And another one?"},
    ]
    page.locator(".message.assistant .stats").nth(1).wait_for()
    assert page.locator(".message.user").count() == 2
    assert page.get_by_role("button", name="Send").is_enabled()
    assert page.get_by_role("button", name="Stop").is_disabled()
    tab.screenshot("playground.png")
    assert tab.errors == []


def test_stop_aborts_the_answer_on_the_engine(gateway, engine_stub, tab):
    wait_engine_idle(engine_stub)
    page = open_playground(tab, gateway.url)

    def unfinishable(route: Route) -> None:
        # The model may end an answer by itself at any time: this one must last until Stop.
        body = json.loads(route.request.post_data or "{}")
        body["min_tokens"] = body["max_tokens"]
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", unfinishable)
    set_settings(page, "", "1", str(UNFINISHABLE), "")
    send(page, "Tell me a long story.")
    wait_until(page, "document.querySelector('.message.assistant .content').textContent.length > 0")
    assert engine_stats(engine_stub).num_running == 1
    page.get_by_role("button", name="Stop").click()
    wait_engine_idle(engine_stub, seconds=10)
    answer, stats = last_answer(page)
    assert "stopped" in stats["text"] and answer
    assert 0 < int(stats["tokens"]) < UNFINISHABLE
    assert page.get_by_role("button", name="Send").is_enabled()
    assert tab.errors == []


def dashboard_number(page: Page, element_id: str) -> float:
    text = page.locator(f"#{element_id}").inner_text()
    return float(text.rstrip("%").strip())


def test_the_dashboard_moves_while_requests_run(gateway, engine_stub, tab):
    wait_engine_idle(engine_stub)
    page = tab.page
    page.goto(gateway.url + "/dashboard")
    wait_until(page, "Number(document.body.dataset.samples) >= 2")
    assert dashboard_number(page, "running") == 0
    # This engine does not speculate: the acceptance tile shows no value (Charts.format's
    # en dash for null).
    assert page.locator("#draft-acceptance").inner_text() == "\u2013"
    # Nor tiers nor adapters here: their tiles too.
    assert page.locator("#tier-usage").inner_text() == "\u2013"
    assert page.locator("#resident-adapters").inner_text() == "\u2013"
    done = threading.Event()

    def request() -> int:
        """Stream an answer that cannot end by itself until the test is done watching, whatever
        the machine's speed; then leave (which aborts it)."""
        body = {
            "messages": [{"role": "user", "content": "Count to fifty."}],
            "max_tokens": UNFINISHABLE,
            "min_tokens": UNFINISHABLE,
            "stream": True,
        }
        with httpx.stream(
            "POST", gateway.url + "/v1/chat/completions", json=body, timeout=TIMEOUT
        ) as response:
            assert response.status_code == 200, response.read()
            for events, _ in enumerate(response.iter_lines()):
                if done.is_set():
                    return events
        raise AssertionError("the answer ended before the test was done watching it")

    with ThreadPoolExecutor(2) as pool:
        results = [pool.submit(request) for _ in range(2)]
        try:
            wait_until(
                page,
                """() => {
                    const number = (id) => parseFloat(document.getElementById(id).textContent);
                    return number('running') > 0 && number('generation-tps') > 0
                        && number('kv-cache') > 0 && number('steps') > 0;
                }""",
            )
            # Drawn, not only written: the tokens chart's line (its first series' colour) rises
            # above the zero line it follows while nothing is generated (18 px from the bottom).
            wait_until(
                page,
                """() => {
                    const canvas = document.getElementById('chart-tokens');
                    const zeroRow = canvas.height - 18 * window.devicePixelRatio;
                    const pixels = canvas.getContext('2d')
                        .getImageData(0, 0, canvas.width, zeroRow - 4).data;
                    for (let i = 0; i < pixels.length; i += 4) {
                        const distance = Math.abs(pixels[i] - 47) + Math.abs(pixels[i + 1] - 126)
                            + Math.abs(pixels[i + 2] - 216);
                        if (distance < 30 && pixels[i + 3] > 200) {
                            return true;
                        }
                    }
                    return false;
                }""",
            )
            assert "forward" in page.locator('.legend[data-for="chart-phases"]').inner_text()
            tab.screenshot("dashboard.png")
        finally:
            done.set()
        assert all(r.result() > 0 for r in results)
    wait_until(
        page,
        "document.getElementById('running').textContent === '0'"
        " && document.getElementById('generation-tps').textContent === '0'",
    )
    assert tab.errors == []


def read_events(response: httpx.Response, count: int) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(json.loads(line.removeprefix("data: ")))
            if len(events) == count:
                return events
    raise AssertionError(f"the feed ended after {len(events)} events")


def test_the_feed_sends_the_engine_numbers(gateway):
    with httpx.stream("GET", gateway.url + "/dashboard/feed", timeout=TIMEOUT) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = read_events(response, 3)
    for sample in events:
        assert set(sample) == FEED_FIELDS
        assert sample["engine_up"] is True
        assert sample["num_kv_blocks"] == 512  # ENGINE_ARGS
        assert 0 <= sample["kv_cache_usage"] <= 1 and sample["interval"] > 0
    assert events[0]["time"] < events[1]["time"] < events[2]["time"]


def stats(**fields) -> engine_pb2.GetStatsResponse:
    return engine_pb2.GetStatsResponse(num_kv_blocks=100, **fields)


def test_a_sample_is_the_change_over_its_interval():
    before = Reading(
        10.0,
        generation_tokens=100,
        prompt_tokens=40,
        stats=stats(
            prefix_cache_queries=64,
            prefix_cache_hits=16,
            num_steps=10,
            step_seconds={"forward": 1.0, "sample": 0.5},
            spec_num_draft_tokens=40,
            spec_num_accepted_tokens=10,
            kv_tier_hits={"host": 32, "disk": 16},
            kv_tier_usage={"host": 0.5, "disk": 0.1},
            lora_requests={"sql": 3, "chat": 5, "idle": 1},
            resident_lora_adapters=["sql", "chat"],
        ),
    )
    after = Reading(
        10.5,
        generation_tokens=130,
        prompt_tokens=60,
        stats=stats(
            num_running=3,
            num_waiting=1,
            kv_cache_usage=0.25,
            prefix_cache_queries=96,
            prefix_cache_hits=40,
            num_steps=15,
            step_seconds={"forward": 1.1, "sample": 0.51, "schedule": 0.005},
            spec_num_draft_tokens=60,
            spec_num_accepted_tokens=25,
            kv_tier_hits={"host": 48, "disk": 16},
            kv_tier_usage={"host": 0.75, "disk": 0.125},
            lora_requests={"sql": 7, "chat": 5, "idle": 1, "new": 2},
            resident_lora_adapters=["sql", "new"],
        ),
    )
    sample = dashboard_sample(before, after, wall_time=1234.5).model_dump()
    assert sample.pop("step_phase_ms") == pytest.approx(
        {"forward": 20.0, "sample": 2.0, "schedule": 1.0}
    )
    # Per tier: tokens served over the interval (every tier in use, at 0 if it served none) and
    # the usage now; per adapter: the requests over the interval (only adapters requested in
    # it, one first seen included), and the adapters resident now.
    assert sample.pop("kv_tier_hits") == {"disk": 0, "host": 16}
    assert sample.pop("kv_tier_usage") == {"disk": 0.125, "host": 0.75}
    assert sample.pop("lora_requests") == {"new": 2, "sql": 4}
    assert sample.pop("resident_lora_adapters") == ["new", "sql"]
    assert sample == pytest.approx(
        {
            "time": 1234.5,
            "interval": 0.5,
            "engine_up": True,
            "running": 3,
            "waiting": 1,
            "kv_cache_usage": 0.25,
            "num_kv_blocks": 100,
            "prefix_cache_hit_rate": 24 / 32,
            "draft_acceptance_rate": 15 / 20,
            "generation_tokens_per_second": 60.0,
            "prompt_tokens_per_second": 40.0,
            "steps_per_second": 10.0,
        }
    )
    # No lookups, no steps: no hit rate and no phase times, rather than zeros.
    idle = dashboard_sample(after, Reading(11.0, 130, 60, after.stats), wall_time=1235.0)
    assert idle.prefix_cache_hit_rate is None and idle.step_phase_ms == {}
    assert idle.draft_acceptance_rate is None  # nothing drafted: no rate, rather than 0
    assert idle.generation_tokens_per_second == 0 and idle.steps_per_second == 0
    assert idle.kv_tier_hits == {"disk": 0, "host": 0} and idle.lora_requests == {}
    # An engine that is down has no numbers; one that restarted has no rates yet.
    down = dashboard_sample(after, Reading(11.0, 130, 60, None), wall_time=1235.0)
    assert (down.engine_up, down.running, down.kv_cache_usage) == (False, None, None)
    assert (down.kv_tier_hits, down.kv_tier_usage, down.lora_requests) == ({}, {}, {})
    assert down.resident_lora_adapters == []
    restarted_stats = stats(
        num_steps=2, kv_tier_hits={"host": 8}, lora_requests={"sql": 1}, kv_tier_usage={"host": 0}
    )
    restarted = dashboard_sample(after, Reading(11.0, 130, 60, restarted_stats), 1235.0)
    assert restarted.steps_per_second == 0 and restarted.step_phase_ms == {}
    assert restarted.kv_tier_hits == {"host": 0} and restarted.lora_requests == {}


@pytest.fixture(scope="module")
def protected(services):
    server = start_gateway(services, api_keys=(KEY,), protect_health_metrics=True)
    yield server
    server.close()


def first_event(http: httpx.Client, route: str, **request) -> dict:
    with http.stream("GET", route, **request) as response:
        assert response.status_code == 200, response.read()
        return read_events(response, 1)[0]


def test_the_feed_is_protected_as_metrics_is(services, protected):
    with httpx.Client(base_url=protected.url, timeout=TIMEOUT) as http:
        check_error(http.get("/dashboard/feed"), 401, None)
        check_error(http.get("/dashboard/feed", params={"api_key": "wrong"}), 401, None)
        for request in (
            {"headers": {"Authorization": f"Bearer {KEY}"}},
            {"params": {"api_key": KEY}},
            {"headers": {"Cookie": f"folio_api_key={KEY}"}},
        ):
            assert set(first_event(http, "/dashboard/feed", **request)) == FEED_FIELDS
        # The key in a URL or a cookie counts for the feed only.
        check_error(http.get("/metrics", params={"api_key": KEY}), 401, None)
        check_error(http.get("/v1/models", headers={"Cookie": f"folio_api_key={KEY}"}), 401, None)
        # The pages and their files are open; the API they call is not.
        for path in ("/", "/dashboard", "/webui/playground.js", "/webui/style.css"):
            response = http.get(path)
            assert response.status_code == 200, path
            assert response.headers["content-security-policy"].startswith("default-src 'self'")
        check_error(http.get("/v1/models"), 401, None)
    # With keys but without --protect-health-metrics, the feed is open, as /metrics is.
    open_feed = start_gateway(services, api_keys=(KEY,))
    try:
        with httpx.Client(base_url=open_feed.url, timeout=TIMEOUT) as http:
            assert set(first_event(http, "/dashboard/feed")) == FEED_FIELDS
            check_error(http.get("/v1/models"), 401, None)
    finally:
        open_feed.close()


def test_the_pages_ask_for_a_key_when_the_server_wants_one(browser, protected):
    tab = Tab(browser)
    try:
        page = tab.page
        page.goto(protected.url + "/")
        key_field = page.get_by_label("API key")
        key_field.wait_for()
        page.get_by_label("Max tokens").fill("2")
        send(page, "Hi")
        # Refused: the message is given back to be sent once there is a key. Sending clears the
        # box at once; it is filled again only when the 401 arrives, so this waits for it.
        expect(page.get_by_role("textbox", name="Message")).to_have_value(
            "Hi", timeout=TIMEOUT * 1000
        )
        key_field.fill(KEY)
        page.get_by_role("button", name="Use key").click()
        answer, stats = last_answer(page)
        assert answer and int(stats["tokens"]) > 0
        assert page.evaluate("sessionStorage.getItem('folio.apiKey')") == KEY
        # The same tab's dashboard has the key too (its feed takes it from a cookie).
        page.goto(protected.url + "/dashboard")
        wait_until(page, "Number(document.body.dataset.samples) >= 1")
    finally:
        tab.context.close()
    tab = Tab(browser)
    try:
        page = tab.page
        page.goto(protected.url + "/dashboard")
        page.get_by_label("API key").fill(KEY)
        page.get_by_role("button", name="Use key").click()
        wait_until(page, "Number(document.body.dataset.samples) >= 1")
        assert page.get_by_label("API key").is_hidden()
    finally:
        tab.context.close()


def test_the_feed_ends_when_the_gateway_drains(services):
    server = start_gateway(services)
    closing = threading.Thread(target=server.close)
    with httpx.stream("GET", server.url + "/dashboard/feed", timeout=TIMEOUT) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        closing.start()
        # The stream ends as a stream does (a cut connection would raise here), not by the
        # server giving up on it at the end of its grace period.
        for _ in lines:
            pass
    closing.join(TIMEOUT)
    assert not closing.is_alive()


def test_no_webui_turns_the_pages_off(services):
    server = start_gateway(services, webui=False)
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            for path in ("/", "/dashboard", "/dashboard/feed", "/webui/playground.js"):
                check_error(http.get(path), 404, None)
            assert http.get("/health").status_code == 200
            assert "/dashboard/feed" not in http.get("/openapi.json").json()["paths"]
    finally:
        server.close()


def test_the_no_webui_flag_reaches_the_gateway():
    for flags, webui in (([], True), (["--no-webui"], False)):
        args = build_parser().parse_args(["serve", *flags])
        gateway = Supervisor(from_args(ServeConfig, args)).gateway
        parsed = build_parser().parse_args(gateway.args)
        assert from_args(GatewayServerConfig, parsed).front.policy.webui is webui
