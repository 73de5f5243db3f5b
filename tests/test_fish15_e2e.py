"""fish-speech 1.5 end to end on CPU: the tiny checkpoint synthesizes through the Python API, the CLI and
the service, its frames follow 1.5's convention (first frame dropped, end frame kept), and the tiny
shapes' sampling defaults fit their context."""

import subprocess
import sys
import wave

import grpc
import numpy as np
import pytest
import torch
from fish_golden import CASES, golden

from service.client import build_request
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from tts.api import TTS
from tts.checkpoints.load import load_bundle
from tts.codec.firefly import FireflyCodec
from tts.engine import Engine, EngineConfig, SamplingParams

REP = CASES["repetition"]["fish-1.5"]
TEXT = next(c for c in CASES["families"]["fish-1.5"]["prompts"] if c["name"] == "plain")["text"]


@pytest.fixture(scope="module")
def bundle(fish_checkpoints):
    return load_bundle(fish_checkpoints["fish-1.5"])


def greedy(**kw):
    return dict(temperature=0.0, top_p=1.0, top_k=0, seed=0, repetition_penalty=REP["penalty"], **kw)


def test_bundle_defaults(bundle):
    assert isinstance(bundle.codec, FireflyCodec) and bundle.repetition == "fish-1.5"
    s = bundle.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.ras_window) == (0.7, 0.7, 0, 1.2, 0)
    assert s.max_new_frames == 256 == bundle.model.config.max_seq_len // 4  # a quarter of the tiny context


def test_api_output_is_the_references_drop_first_slice(bundle):
    # fish-speech 1.5's generate_long hands y[1:, prompt_length + 1:] to the decoder: the first
    # generated frame dropped. Greedy with the penalty, 40 frames: the reference's 39 frames.
    tts = TTS(bundle, EngineConfig(max_batch=2))
    try:
        result = tts.synthesize(TEXT, **greedy(max_new_frames=REP["frames"]))
    finally:
        tts.close()
    ref = golden(REP["golden"])["codes_out_plain"].long().T  # [8, 39]
    assert result.codes.shape == ref.shape == (8, REP["frames"] - 1)
    assert torch.equal(result.codes, ref)
    assert result.audio.shape == (ref.shape[1] * 2048,) and result.sample_rate == 44100
    np.testing.assert_allclose(result.audio, bundle.codec.decode(ref).numpy(), rtol=0, atol=1e-6)


def test_end_frame_is_kept_and_first_dropped(bundle, fish_checkpoints):
    # Make <|im_end|> win at some frame (its head row a copy of a semantic token's, scaled) so that the
    # chunk ends with the end token; the audio is then frames[1:] + the end frame's codes.
    b = load_bundle(fish_checkpoints["fish-1.5"])
    c = b.model.config
    with torch.no_grad():
        frames = _engine_frames(b, 12)
        token = int(frames[4, 0])  # the main token of the fifth frame
        b.model.output.weight[c.eos_token_id] = 1.5 * b.model.output.weight[token]
    frames = _engine_frames(b, 60)
    assert int(frames[-1, 0]) == c.eos_token_id and frames.shape[0] >= 3
    tts = TTS(b, EngineConfig(max_batch=1))
    try:
        result = tts.synthesize(TEXT, **greedy(max_new_frames=60))
    finally:
        tts.close()
    assert result.finish_reasons[0].value in ("stop", "short")
    assert torch.equal(result.codes, frames[1:, 1:].T)
    assert int(result.codes[0, -1]) == 0  # the end frame's c_0


def _engine_frames(bundle, n):
    """Greedy frames `[k, 1 + N]` (token and codes, the end frame included) straight from the engine."""
    prompt = bundle.prompt_format.build(TEXT)
    engine = Engine(bundle.model, EngineConfig(max_batch=1, graphs="off", repetition="fish-1.5"))
    engine.submit(prompt, SamplingParams(**greedy(max_new_frames=n, ras_window=0)), "r")
    c, out = bundle.model.config, []
    while engine.has_work():
        for o in engine.step():
            for codes in (o.codes, o.end_codes):
                if codes is not None and codes.numel():
                    eos = codes is o.end_codes
                    tok = c.eos_token_id if eos else int(codes[0, 0]) + c.semantic_begin_id
                    out.append(torch.cat([torch.tensor([tok]), codes[0]]))
    return torch.stack(out)


def test_cli_synthesizes_a_wav(fish_checkpoints, tmp_path):
    out = tmp_path / "x.wav"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tts.cli",
            "synthesize",
            "--model",
            str(fish_checkpoints["fish-1.5"]),
            TEXT,
            "-o",
            str(out),
            "--seed",
            "1",
            "--max-new-frames",
            "20",
            "--repetition-penalty",
            "1.3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    with wave.open(str(out)) as w:
        assert w.getframerate() == 44100 and w.getnframes() == 19 * 2048


def test_service_streams_fish15_with_a_repetition_penalty(bundle):
    from service_helpers import ServerThread, collect

    srv = ServerThread(bundle, EngineConfig(max_batch=2))
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.TextToSpeechStub(channel)
            req = build_request(
                TEXT,
                temperature=0.0,
                top_p=1.0,
                top_k=0,
                seed=0,
                max_new_frames=REP["frames"],
                repetition_penalty=REP["penalty"],
                encoding="float32",
                include_codes=True,
                first_chunk_frames=4,
                chunk_frames=16,
            )
            r = collect(stub.Synthesize(req))
            assert r["header"].sample_rate == 44100 and r["header"].num_codebooks == 8
            ref = golden(REP["golden"])["codes_out_plain"].long().T.numpy()
            np.testing.assert_array_equal(r["codes"], ref)
            assert r["end"].frames == ref.shape[1] and r["audio"].shape == (ref.shape[1] * 2048,)
            np.testing.assert_allclose(
                r["audio"], bundle.codec.decode(torch.from_numpy(ref)).numpy(), atol=1e-6
            )
            bad = build_request(TEXT, repetition_penalty=2.5)
            with pytest.raises(grpc.RpcError) as info:
                collect(stub.Synthesize(bad))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "repetition_penalty" in info.value.details()
    finally:
        srv.stop()


def test_tiny_shapes_fit_long_text_in_their_context(fish_checkpoints):
    from tts.runtime.planner import Planner

    for fam in ("s2", "s1", "fish-1.5"):
        b = load_bundle(fish_checkpoints[fam])
        assert b.sampling.max_new_frames <= b.model.config.max_seq_len // 4
        planner = Planner(b, b.model.config.max_seq_len)
        job = planner.job("The quick brown fox jumps over the lazy dog. " * 12, seed=1)
        assert all(budget <= b.sampling.max_new_frames for budget in job.budgets)
