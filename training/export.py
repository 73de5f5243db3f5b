"""Turn a training output into the shipped default bundle (`tts/assets/default/`, our directory format).

    python training/export.py --trained OUT --work training/work --codec training/work/codec_vq3 \
        --vocoder training/work/vocoder --codes training/work/codes_all --dest tts/assets/default

`--trained` may name several outputs of one training run (e.g. the weights after each of its calls), or
a model and a fine-tune of it (an exported bundle, such as the shipped `tts/assets/default`, counts as
an output: its config's `tts_runtime` is left out of the comparison): the bundle then holds their
element-wise mean, computed in float32 from the bf16 shards and rounded back to bf16 (checkpoint
averaging: Vaswani et al., "Attention Is All You Need", 2017, section 6.1, averaged the last checkpoints
of a run; Izmailov et al., "Averaging Weights Leads to Wider Optima and Better Generalization", 2018; a
model averaged with its fine-tune keeps more of what the fine-tune did not train: Wortsman et al.,
"Robust fine-tuning of zero-shot models", 2022). The model fields and the weights' names and
shapes must match, and every weight matrix must point the way the first model's does (cosine
similarity at least `MIN_COSINE`): two models of the same shape trained apart average to noise, and
are refused. train_state.json is the last output's, with the averaged steps added, and with `teacher`:
the corpus's (`tts eval --voices` speaks its same-text references with it).

Writes config.json (the model's `dual_ar` fields + `tts_runtime`: name, frontend "espeak-ipa:en-us",
prompt format, sampling defaults, and with `--aligner` the heads the loop guard follows), the weights as bf16
safetensors shards under 15 MB (the runtime casts them to its dtype), tokenizer.json, codec.json +
codec.safetensors, and one preset voice per corpus speaker in voices/ (a 2.5-4.5 s training clip of that
speaker: its codes and its normalized transcript; with `--voices-from BUNDLE`, that bundle's voices),
plus the clips' WAVs decoded by the codec in samples/voices/ (`--samples`; DEST/samples for another
--dest).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training"))

from corpus import SPEAKERS, read_utterances  # noqa: E402
from train_vocoder import vocoder_entry  # noqa: E402
from tts_tools.evaluate import VOICE_TEACHERS  # noqa: E402

from tts.checkpoints.bundle import (  # noqa: E402
    ModelBundle,
    load_codec,
    load_voices,
    load_weights_into,
    save_bundle,
    weight_files,
)
from tts.codec.melrvq import MelRVQCodec  # noqa: E402
from tts.codec.melvq import MelVQCodec, load_vocoder  # noqa: E402
from tts.engine.request import SamplingParams  # noqa: E402
from tts.model.config import AlignerSpec, ModelArgs  # noqa: E402
from tts.model.transformer import DualARTransformer  # noqa: E402
from tts.text.phonemes import PhonemeFrontend  # noqa: E402
from tts.text.prompt import S2PromptFormat, VoiceReference  # noqa: E402
from tts.text.tokenizer import TextTokenizer  # noqa: E402

SAMPLING = SamplingParams(temperature=0.1, top_p=0.5, top_k=10, max_new_frames=600)
GL_CONTEXT, GL_ITERS = 2, 16  # k-means codec's decoder settings (no effect on the codes): see RESULTS.md


# The least cosine similarity between a weight matrix of an averaged model and the first model's: a
# fine-tune or a later checkpoint of one run stays close to it (the shipped voice's fine-tunes: 0.998 and
# more), a model trained from another start does not (0.02 for the same shape: the mean is noise).
MIN_COSINE = 0.5


def average_weights(folders: list[Path], tmp: Path) -> Path:
    """The element-wise mean of the weights of several train.py outputs (same model shape), written as
    one bf16 safetensors file in `tmp`. Raises SystemExit when their keys or shapes differ, or when a
    weight matrix of one has a cosine similarity below MIN_COSINE with the first's (trained apart)."""
    from safetensors.torch import load_file, save_file

    total: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    for i, folder in enumerate(folders):
        state: dict[str, torch.Tensor] = {}
        for f in weight_files(folder):
            state.update(load_file(str(f)))
        if not i:
            first = state
        elif state.keys() != first.keys() or any(v.shape != first[k].shape for k, v in state.items()):
            raise SystemExit(f"--trained: {folder} holds other weights than {folders[0]}")
        elif apart := _least_cosine(state, first):
            raise SystemExit(
                f"--trained: {folder} is not a checkpoint or fine-tune of {folders[0]}: its {apart[0]!r} has "
                f"a cosine similarity of {apart[1]:.2f} with it (below {MIN_COSINE}); models trained apart "
                "average to noise"
            )
        for k, v in state.items():
            total[k] = total[k] + v.float() if i else v.float()
    out = tmp / "averaged.safetensors"
    save_file({k: (v / len(folders)).to(torch.bfloat16) for k, v in total.items()}, str(out))
    return out


