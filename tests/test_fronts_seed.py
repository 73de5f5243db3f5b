"""The same request and seed give the same codes through the four fronts on a CPU: the Python API, the
CLI (`tts synthesize`), gRPC and HTTP (same planner, same prompt, same engine step), and the same audio
within one least significant bit of PCM16 (the wire's and the file's sample format)."""

import dataclasses

import numpy as np
import pytest
import soundfile as sf
import torch
from service_helpers import collect
from test_http import HTTPServerThread

from service.grpc_gen.v1 import tts_pb2 as pb
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from tts.api import TTS
from tts.engine import EngineConfig
from tts.model.config import AlignerSpec

pytest.importorskip("fastapi")

TEXT = "A few words of text, read four ways."
SEED = 11
FRAMES = 24


def test_one_seed_gives_the_same_codes_through_the_api_the_cli_grpc_and_http(
    tiny_bundle, tmp_path, monkeypatch
):
    # with aligner heads, so that the loop guard and the end-token refusal are part of every path
    bundle = dataclasses.replace(tiny_bundle, aligner=AlignerSpec(1, (0, 3)))
    api = TTS(bundle, EngineConfig(max_batch=1)).synthesize(TEXT, seed=SEED, max_new_frames=FRAMES)

    import tts.checkpoints.load as load
    from tts.cli.main import main

    monkeypatch.setattr(load, "load_bundle", lambda *a, **kw: bundle)
    cli_results = []
    original = TTS.synthesize

    def spy(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        cli_results.append(result)
        return result

    monkeypatch.setattr(TTS, "synthesize", spy)
    out = tmp_path / "cli.wav"
    argv = ["synthesize", TEXT, "-o", str(out), "--model", "tiny", "--seed", str(SEED)]
    assert main([*argv, "--max-new-frames", str(FRAMES), "-q", "--keep-partial"]) == 0
    monkeypatch.setattr(TTS, "synthesize", original)
    [cli] = cli_results

    server = HTTPServerThread(bundle, EngineConfig(max_batch=8))
    try:
        with server.channel() as channel:
            request = pb.SynthesizeRequest(
                text=TEXT,
                sampling=pb.SamplingOptions(seed=SEED, max_new_frames=FRAMES),
                output=pb.OutputOptions(encoding=pb.AUDIO_ENCODING_FLOAT32, include_codes=True),
            )
            grpc_out = collect(pb_grpc.TextToSpeechStub(channel).Synthesize(request))
        status, _, http_pcm = server.speech(
            input=TEXT, seed=SEED, max_new_frames=FRAMES, response_format="pcm"
        )
    finally:
        server.stop()
    assert status == 200

    assert torch.equal(cli.codes, api.codes)
    assert torch.equal(torch.as_tensor(grpc_out["codes"]).long(), api.codes)
    lsb = 1 / 32767
    file_audio, _ = sf.read(out, dtype="float32")
    assert file_audio.shape == api.audio.shape and np.abs(file_audio - api.audio).max() <= lsb
    grpc_audio = np.asarray(grpc_out["audio"], dtype=np.float32).reshape(-1)
    assert grpc_audio.shape == api.audio.shape and np.abs(grpc_audio - api.audio).max() <= lsb
    http_audio = np.frombuffer(http_pcm, "<i2").astype(np.float32) / 32767
    assert http_audio.shape == api.audio.shape and np.abs(http_audio - api.audio).max() <= lsb
