"""The page at /, in a real browser: headless Chromium from Debian's `chromium` package (`make install-test`
installs it where missing), driven by playwright (its Python package only: no browser download). With the
embedded model, behind an API key: the key asked for, a chat message, its answer streamed, then the view inside
it: the logit lens grid, an attention map, the time. Screenshots go to the test's tmp dir, or to
SMOLLM2_SCREENSHOTS (the README's: docs/)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from smollm2 import Tokenizer
from smollm2.sae import save_sae
from smollm2.server import create_app, inspect
from test_inspect import COUNTRIES, countries_dictionary, random_transcoder
from test_server import running

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `make install-test` installs Debian's "
                                                          "chromium package where apt-get can")]


@pytest.fixture
def browser_page():
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])  # root in CI
        try:
            yield browser.new_page(viewport={"width": 1480, "height": 900}, device_scale_factor=1)
        finally:
            browser.close()


def test_the_page_chats_and_shows_inside_the_model(model, browser_page, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the machine's measurement, kept there
    shots = Path(os.environ.get("SMOLLM2_SCREENSHOTS", tmp_path))
    page, layers = browser_page, model.config.num_hidden_layers
    tokenizer = Tokenizer.from_pretrained()
    with running(create_app(model, tokenizer, api_key="secret")) as url:
        page.goto(url)  # the page itself needs no key; it asks for the key its API calls need
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key", "secret")
        page.click("#key-dialog button")
        page.wait_for_selector("#model option", state="attached")
        assert page.inner_text("#status").startswith(f"{layers} layers")
        # Every change of the answer's text, as it streams.
        page.evaluate("""window.updates = 0;
            new MutationObserver((changes) => window.updates += changes.length).observe(
                document.getElementById('messages'), {subtree: true, childList: true, characterData: true})""")
        # Greedy, for an answer the test can know (the page starts at `smollm2 chat`'s 0.2 and top-p 0.9).
        page.evaluate("""const t = document.getElementById('temperature');
            t.value = '0'; t.dispatchEvent(new Event('input'))""")
        page.fill("#input", "What is the capital of France?")
        page.press("#input", "Enter")
        page.wait_for_selector(".message.assistant:not(.streaming) .actions button", timeout=120_000)
        answer = page.inner_text(".message.assistant .body")
        assert "Paris" in answer
        assert page.evaluate("window.updates") > 5  # streamed: the text grew token by token
        assert page.locator(".message.assistant .body .tok").count() > 3  # each token a span, shaded
        page.hover(".message.assistant .body .tok >> nth=2")
        assert "%" in page.inner_text("#tooltip")  # the token's probability and its alternatives
        page.screenshot(path=shots / "chat.png")

        page.click(".message.assistant .actions button")  # Inspect
        page.wait_for_selector("#token-strip .tok", timeout=120_000)
        tokens = page.locator("#token-strip .tok").count()
        page.click("#tabs button[data-tab=lens]")
        assert page.locator("table.lens tbody tr").count() == layers + 1
        assert page.locator("table.lens tbody td").count() == (layers + 1) * tokens
        assert page.locator("table.lens tbody tr >> nth=0 >> td.next").count() > tokens // 2  # the output row
        page.click("#tabs button[data-tab=attention]")
        page.wait_for_selector("#attention-strip .tok", timeout=120_000)
        painted = page.evaluate("""() => { const c = document.getElementById('attention-map');
            const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const colors = new Set(); for (let i = 0; i < data.length; i += 4) colors.add(data[i + 3] + ',' + data[i]);
            return [c.width, colors.size]; }""")
        assert painted[0] >= tokens and painted[1] > 10  # a heat map, not a blank canvas
        page.select_option("#attention-layer", "3")
        page.wait_for_function("!document.querySelector('#attention-strip .loading')", timeout=120_000)
        page.screenshot(path=shots / "attention.png")

        page.fill("#input", "The capital of France is")
        page.click("#inspect-input")
        page.wait_for_function("document.querySelectorAll('#token-strip .tok').length === 5", timeout=120_000)
        page.click("#tabs button[data-tab=lens]")
        assert page.inner_text("table.lens tbody tr >> nth=0 >> td >> nth=-1").strip() == "Paris"
        page.screenshot(path=shots / "logit-lens.png")

        page.click("#tabs button[data-tab=time]")
        page.wait_for_selector("table.ops", timeout=120_000)
        assert page.locator("table.ops").count() == 2 and "GB/s" in page.inner_text(".time-summary")
        page.screenshot(path=shots / "time.png", full_page=True)


def test_the_page_shows_features_and_an_attribution_graph(model, browser_page, tmp_path):
    """With dictionaries served (the README's countries at block 27, and 30 random transcoders): the Features view
    of "The capital of France is" (each token's strongest features; the France feature at ` is`, its activation at
    every token and the tokens it promotes), then the Graph view (its nodes by block and position, the ` Paris`
    logit among the targets, the JSON to download)."""
    shots = Path(os.environ.get("SMOLLM2_SCREENSHOTS", tmp_path))
    page, tokenizer = browser_page, Tokenizer.from_pretrained()
    sources = [str(save_sae(countries_dictionary(model, tokenizer), tmp_path / "countries"))]
    generator = torch.Generator().manual_seed(0)
    for layer in range(model.config.num_hidden_layers):
        save_sae(random_transcoder(layer, generator), tmp_path / "transcoders" / f"mlp{layer:02d}")
    sources.append(str(tmp_path / "transcoders"))
    app = create_app(model, tokenizer)
    inspect.serve_dictionaries(app, sources)
    with running(app) as url:
        page.goto(url)
        page.wait_for_selector("#tabs [data-tab=graph]:not([hidden])", state="attached")
        page.fill("#input", "The capital of France is")
        page.click("#inspect-input")
        page.wait_for_function("document.querySelectorAll('#token-strip .tok').length === 5", timeout=120_000)
        page.click("#tabs button[data-tab=features]")
        page.wait_for_selector("table.features tr >> nth=4", timeout=120_000)
        assert page.locator("table.features tr").count() == 5
        last = page.locator("table.features tr >> nth=4 >> .feature")
        assert last.count() >= 1 and last.nth(0).inner_text().startswith(f"#{COUNTRIES.index('France')} ")
        last.nth(0).click()
        page.wait_for_selector("#feature-detail .effects", timeout=120_000)
        assert page.locator("#feature-detail .strip .tok").count() == 5
        assert "Paris" in page.inner_text("#feature-detail .effects > div >> nth=0")  # France's feature promotes it
        page.screenshot(path=shots / "features.png")

        page.click("#tabs button[data-tab=graph]")
        page.fill("#graph-features", "48")
        page.click("#graph-build")
        page.wait_for_selector("svg.graph", timeout=180_000)
        assert page.locator("svg.graph .nodes .logit").count() >= 1
        assert page.locator("svg.graph .nodes .feature").count() >= 1
        assert page.locator("svg.graph .edges line").count() >= 10
        assert "Paris" in page.text_content("svg.graph")
        assert page.get_attribute("#graph-download", "href").startswith("blob:")
        page.hover("svg.graph .nodes .logit >> nth=0")
        assert "strongest inputs" in page.inner_text("#tooltip")
        page.screenshot(path=shots / "graph.png")