def _least_cosine(state: dict[str, torch.Tensor], first: dict[str, torch.Tensor]) -> tuple[str, float] | None:
    """(name, cosine similarity) of the first weight matrix of `state` below MIN_COSINE against the same
    matrix of `first`, or None. Vectors are skipped: norm gains start at 1 in every model."""
    for k, v in state.items():
        if v.dim() >= 2:
            cos = float(
                torch.nn.functional.cosine_similarity(v.float().flatten(), first[k].float().flatten(), dim=0)
            )
            if cos < MIN_COSINE:
                return k, cos
    return None


def model_fields(folder: Path) -> dict:
    """The model fields of a train.py output's or an exported bundle's config.json (a bundle's
    `tts_runtime` left out: the runtime settings, not the model)."""
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("tts_runtime", None)
    return raw


def corpus_teacher(work: Path) -> str:
    """The synthesizer that spoke the corpus, as `corpus.py text --teacher` names it ("espeak" or
    "flite"; rows without the field are espeak-ng's)."""
    return read_utterances(work)[0].get("teacher", "espeak")


def pick_voices(work: Path, codes_dir: Path, num_codebooks: int) -> dict[str, VoiceReference]:
    """One reference per speaker: the first training clip of 2.5-4.5 s (deterministic)."""
    utts = {u["id"]: u for u in read_utterances(work)}
    voices: dict[str, VoiceReference] = {}
    for path in sorted(codes_dir.glob("codes-*.pt")):
        for item in torch.load(path):
            spk = SPEAKERS[item["speaker"]]["name"]
            if spk in voices or item["split"] != "train" or not 2.5 <= item["seconds"] <= 4.5:
                continue
            voices[spk] = VoiceReference(item["codes"][:num_codebooks].long(), utts[item["id"]]["text"])
        if len(voices) == len(SPEAKERS):
            break
    return dict(sorted(voices.items()))


def parse_aligner(text: str, args: ModelArgs) -> AlignerSpec:
    """`LAYER:HEAD,HEAD,...` -> the aligner heads of a model with `args`; ValueError if malformed or
    not in the model."""
    layer, sep, heads = text.partition(":")
    try:
        if not sep:
            raise ValueError
        raw = {"layer": int(layer), "heads": [int(h) for h in heads.split(",")]}
    except ValueError:
        raise ValueError(f"expected LAYER:HEAD,HEAD,..., got {text!r}") from None
    spec = AlignerSpec.from_config(raw, args.n_layer, args.n_head)
    assert spec is not None  # (raw is not None)
    return spec


