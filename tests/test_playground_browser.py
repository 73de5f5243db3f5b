"""The playground (service/static/index.html) in a real browser: headless Chromium driven by Selenium
against a real TTSServer (tiny model). Skipped where `selenium`, `chromium` or `chromedriver` is missing
(.ci/run installs Debian's chromium and chromium-driver). Waits are on the page's own state, never on time."""

from __future__ import annotations

import shutil
import time

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


# ---- the live mode ("type as it speaks", service/static/live.js) ------------------------------------------

LIVE_FRAMES = 20  # frames per text chunk (max_new_tokens); the end token is held off: exactly that many
FRAME_SAMPLES = 640  # the tiny model's codec: 640 samples per frame at 16 kHz
# Records what the page does through the browser's own objects: the events it sends (the start request
# gets the test's frame budget), the events it receives (decoded with the page's own fishUnpack), every
# audio buffer it schedules (and whether it played out or was stopped), its AudioContext, its animation
# frames and which word indices gain the classes "on" (heard now) and "heard" (played), in order.
LIVE_HOOK = """
const rec = window.rec = { sent: [], got: [], sockets: [], sources: [], contexts: [], marks: [],
                           raf: 0, rafMax: 0, holdClose: false, held: [], hold: false };
// While rec.hold, the page's AudioContext stays suspended: what it schedules waits (holdAudio / playAudio).
const Context = window.AudioContext;
window.AudioContext = class extends Context {
  constructor(...a) { super(...a); rec.contexts.push(this); if (rec.hold) this.suspend(); }
  resume() { return rec.hold ? Promise.resolve() : super.resume(); }
};
rec.holdAudio = () => { rec.hold = true; return Promise.all(rec.contexts.map((c) => c.suspend())); };
rec.playAudio = () => { rec.hold = false; return Promise.all(rec.contexts.map((c) => c.resume())); };
const Socket = window.WebSocket;
window.WebSocket = class extends Socket {
  constructor(...a) {
    super(...a);
    rec.sockets.push(this);
    this.addEventListener("message", (m) => {
      if (typeof m.data !== "string") rec.got.push(fishUnpack(m.data));
    });
    // The page's onclose, run at once or, while rec.holdClose, when the test says (a close reported late).
    super.onclose = (e) => {
      const run = () => { if (this.pageOnclose) this.pageOnclose(e); };
      if (rec.holdClose) rec.held.push(run); else run();
    };
  }
  get onclose() { return this.pageOnclose; }
  set onclose(f) { this.pageOnclose = f; }
  send(data) {
    const event = JSON.parse(data);
    if (event.event === "start") event.request.max_new_tokens = FRAMES;
    rec.sent.push(event);
    return super.send(JSON.stringify(event));
  }
};
const start = AudioBufferSourceNode.prototype.start, stop = AudioBufferSourceNode.prototype.stop;
AudioBufferSourceNode.prototype.start = function (when = 0) {
  const b = this.buffer;
  const r = { when, end: when + b.duration, samples: b.length, rate: b.sampleRate };
  r.ended = r.stopped = false;
  this.rec = r;
  rec.sources.push(r);
  this.addEventListener("ended", () => { r.ended = true; });
  return start.call(this, when);
};
AudioBufferSourceNode.prototype.stop = function (...a) {
  if (this.rec) this.rec.stopped = true;
  return stop.apply(this, a);
};
const frame = rec.frame = window.requestAnimationFrame.bind(window);
window.requestAnimationFrame = (f) => {
  rec.raf += 1; rec.rafMax = Math.max(rec.rafMax, rec.raf);
  return frame((t) => { rec.raf -= 1; f(t); });
};
new MutationObserver((records) => {
  // each record's new class is the next record's old one for that element (or its class now)
  const after = new Map(), rows = [];
  for (const m of [...records].reverse()) {
    const now = after.get(m.target) ?? m.target.className;
    rows.push([m.target, (m.oldValue || "").split(" "), now.split(" ")]);
    after.set(m.target, m.oldValue || "");
  }
  for (const [el, before, now] of rows.reverse()) {
    const i = el.parentNode ? [...el.parentNode.children].indexOf(el) : -1;
    for (const c of ["on", "heard"]) if (now.includes(c) && !before.includes(c)) rec.marks.push([c, i]);
  }
}).observe(document.getElementById("live-words"),
           { subtree: true, attributes: true, attributeFilter: ["class"], attributeOldValue: true });
"""


