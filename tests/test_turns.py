"""DeviceTurns: a no-op off CUDA; on CUDA, work issued in turns on two streams runs one after the other."""

import threading

import pytest
import torch

from tts.engine.turns import DeviceTurns, default_schedule


def test_turns_do_nothing_on_a_cpu():
    turns = DeviceTurns("cpu")
    assert not turns.enabled
    with turns.turn():
        x = torch.ones(3) * 2
    assert x.tolist() == [2.0, 2.0, 2.0]
    assert turns.turns == 0


def test_the_schedule_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("TTS_CODEC_SCHEDULE", raising=False)
    assert default_schedule() == "serial"
    monkeypatch.setenv("TTS_CODEC_SCHEDULE", "overlap")
    assert default_schedule() == "overlap"
    monkeypatch.setenv("TTS_CODEC_SCHEDULE", "both")
    with pytest.raises(ValueError, match="TTS_CODEC_SCHEDULE"):
        default_schedule()


@pytest.mark.cuda
def test_turns_order_two_streams_on_the_device():
    """A slow kernel queued in one thread's turn finishes before the next turn's work on another
    stream starts: the second stream reads the first one's result, never the value before it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    turns = DeviceTurns(device)
    a = torch.zeros(4096, 4096, device=device)
    seen = []
    first_done = threading.Event()

    def first():
        with torch.cuda.stream(torch.cuda.Stream(device)), turns.turn():
            torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on the device, then the write
            a.fill_(1.0)
        first_done.set()

    def second():
        first_done.wait()
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            with turns.turn():
                total = a.sum()
            stream.synchronize()
        seen.append(float(total))

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [4096.0 * 4096.0]
    assert turns.turns == 2