def samples_dir(dest: Path, samples: Path | None) -> Path:
    """Where the preset voices' WAVs go: `samples` if given, else the repository's samples/voices/ when
    `dest` is the shipped bundle, else DEST/samples."""
    if samples is not None:
        return samples
    shipped = dest.resolve() == (ROOT / "tts" / "assets" / "default").resolve()
    return ROOT / "samples" / "voices" if shipped else dest / "samples"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--trained",
        type=Path,
        nargs="+",
        required=True,
        help="train.py output folder; several (the final one last): their weights are averaged (see above)",
    )
    p.add_argument("--work", type=Path, default=ROOT / "training" / "work")
    p.add_argument("--codec", type=Path, default=None, help="codec folder (default: WORK/codec)")
    p.add_argument(
        "--codes", type=Path, default=None, help="the codes the model trained on (default: WORK/codes)"
    )
    p.add_argument(
        "--vocoder",
        type=Path,
        default=None,
        help="a train_vocoder.py output folder (vocoder.json + vocoder.safetensors): the codec decodes with "
        "this learned vocoder instead of Griffin-Lim (the shipped bundle does)",
    )
    p.add_argument(
        "--aligner",
        default=None,
        metavar="LAYER:HEAD,HEAD",
        help="the slow-AR attention heads that follow the text, for the runtime's loop guard (found by "
        "training/aligner_probe.py; the shipped model's: 3:0,2); default: none, no loop guard",
    )
    p.add_argument(
        "--voices-from",
        type=Path,
        default=None,
        metavar="BUNDLE",
        help="keep the preset voices of this bundle (its voices/ folder; e.g. tts/assets/default when "
        "fine-tuning it) instead of picking training clips from --codes",
    )
    p.add_argument(
        "--teacher",
        choices=sorted(VOICE_TEACHERS),
        default=None,
        help="the synthesizer that spoke the corpus (default: WORK/sentences.jsonl's)",
    )
    p.add_argument("--dest", type=Path, default=ROOT / "tts" / "assets" / "default")
    p.add_argument(
        "--samples",
        type=Path,
        default=None,
        help="where the preset voices' decoded WAVs go (default: the repository's samples/voices/ for "
        "the shipped --dest, else DEST/samples: exporting a trial model leaves the shipped samples alone)",
    )
    a = p.parse_args()
    a.samples = samples_dir(a.dest, a.samples)
    last = a.trained[-1]  # (the run's final output: its config and step describe the bundle)
    raw = model_fields(last)
    for t in a.trained[:-1]:
        if model_fields(t) != raw:
            raise SystemExit(f"--trained: {t}/config.json has other model fields than {last}/config.json")
    args = ModelArgs.from_dict(raw)
    try:
        aligner = parse_aligner(a.aligner, args) if a.aligner is not None else None
    except ValueError as exc:
        p.error(f"--aligner: {exc}")
    codes_dir = a.codes or a.work / "codes"
    tokenizer = TextTokenizer.from_file(codes_dir / "tokenizer.json")
    codec = load_codec(a.codec or a.work / "codec")
    if isinstance(codec, MelRVQCodec):
        codec = MelRVQCodec(codec.codebooks, codec.mean, codec.std, GL_CONTEXT, GL_ITERS, args.num_codebooks)
    if a.vocoder is not None:
        if not isinstance(codec, MelVQCodec):
            raise SystemExit(f"--vocoder needs a mel_vqvae codec, got {type(codec).__name__}")
        vocoder = load_vocoder(a.vocoder, vocoder_entry(a.vocoder))
        codec = MelVQCodec(
            codec.net, codec.mean, codec.std, codec.gl_context, codec.gl_iters, vocoder_net=vocoder
        )
    if (codec.num_codebooks, codec.codebook_size) != (args.num_codebooks, args.codebook_size):
        raise SystemExit(
            f"codec has {codec.num_codebooks} x {codec.codebook_size} codes, the model "
            f"{args.num_codebooks} x {args.codebook_size}: export the codec the model was trained on"
        )
    teacher = a.teacher or corpus_teacher(a.work)
    if a.voices_from is not None:
        voices = load_voices(a.voices_from / "voices")
        if not voices:
            raise SystemExit(f"--voices-from: no voices in {a.voices_from / 'voices'}")
    else:
        voices = pick_voices(a.work, codes_dir, args.num_codebooks)
    with torch.device("meta"):
        model = DualARTransformer(args)
    with tempfile.TemporaryDirectory() as tmp:
        files = weight_files(last) if len(a.trained) == 1 else [average_weights(a.trained, Path(tmp))]
        load_weights_into(model, files, "cpu", torch.bfloat16)
    model.init_buffers("cpu")
    bundle = ModelBundle(
        name="default",
        family=f"dual_ar (default voice, trained on {VOICE_TEACHERS[teacher][0]} speech)",  # its binary
        model=model,
        codec=codec,
        tokenizer=tokenizer,
        prompt_format=S2PromptFormat(tokenizer, args.num_codebooks, PhonemeFrontend("en-us"), "english"),
        voices=voices,
        sampling=SAMPLING,
        chunk_length=200,
        default_voice="ava",  # speaker 0 of the corpus: the model reads best with a reference clip
        aligner=aligner,
    )
    if a.dest.exists():
        shutil.rmtree(a.dest)
    save_bundle(bundle, a.dest)
    codec.save(a.dest)
    state = json.loads((last / "train_state.json").read_text())
    state["teacher"] = teacher  # (`tts eval --voices` speaks its same-text references with it)
    if len(a.trained) > 1:
        state["averaged_steps"] = [
            json.loads((t / "train_state.json").read_text())["step"] for t in a.trained
        ]
    (a.dest / "train_state.json").write_text(json.dumps(state, indent=1))
    a.samples.mkdir(parents=True, exist_ok=True)
    from tts.audio.files import write_wav_atomic

    # As saved: the samples are what the runtime decodes (the vocoder's float16 weights and all).
    codec = load_codec(a.dest)

    for name, voice in bundle.voices.items():
        write_wav_atomic(a.samples / f"{name}.wav", codec.decode(voice.codes).numpy(), codec.sample_rate)
    print(f"wrote {a.dest}: {bundle.describe()}; voices {', '.join(bundle.voices)}")


if __name__ == "__main__":
    main()