@pytest.fixture(scope="module")
def live_server(bundle):
    """A server whose model never samples its end token: every chunk is exactly LIVE_FRAMES frames."""
    from service_helpers import EndTokenNever

    from tts.engine import model_runner

    mp = pytest.MonkeyPatch()
    mp.setattr(model_runner, "F", EndTokenNever())
    srv = start(bundle)
    yield srv
    srv.stop()
    mp.undo()


def open_live(driver, srv):
    open_page(driver, srv)
    driver.execute_script(f"const FRAMES = {LIVE_FRAMES};" + LIVE_HOOK)
    wps = driver.find_element(By.ID, "live-wps")
    wps.clear()
    wps.send_keys("20")  # (the fastest: the test waits less)


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def live_status(driver) -> str:
    return driver.find_element(By.ID, "live-status").text


def start_live(driver):
    driver.find_element(By.ID, "live-start").click()
    wait(driver, lambda d: live_status(d) == "live: type or paste", "the live session to open")
    assert not driver.find_element(By.ID, "live-start").is_enabled()
    assert driver.find_element(By.ID, "live-stop").is_enabled()


def marks(driver) -> dict[str, int]:
    """How many of each record the page has made so far."""
    return js(
        driver,
        "return Object.fromEntries(['sent', 'got', 'sources', 'marks'].map((k) => [k, rec[k].length]))",
    )


def sent_text(driver, since: int = 0) -> str:
    return "".join(e["text"] for e in js(driver, "return rec.sent")[since:] if e["event"] == "text")


def hold_audio(driver) -> None:
    """Suspends the page's audio (what it schedules waits) until play_audio."""
    driver.execute_async_script("rec.holdAudio().then(() => arguments[0]());")


def play_audio(driver) -> None:
    driver.execute_async_script("rec.playAudio().then(() => arguments[0]());")


def speak_live(driver, text: str) -> dict[str, int]:
    """Types `text` into the live box of an open session, waits until every word but the last (held until
    a space follows it) was sent a word at a time, then presses Finish and waits for the session's end.
    The audio is held until then: every word's timing is known before it is heard, however fast the
    model. Returns where this utterance's records start (`marks`)."""
    hold_audio(driver)
    first = marks(driver)
    first_sent = len(js(driver, "return rec.sent"))
    driver.find_element(By.ID, "live-text").send_keys(text)
    head = text[: text.rindex(" ") + 1]
    wait(driver, lambda d: sent_text(d, first_sent) == head, "the typed words to be sent")
    pieces = [e["text"] for e in js(driver, "return rec.sent")[first_sent:]]
    assert [p.strip() for p in pieces] == head.split(), pieces  # a word at a time
    driver.find_element(By.ID, "live-finish").click()
    wait(driver, lambda d: live_status(d) == "finished" or live_status(d).startswith("error"), "the finish")
    assert live_status(driver) == "finished"
    assert sent_text(driver, first_sent) == text  # the last word went with Finish
    assert [e["event"] for e in js(driver, "return rec.sent")[-2:]] == ["flush", "stop"]
    play_audio(driver)
    return first


def sessions_freed(srv) -> None:
    deadline = time.monotonic() + 30
    while srv.loop.sessions_open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.loop.sessions_open == 0


