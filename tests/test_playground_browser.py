"""The playground (service/static/index.html) in a real browser: headless Chromium driven by Selenium
against a real TTSServer (tiny model). Skipped where `selenium`, `chromium` or `chromedriver` is missing
(.ci/run installs Debian's chromium and chromium-driver). Waits are on the page's own state, never on time."""

from __future__ import annotations

import shutil

import pytest

from service.access import Access
from service.server import ServiceLimits
from tts.checkpoints.load import load_bundle

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402
from service_helpers import ServerThread  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None, reason="chromium and chromedriver not installed"
)
KEY = "browser-key"
# The test's budget: a fixed frame count and greedy sampling (fields the page does not send itself).
BUDGET = """
const send = window.fetch;
window.fetch = (url, init) => {
  if (init && typeof init.body === "string") {
    const b = JSON.parse(init.body);
    Object.assign(b, { max_new_frames: 12, min_new_frames: 12, temperature: 0, seed: 3 });
    init = { ...init, body: JSON.stringify(b) };
  }
  return send(url, init);
};
"""


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("tiny")


def start(bundle, **access) -> ServerThread:
    limits = ServiceLimits(max_waiting=4, voices_dir=None)
    return ServerThread(bundle, limits=limits, http_port=0, access=Access(**access))


@pytest.fixture(scope="module")
def server(bundle):
    srv = start(bundle)
    yield srv
    srv.stop()


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--autoplay-policy=no-user-gesture-required", "--window-size=900,1000"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def wait(driver, condition, what: str, timeout: float = 60):
    WebDriverWait(driver, timeout).until(lambda d: condition(d), message=what)


def open_page(driver, srv):
    driver.get(f"http://127.0.0.1:{srv.server.http_port}/")
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#voice option")) > 1, "the voice list")


def test_speak_plays_the_audio_and_shows_warnings_and_the_finish_reason(server, browser):
    open_page(browser, server)
    assert "pcm" not in [o.text for o in Select(browser.find_element(By.ID, "format")).options]
    assert not browser.find_element(By.ID, "format").is_enabled()  # play while generating: PCM on the wire
    browser.find_element(By.ID, "stream").click()  # off: the chosen format in the audio element
    assert browser.find_element(By.ID, "format").is_enabled()
    Select(browser.find_element(By.ID, "format")).select_by_visible_text("wav")
    text = browser.find_element(By.ID, "text")
    text.clear()
    text.send_keys("Hello 你好世界 world.")  # the tiny model reads English only: a warning
    assert browser.find_element(By.ID, "bytes").text.startswith("25 / 20,000 bytes")
    browser.execute_script(BUDGET)
    browser.execute_script(
        "window.played = false; document.getElementById('player')"
        ".addEventListener('playing', () => { window.played = true; });"
    )
    browser.find_element(By.ID, "speak").click()
    wait(
        browser,
        lambda d: (
            d.find_element(By.ID, "status").text.startswith("done in") or d.find_element(By.ID, "error").text
        ),
        "the request",
    )
    assert browser.find_element(By.ID, "error").text == ""
    status = browser.find_element(By.ID, "status").text
    assert "finish length" in status, status  # (exactly 12 frames: max_new_frames ended it)
    warnings = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#warnings li")]
    assert any("reads English only" in w for w in warnings), warnings
    wait(browser, lambda d: d.execute_script("return window.played"), "the audio element playing")
    duration = browser.execute_script("return document.getElementById('player').duration")
    assert duration == pytest.approx(12 * 640 / 16000, abs=0.01)  # 12 frames of 640 samples at 16 kHz
    wait(
        browser,
        lambda d: d.execute_script("return document.getElementById('player').currentTime") > 0,
        "playback",
    )
    browser.find_element(By.ID, "stop").click()  # (enabled while there is audio to stop)
    assert browser.execute_script("return document.getElementById('player').getAttribute('src')") is None
    assert not browser.find_element(By.ID, "download").is_displayed()
    assert not browser.find_element(By.ID, "stop").is_enabled()


def test_the_byte_counter_disables_speak_over_the_limit(server, browser):
    open_page(browser, server)
    limit = server.server.limits.max_text_bytes
    browser.execute_script(
        "const t = document.getElementById('text'); t.value = 'é'.repeat(arguments[0]);"
        " t.dispatchEvent(new Event('input'));",
        limit // 2 + 1,
    )
    assert "over" in browser.find_element(By.ID, "bytes").get_attribute("class")
    assert not browser.find_element(By.ID, "speak").is_enabled()


def test_the_page_asks_for_the_api_key_once_and_sends_it(bundle, browser):
    srv = start(bundle, api_keys=(KEY,))
    try:
        browser.get(f"http://127.0.0.1:{srv.server.http_port}/")

        def prompt_open(d):
            try:
                return d.switch_to.alert
            except NoAlertPresentException:
                return False

        wait(browser, prompt_open, "the key prompt")
        alert = browser.switch_to.alert
        alert.send_keys(KEY)
        alert.accept()
        wait(
            browser,
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#voice option")) > 1,
            "the voices, with the key",
        )
        assert browser.execute_script("return sessionStorage.getItem('tts-api-key')") == KEY
        browser.refresh()  # the key is kept for the tab: no second prompt
        wait(
            browser,
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#voice option")) > 1,
            "the voices after a reload",
        )
        assert prompt_open(browser) is False
    finally:
        srv.stop()


def speak_and_wait(driver):
    driver.execute_script(BUDGET)
    driver.find_element(By.ID, "speak").click()
    wait(
        driver,
        lambda d: (
            d.find_element(By.ID, "status").text.startswith("done in") or d.find_element(By.ID, "error").text
        ),
        "the request",
    )
    assert driver.find_element(By.ID, "error").text == ""
    return driver.find_element(By.ID, "status").text


def test_play_while_generating_reports_the_finish_and_offers_a_wav(server, browser):
    open_page(browser, server)
    assert browser.find_element(By.ID, "stream").is_selected()
    status = speak_and_wait(browser)
    assert "s of audio" in status and "finish length" in status, status
    assert browser.find_element(By.ID, "download").get_attribute("download") == "speech.wav"
    assert browser.find_elements(By.CSS_SELECTOR, "#warnings li") == []  # plain English: no warning


def test_a_voice_uploaded_through_the_page_is_listed_and_chosen(server, browser, tmp_path):
    from test_http import tone_wav

    clip = tmp_path / "clip.wav"
    clip.write_bytes(tone_wav())
    open_page(browser, server)
    browser.find_element(By.ID, "voice-name").send_keys("page-voice")
    browser.find_element(By.ID, "voice-text").send_keys("A tone.")
    browser.find_element(By.ID, "voice-file").send_keys(str(clip))
    browser.find_element(By.ID, "voice-add").click()
    wait(
        browser,
        lambda d: d.find_element(By.ID, "voice-status").text or d.find_element(By.ID, "voice-error").text,
        "the upload",
    )
    assert browser.find_element(By.ID, "voice-error").text == ""
    assert browser.find_element(By.ID, "voice-status").text.startswith("added page-voice")
    assert (
        Select(browser.find_element(By.ID, "voice")).first_selected_option.get_attribute("value")
        == "page-voice"
    )
    server.loop.delete_voice("page-voice")
