"""The operator's page (``GET /``) in a real headless browser against the real server: per-rank load
progress while a slowed load runs, the group table, live figures, a streamed chat answer, the
API-key prompt. Chromium from the system's packages, driven by Playwright's Python package (no
browser download); skipped, saying why, where either is missing.

``HSDP_UI_SCREENSHOTS=DIR`` (opt-in, never in CI) writes loading.png and serving.png there, serving
the real-weights default model so that the chat reads as text: docs/api.md's two pictures come from
``HSDP_UI_SCREENSHOTS=server/http/ui/screenshots pytest tests/test_ui.py -k load``.
"""

import os
import shutil
import time

import httpx
import pytest

from tests.checkpoints import write_checkpoint
from tests.server_process import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium; .ci/run does "
                                                "where it can)"),
    pytest.mark.slow,
]
KEY = "ui-test-key"
SHOTS = os.environ.get("HSDP_UI_SCREENSHOTS")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a test dependency")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ui") / "llama", "llama")


def _wait_http(server, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log_tail()
        try:
            if httpx.get(server.url + "/", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(server.log_tail())


def _ask(page, prompt: str, max_tokens: int, until: str) -> None:
    """Send ``prompt`` greedily from the page's chat; return once the answer's figures show ``until``."""
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_function("document.querySelector('#messages .stats') && "
                           f"document.querySelector('#messages .stats').textContent.includes('{until}')",
                           timeout=60000)


def test_the_page_shows_the_load_the_group_and_a_streamed_answer(browser, model_dir, tmp_path):
    if SHOTS:  # the default model (real weights, 272 tensors), for pictures worth looking at
        server = ServerProcess(None, log_path=tmp_path / "log", extra_args=("--dtype", "float32"),
                               env={"HSDP_INJECT_LOAD_DELAY": "0.02"})
    else:
        server = ServerProcess(model_dir, log_path=tmp_path / "log", env={"HSDP_INJECT_LOAD_DELAY": "0.15"})
    try:
        _wait_http(server)
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.goto(server.url + "/")
        seen: dict[int, set] = {0: set(), 1: set()}
        deadline = time.monotonic() + 120
        while page.inner_text("#phase") not in ("ready",) and time.monotonic() < deadline:
            for rank in (0, 1):
                bar = page.query_selector(f"#load-rank-{rank} progress")
                if bar is not None:
                    seen[rank].add(float(bar.get_attribute("value") or bar.evaluate("b => b.value")))
            if SHOTS and len(seen[0]) == 6:
                page.screenshot(path=os.path.join(SHOTS, "loading.png"))
            time.sleep(0.1)
        assert page.inner_text("#phase") == "ready", server.log_tail()
        assert all(len(values) >= 3 for values in seen.values()), seen  # both ranks' bars moved
        page.wait_for_function("document.querySelectorAll('#ranks tbody tr').length == 2", timeout=20000)
        cells = page.eval_on_selector_all("#ranks tbody tr", "rows => rows.map(r => r.cells[0].textContent)")
        assert cells == ["0", "1"]
        assert "1 x 2" in page.inner_text("#mesh")
        assert page.inner_text("#weights").startswith("weights "), page.inner_text("#weights")  # the version served
        # the live figures are up before the chat: two scrapes of /metrics make a rate, 0 while idle
        page.wait_for_function("document.getElementById('tps').textContent === '0.0'", timeout=20000)
        # a chat answer streams in, with its figures
        _ask(page, "What is the capital of France?", 24, until="tokens/s")
        assert page.inner_text("#messages .assistant").strip(), page.inner_text("#messages")
        assert "error" not in page.inner_text("#messages .stats")
        # the live figures count what was just generated: a scrape after the answer shows a rate
        page.wait_for_function("parseFloat(document.getElementById('tps').textContent) > 0", timeout=20000)
        assert page.is_visible("#c-tps") and page.inner_text("#load")
        if SHOTS:
            page.screenshot(path=os.path.join(SHOTS, "serving.png"), full_page=True)
        page.close()
    finally:
        server.stop()


def test_the_page_asks_for_the_key_and_post_slash_stays_guarded(browser, model_dir, tmp_path):
    with ServerProcess(model_dir, log_path=tmp_path / "log", extra_args=("--api-key", KEY)) as server:
        assert httpx.get(server.url + "/").status_code == 200  # the page and its assets: open
        assert httpx.get(server.url + "/ui/app.js").status_code == 200
        assert httpx.post(server.url + "/", json={"inputs": "x"}).status_code == 401  # TGI's compat route: guarded
        assert httpx.get(server.url + "/info").status_code == 401
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#key-box:not([hidden])", timeout=20000)
        page.fill("#key", "wrong")
        page.click("#key-form button")
        page.wait_for_function("document.getElementById('key-error').textContent.includes('refused')", timeout=20000)
        page.fill("#key", KEY)
        page.click("#key-form button")
        page.wait_for_function("document.querySelectorAll('#ranks tbody tr').length == 2", timeout=20000)
        assert page.is_hidden("#key-box")
        # kept for this tab only
        assert page.evaluate("sessionStorage.getItem('hsdp-api-key')") == KEY
        assert page.evaluate("localStorage.length") == 0
        page.close()


def test_the_chat_takes_an_image_and_shows_it_beside_the_answer(browser, tmp_path):
    from tests.vision_checkpoints import make_image, reference_vlm_generate, write_llava_checkpoint

    path = write_llava_checkpoint(tmp_path / "llava")
    picture = tmp_path / "picture.png"
    make_image(11).save(picture)
    from PIL import Image

    want = reference_vlm_generate(path, [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                         "text": "What is it?"}]}],
                                  [Image.open(picture).convert("RGB")], 8)
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(path).decode(want, skip_special_tokens=True)
    with ServerProcess(path, log_path=tmp_path / "log") as server:
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#image-row:not([hidden])", timeout=20000)  # /info says it takes images
        page.set_input_files("#image", str(picture))
        page.wait_for_selector("#image-preview:not([hidden])", timeout=20000)
        _ask(page, "What is it?", 8, until="chunks")
        assert page.eval_on_selector("#messages .user img", "img => img.src").startswith("data:image/png;base64,")
        assert page.inner_text("#messages .assistant") == text
        assert page.is_hidden("#image-preview")  # the next question starts without it
        page.close()