def check_played(driver, first: dict[str, int], text: str) -> None:
    """Every buffer of the utterance played out at the model's rate, every received sample was played,
    and every word is shown, heard in text order. first: where the utterance's records start."""
    wait(
        driver,
        lambda d: js(d, "return rec.sources.slice(arguments[0]).every((s) => s.ended)", first["sources"]),
        "the audio to play out",
    )
    # one animation loop at a time, ended (after its last frame) once everything is heard and the session over
    wait(driver, lambda d: js(d, "return rec.raf") == 0, "the page to stop drawing")
    assert js(driver, "return rec.rafMax") == 1
    sources = js(driver, "return rec.sources")[first["sources"] :]
    assert sources and {s["rate"] for s in sources} == {16000}
    played = sum(s["samples"] for s in sources)
    got = [e for e in js(driver, "return rec.got")[first["got"] :] if e["event"] == "audio"]
    chunks = {e["chunk_seq"] for e in got}
    assert played == len(chunks) * LIVE_FRAMES * FRAME_SAMPLES  # every frame of every chunk, once
    assert driver.find_element(By.ID, "live-audio").text == f"{played / 16000:.2f} s of audio received"
    assert js(driver, "return rec.contexts.at(-1).state") == "running"
    words = driver.find_elements(By.CSS_SELECTOR, "#live-words span")
    assert [w.text for w in words] == text.split()
    # all heard, none still lit, once playback is over
    assert [w.get_attribute("class") for w in words] == ["heard"] * len(words)
    shown = js(driver, "return rec.marks")[first["marks"] :]
    lit = [i for c, i in shown if c == "on"]
    assert lit and lit == sorted(lit), shown  # lit while heard, in text order
    assert [i for c, i in shown if c == "heard"] == list(range(len(words))), shown  # up to the last word


TEXT1 = "Hello there, my friend. This is the live mode of the playground."


def test_live_mode_sends_typed_words_plays_the_audio_and_lights_the_words_in_order(live_server, browser):
    open_live(browser, live_server)
    start_live(browser)
    assert js(browser, "return rec.sent[0]")["event"] == "start"
    first = speak_live(browser, "\n" + TEXT1)  # (pasted after a line break: no piece of spaces alone)
    check_played(browser, first, TEXT1)
    sessions_freed(live_server)


# Clicks a button of the live mode in the same task as it finds audio still to be heard (so that there
# is some, whatever the timing); returns how many of the buffers then pending were neither stopped by the
# click nor played out, or null (nothing pending yet: the wait tries again).
CLICK_WHILE_PENDING = """
const t = rec.contexts.at(-1).currentTime;
const pending = rec.sources.filter((s) => s.end > t && !s.ended);
if (!pending.length) return null;
document.getElementById(arguments[0]).click();
return pending.filter((s) => !s.stopped && !s.ended).length;
"""


def click_while_pending(driver, button: str) -> int:
    got: list[int] = []

    def clicked(d) -> bool:
        left = js(d, CLICK_WHILE_PENDING, button)
        if left is not None:
            got.append(left)
        return bool(got)

    wait(driver, clicked, f"audio still to be heard, to press {button}")
    return got[0]


def next_frame(driver) -> None:
    """Returns after the page has drawn two more animation frames."""
    driver.execute_async_script("const done = arguments[0]; rec.frame(() => rec.frame(done));")


def test_live_stop_cancels_the_session_and_its_playback_then_a_second_utterance_works(live_server, browser):
    open_live(browser, live_server)
    start_live(browser)
    # the first sentence is spoken while the session is open (the second is never ended)
    browser.find_element(By.ID, "live-text").send_keys("Hello there, my friend. And then ")
    assert click_while_pending(browser, "live-stop") == 0  # what was still to be heard is stopped
    assert live_status(browser) == "stopped"
    wait(browser, lambda d: js(d, "return rec.sockets[0].readyState") == 3, "the socket to close")
    sessions_freed(live_server)  # the server ended the session
    next_frame(browser)
    assert browser.find_elements(By.CSS_SELECTOR, "#live-words .on") == []  # nothing lit any more
    assert browser.find_element(By.ID, "live-start").is_enabled()
    assert not browser.find_element(By.ID, "live-stop").is_enabled()
    assert not browser.find_element(By.ID, "live-finish").is_enabled()
    start_live(browser)
    first = speak_live(browser, " " + TEXT1)
    check_played(browser, first, TEXT1)
    sessions_freed(live_server)


def test_live_stop_after_finish_cuts_what_is_still_to_be_heard(live_server, browser):
    open_live(browser, live_server)
    start_live(browser)
    speak_live(browser, TEXT1)  # (generated faster than it plays: audio is still to be heard)
    assert click_while_pending(browser, "live-stop") == 0
    next_frame(browser)
    assert browser.find_elements(By.CSS_SELECTOR, "#live-words .on") == []
    assert not browser.find_element(By.ID, "live-stop").is_enabled()
    sessions_freed(live_server)


def test_live_start_again_cuts_the_previous_playback(live_server, browser):
    open_live(browser, live_server)
    start_live(browser)
    speak_live(browser, TEXT1)
    assert click_while_pending(browser, "live-start") == 0  # a new session is not heard over the old one
    wait(browser, lambda d: live_status(d) == "live: type or paste", "the second session to open")
    first = speak_live(browser, " Once more with feeling.")
    check_played(browser, first, "Once more with feeling.")
    sessions_freed(live_server)


def test_live_a_stopped_sessions_close_reported_late_does_not_end_the_next(live_server, browser):
    open_live(browser, live_server)
    js(browser, "rec.holdClose = true;")  # the first socket's close reaches the page only when released
    start_live(browser)
    browser.find_element(By.ID, "live-stop").click()
    start_live(browser)
    wait(browser, lambda d: js(d, "return rec.held.length") == 1, "the first socket to close")
    js(browser, "rec.holdClose = false; for (const run of rec.held.splice(0)) run();")
    assert live_status(browser) == "live: type or paste"  # the second session goes on
    assert not browser.find_element(By.ID, "live-start").is_enabled()
    first = speak_live(browser, "Once more with feeling.")
    check_played(browser, first, "Once more with feeling.")
    sessions_freed(live_server)


def test_live_finish_pressed_twice_ends_the_session_once(live_server, browser):
    open_live(browser, live_server)
    start_live(browser)
    browser.find_element(By.ID, "live-text").send_keys("Hello there, my friend.")
    js(browser, "const f = document.getElementById('live-finish'); f.click(); f.click();")
    assert not browser.find_element(By.ID, "live-finish").is_enabled()
    wait(browser, lambda d: live_status(d) == "finished" or live_status(d).startswith("error"), "the finish")
    assert live_status(browser) == "finished"
    assert [e["event"] for e in js(browser, "return rec.sent")].count("stop") == 1
    sessions_freed(live_server)


def test_live_text_pasted_before_start_is_spoken_and_not_again_by_the_next_session(live_server, browser):
    open_live(browser, live_server)
    browser.find_element(By.ID, "live-text").send_keys(TEXT1)
    first = marks(browser)
    js(browser, "rec.hold = true;")  # (the page's AudioContext, made by Start, starts suspended)
    start_live(browser)
    head = TEXT1[: TEXT1.rindex(" ") + 1]
    wait(browser, lambda d: sent_text(d, first["sent"]) == head, "the pasted words to be sent")
    browser.find_element(By.ID, "live-finish").click()
    wait(browser, lambda d: live_status(d) == "finished" or live_status(d).startswith("error"), "the finish")
    assert sent_text(browser, first["sent"]) == TEXT1
    play_audio(browser)
    check_played(browser, first, TEXT1)
    start_live(browser)  # what the last session said is not said again
    first = speak_live(browser, " Once more with feeling.")
    assert sent_text(browser, first["sent"]) == " Once more with feeling."
    check_played(browser, first, "Once more with feeling.")
    sessions_freed(live_server)
