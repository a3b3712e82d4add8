"""The official CosyVoice3 Python API over cosytrt's runtime, for users of FunAudioLLM/CosyVoice.

    # upstream                                                  # cosytrt
    from cosyvoice.cli.cosyvoice import AutoModel               from cosytrt.runtime.compat import AutoModel
    cosyvoice = AutoModel(model_dir='FunAudioLLM/...')          cosyvoice = AutoModel(model_dir='FunAudioLLM/...',
                                                                                      engines='engines/h200')
    for out in cosyvoice.inference_zero_shot(text, prompt_text, './prompt.wav', stream=False):
        torchaudio.save('out.wav', out['tts_speech'], cosyvoice.sample_rate)

Same method names, argument order and output (a generator of `{'tts_speech': float32 tensor [1, N]}` at
`sample_rate`, 24 kHz) as upstream's CosyVoice3: `inference_zero_shot`, `inference_cross_lingual`,
`inference_instruct2`, `inference_vc`, `inference_sft`, `add_zero_shot_spk`, `list_available_spks`,
`save_spkinfo`. Every synthesis call runs through one `cosytrt.runtime.TTS` (its scheduler, engine set and
sampling), so a call gives the same audio as `TTS.synthesize` / `TTS.stream` with the same seed (`seed=` on the
constructor, or per call). Differences from upstream, on purpose:

- Prompt audio: a file path (CosyVoice3's `prompt_wav`) or 16 kHz samples (the older `prompt_speech_16k`: tensor
  or array [N] / [1, N]).
- The text is synthesized as one request (cosytrt's frontend), so a non-stream call yields one dict; upstream yields
  one per sentence.
- `speed`: non-stream only (as upstream); cosytrt stretches the finished audio with a phase vocoder (pitch kept),
  upstream interpolates the mel before the vocoder, so the two differ in detail.
- `inference_vc` runs the source's speech tokens through the flow and vocoder of the same TTS (engine set included)
  without the scheduler; `inference_instruct` (CosyVoice1's instruct with a speaker id) does not exist in
  CosyVoice3 and raises NotImplementedError.
- `load_trt`, `load_vllm`, `fp16`, `trt_concurrent`, `load_jit`, `text_frontend` are accepted and ignored: cosytrt's
  engines come from `engines=` (an engine set built by `trtbuild build`).
- Model ids are resolved with `huggingface_hub.snapshot_download` (the `hub` extra); a local folder needs nothing.
  Offline (`HF_HUB_OFFLINE=1` or no network) only an already-downloaded snapshot is used, otherwise the error says
  what to do. `spk2info.pt` in the model folder (upstream's speaker table) is imported.
"""
from __future__ import annotations

import os
import warnings
from typing import Iterator

import numpy as np
import torch

from ...engines.errors import InputError, ModelDirError
from ..models.frontend import PromptFeatures, SavedSpeaker

UPSTREAM_IGNORED = ("load_jit", "load_trt", "load_vllm", "fp16", "trt_concurrent")
_IGNORED_CALL_KW = ("text_frontend",)


# ------------------------------------------------------------------------------------------------ model location

def _looks_like_repo_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "~")) and "\\" not in s


def resolve_model_dir(model_dir: str) -> str:
    """A local folder as is; 'tiny' as is; otherwise a Hugging Face model id downloaded (or found in the cache) with
    `huggingface_hub.snapshot_download`. Offline it uses the cached snapshot only and says so when there is none."""
    if model_dir == "tiny" or os.path.isdir(model_dir):
        return model_dir
    if not _looks_like_repo_id(model_dir):
        raise ModelDirError(f"model directory not found: {model_dir!r} (give a local folder or a Hugging Face model "
                            f"id such as 'FunAudioLLM/Fun-CosyVoice3-0.5B-2512')")
    from cosytrt.extras import require

    hub = require("huggingface_hub", "hub", f"downloading the model {model_dir!r}")
    try:  # the cached snapshot first: works offline and makes no request
        return hub.snapshot_download(model_dir, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub raises several types): try the network
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if offline:
        raise ModelDirError(f"model {model_dir!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: "
                            f"download it first (huggingface-cli download {model_dir}) or pass a local folder")
    try:
        return hub.snapshot_download(model_dir)
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: one clear error
        raise ModelDirError(f"cannot download model {model_dir!r} from Hugging Face ({type(e).__name__}: {e}); "
                            f"check the id and the network, or pass a local folder") from None


# ------------------------------------------------------------------------------------------------ speakers

def _squeeze_1d(t, name: str, where: str) -> torch.Tensor:
    t = torch.as_tensor(t)
    while t.dim() > 1 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise InputError(f"{where}: {name} has shape {tuple(t.shape)}, expected [1, N]")
    return t


def speaker_from_upstream(entry: dict, tokenizer=None, where: str = "spk2info.pt") -> SavedSpeaker:
    """One upstream spk2info entry (CosyVoice2/3 `add_zero_shot_spk` layout: flow_prompt_speech_token [1, N],
    prompt_speech_feat [1, 2N, 80], flow_embedding [1, 192], prompt_text ids [1, L]) -> a cosytrt SavedSpeaker.
    The transcript is decoded with `tokenizer` (zero-shot); without one or without ids the voice is cross-lingual."""
    if not isinstance(entry, dict):
        raise InputError(f"{where}: a speaker entry is a dict, not {type(entry).__name__}")
    missing = [k for k in ("flow_prompt_speech_token", "prompt_speech_feat") if k not in entry]
    emb_key = "flow_embedding" if "flow_embedding" in entry else ("embedding" if "embedding" in entry else None)
    if missing or emb_key is None:
        raise InputError(f"{where}: speaker entry lacks {', '.join(missing + ([] if emb_key else ['flow_embedding']))}"
                         f" (only zero-shot speakers saved by CosyVoice2/3 carry prompt speech: an SFT speaker "
                         f"(embedding only) cannot drive CosyVoice3's flow)")
    tokens = _squeeze_1d(entry["flow_prompt_speech_token"], "flow_prompt_speech_token", where).to(torch.int64)
    feat = torch.as_tensor(entry["prompt_speech_feat"]).float()
    if feat.dim() == 3:
        feat = feat[0]
    n = min(int(tokens.numel()), int(feat.shape[0]) // 2)
    features = PromptFeatures(speech_tokens=tokens[:n].contiguous(), mel=feat[:2 * n].contiguous(),
                              embedding=_squeeze_1d(entry[emb_key], emb_key, where).float().contiguous())
    text = ""
    ids = entry.get("prompt_text")
    if isinstance(ids, str):
        text = ids
    elif ids is not None and tokenizer is not None and torch.as_tensor(ids).numel():
        text = tokenizer.decode(_squeeze_1d(ids, "prompt_text", where).tolist(), skip_special_tokens=False)
    from ..models.frontend import _check_features

    _check_features(features, where)
    return SavedSpeaker(features=features, prompt_text=text)


def load_spk2info(path: str, tokenizer=None) -> dict[str, SavedSpeaker]:
    """Upstream's `spk2info.pt` (a torch-saved dict speaker id -> entry) as cosytrt speakers. Read with
    `weights_only=True` (tensors and plain containers only); entries that cannot drive the flow are skipped with a
    warning naming them."""
    try:
        table = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise InputError(f"cannot read speaker table {path!r}: {type(e).__name__}: {e}") from None
    if not isinstance(table, dict):
        raise InputError(f"{path!r}: a speaker table is a dict of speaker id -> entry")
    out, skipped = {}, []
    for spk_id, entry in table.items():
        try:
            out[str(spk_id)] = speaker_from_upstream(entry, tokenizer, f"{path}[{spk_id!r}]")
        except InputError as e:
            skipped.append(f"{spk_id}: {e}")
    if skipped:
        warnings.warn(f"{path}: {len(skipped)} speaker(s) not imported: " + "; ".join(skipped), stacklevel=2)
    return out


# ------------------------------------------------------------------------------------------------ speed

def change_speed(wav: np.ndarray, speed: float, n_fft: int = 1024, hop: int = 256) -> np.ndarray:
    """Time-stretch by `speed` (>1 faster) keeping the pitch: a phase vocoder over an STFT."""
    if speed == 1.0 or wav.size < n_fft:
        return wav
    x = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32))
    window = torch.hann_window(n_fft)
    spec = torch.stft(x, n_fft, hop, window=window, return_complex=True)  # [F, T]
    steps = torch.arange(0, spec.shape[1] - 1, speed)
    mag = spec.abs()
    phase = spec.angle()
    expected = torch.linspace(0, np.pi * hop, spec.shape[0])
    idx = steps.floor().long()
    frac = (steps - idx).unsqueeze(0)
    m = (1 - frac) * mag[:, idx] + frac * mag[:, idx + 1]
    dphi = phase[:, idx + 1] - phase[:, idx] - expected.unsqueeze(1)
    dphi = dphi - 2 * np.pi * torch.round(dphi / (2 * np.pi))
    acc = torch.cumsum(dphi + expected.unsqueeze(1), dim=1)
    acc = torch.cat([phase[:, :1], phase[:, :1] + acc[:, :-1]], dim=1)
    out = torch.istft(torch.polar(m, acc), n_fft, hop, window=window, length=int(round(wav.size / speed)))
    return out.numpy().astype(np.float32)


# ------------------------------------------------------------------------------------------------ the adapter

class CosyVoice3:
    """Upstream's `CosyVoice3(model_dir, ...)` call shapes over `cosytrt.runtime.TTS`.

    model_dir: a local model folder (the released layout), 'tiny', or a Hugging Face model id; engines: an engine-set
    folder (`trtbuild build`), None for eager; device: 'cpu' / 'cuda'; seed: the default sampling seed of every call
    (upstream draws from the global RNG instead; pass `seed=` per call to vary it); tts: an already loaded TTS to
    wrap (then model_dir / engines / device are not used)."""

    def __init__(self, model_dir: str = "tiny", engines: str | None = None, device: str | None = None,
                 seed: int = 0, tts=None, **upstream_kw):
        unknown = set(upstream_kw) - set(UPSTREAM_IGNORED)
        if unknown:
            raise TypeError(f"CosyVoice3() got unexpected keyword argument(s) {sorted(unknown)}")
        if tts is None:
            from .. import TTS

            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            tts = TTS.load(resolve_model_dir(model_dir), engines=engines, device=device)
        self.tts = tts
        self.model_dir = tts.pipeline.models.model_dir
        self.sample_rate = tts.sample_rate
        self.seed = seed
        self.spk2info: dict[str, SavedSpeaker] = {}
        table = os.path.join(self.model_dir, "spk2info.pt")
        if os.path.isfile(table):
            self.spk2info.update(load_spk2info(table, tts.pipeline.frontend.tokenizer))

    # ------------------------------------------------------------------ speakers
    def list_available_spks(self) -> list[str]:
        return list(self.spk2info)

    list_avaliable_spks = list_available_spks  # upstream's older spelling

    def add_zero_shot_spk(self, prompt_text: str, prompt_wav, zero_shot_spk_id: str) -> bool:
        """Keep a voice under `zero_shot_spk_id` for later calls (`zero_shot_spk_id=` / `inference_sft`)."""
        if not zero_shot_spk_id:
            raise InputError("zero_shot_spk_id must not be empty")
        wav, sr = self._prompt(prompt_wav)
        self.spk2info[zero_shot_spk_id] = self.tts.make_speaker(wav, prompt_text or "", sr)
        return True

    def save_spkinfo(self, folder: str | None = None) -> list[str]:
        """Write every speaker as a cosytrt speaker file `<folder>/<id>.safetensors` (default: `<model_dir>/spk`);
        returns the paths (use them with `trtbuild synth --speaker` or the server's voices folder)."""
        from ..models.frontend import save_speaker

        folder = folder or os.path.join(self.model_dir, "spk")
        os.makedirs(folder, exist_ok=True)
        paths = []
        for spk_id, spk in self.spk2info.items():
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in spk_id)
            paths.append(os.path.join(folder, f"{safe}.safetensors"))
            save_speaker(paths[-1], spk.features, spk.prompt_text)
        return paths

    def _speaker(self, spk_id: str) -> SavedSpeaker:
        if spk_id not in self.spk2info:
            raise InputError(f"unknown speaker {spk_id!r} (available: {', '.join(self.spk2info) or 'none'}; add one "
                             f"with add_zero_shot_spk)")
        return self.spk2info[spk_id]

    @staticmethod
    def _prompt(prompt) -> tuple[object, int | None]:
        """A path -> (path, None); 16 kHz samples (tensor / array [N] or [1, N]) -> (float32 array, 16000)."""
        if isinstance(prompt, (str, os.PathLike)):
            return os.fspath(prompt), None
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.detach().cpu().float().numpy()
        if isinstance(prompt, np.ndarray):
            return np.asarray(prompt, dtype=np.float32).reshape(-1), 16000
        raise InputError(f"prompt audio must be a file path or 16 kHz samples, not {type(prompt).__name__}")

    # ------------------------------------------------------------------ synthesis
    def _run(self, text: str, stream: bool, speed: float, seed: int | None, **req) -> Iterator[dict]:
        if not isinstance(speed, (int, float)) or not 0.5 <= speed <= 2.0:
            raise InputError(f"speed must be a number in [0.5, 2.0], got {speed!r}")
        if stream and speed != 1.0:
            raise InputError("speed change only supports stream=False (as upstream)")
        kw = {"seed": self.seed if seed is None else seed}
        if stream:
            for chunk in self.tts.stream(text, **req, **kw):
                yield {"tts_speech": torch.from_numpy(np.asarray(chunk, dtype=np.float32)).reshape(1, -1)}
            return
        wav = self.tts.synthesize(text, **req, **kw)
        yield {"tts_speech": torch.from_numpy(change_speed(np.asarray(wav, dtype=np.float32), speed)).reshape(1, -1)}

    def inference_zero_shot(self, tts_text: str, prompt_text: str, prompt_wav, zero_shot_spk_id: str = "",
                            stream: bool = False, speed: float = 1.0, text_frontend: bool = True,
                            seed: int | None = None) -> Iterator[dict]:
        """Clone the voice of `prompt_wav` (with its transcript `prompt_text`), or of a saved `zero_shot_spk_id`."""
        if zero_shot_spk_id:
            return self._run(tts_text, stream, speed, seed, speaker=self._speaker(zero_shot_spk_id))
        wav, sr = self._prompt(prompt_wav)
        return self._run(tts_text, stream, speed, seed, prompt_wav=wav, prompt_sr=sr, prompt_text=prompt_text)

    def inference_cross_lingual(self, tts_text: str, prompt_wav, zero_shot_spk_id: str = "", stream: bool = False,
                                speed: float = 1.0, text_frontend: bool = True,
                                seed: int | None = None) -> Iterator[dict]:
        """The voice of `prompt_wav` without a transcript (the text may be in another language)."""
        if zero_shot_spk_id:
            spk = self._speaker(zero_shot_spk_id)
            return self._run(tts_text, stream, speed, seed, speaker=SavedSpeaker(spk.features, ""))
        wav, sr = self._prompt(prompt_wav)
        return self._run(tts_text, stream, speed, seed, prompt_wav=wav, prompt_sr=sr)

    def inference_instruct2(self, tts_text: str, instruct_text: str, prompt_wav, zero_shot_spk_id: str = "",
                            stream: bool = False, speed: float = 1.0, text_frontend: bool = True,
                            seed: int | None = None) -> Iterator[dict]:
        """An instruction (e.g. 'You are a helpful assistant. Please speak fast.<|endofprompt|>') with the voice of
        `prompt_wav` or of a saved speaker."""
        if zero_shot_spk_id:
            return self._run(tts_text, stream, speed, seed, instruct=instruct_text,
                             speaker=self._speaker(zero_shot_spk_id))
        wav, sr = self._prompt(prompt_wav)
        return self._run(tts_text, stream, speed, seed, instruct=instruct_text, prompt_wav=wav, prompt_sr=sr)

    def inference_sft(self, tts_text: str, spk_id: str, stream: bool = False, speed: float = 1.0,
                      text_frontend: bool = True, seed: int | None = None) -> Iterator[dict]:
        """A saved speaker by id (imported from spk2info.pt or added with add_zero_shot_spk)."""
        return self._run(tts_text, stream, speed, seed, speaker=self._speaker(spk_id))

    def inference_instruct(self, *args, **kw):
        raise NotImplementedError("inference_instruct is CosyVoice1's instruct with a speaker id; CosyVoice3 has "
                                  "inference_instruct2(tts_text, instruct_text, prompt_wav)")

    def inference_vc(self, source_wav, prompt_wav, stream: bool = False, speed: float = 1.0) -> Iterator[dict]:
        """Voice conversion: the speech tokens of `source_wav` (its content) spoken by the voice of `prompt_wav`,
        through the same flow and vocoder (engine set included) as every other call; no LM, so no sampling."""
        if not isinstance(speed, (int, float)) or not 0.5 <= speed <= 2.0:
            raise InputError(f"speed must be a number in [0.5, 2.0], got {speed!r}")
        if stream and speed != 1.0:
            raise InputError("speed change only supports stream=False (as upstream)")
        from ..models.audio import WHISPER_SR, load_wav

        pipe = self.tts.pipeline
        src, src_sr = self._prompt(source_wav)
        tokens = torch.from_numpy(pipe.frontend.speech_tokens(load_wav(src, WHISPER_SR, sr=src_sr)))
        pwav, psr = self._prompt(prompt_wav)
        feats = pipe.frontend.prompt_features(pwav, psr)
        dev = pipe.device
        args = (tokens.to(dev), feats.speech_tokens.to(dev), feats.mel.to(dev), feats.embedding.to(dev))
        t2w = pipe.token2wav
        if stream:
            return ({"tts_speech": c.detach().float().cpu().reshape(1, -1)} for c in t2w.stream_all(*args))
        wav = t2w.offline(*args).detach().float().cpu().numpy()
        return iter([{"tts_speech": torch.from_numpy(change_speed(wav, speed)).reshape(1, -1)}])

    def close(self) -> None:
        self.tts.close()

    def __enter__(self) -> "CosyVoice3":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def AutoModel(**kwargs) -> CosyVoice3:  # noqa: N802 - upstream's name
    """Upstream's `AutoModel(model_dir=...)`: cosytrt serves CosyVoice3 models only."""
    model_dir = kwargs.pop("model_dir", None)
    if model_dir is None:
        raise TypeError("AutoModel() needs model_dir=")
    return CosyVoice3(model_dir, **kwargs)


__all__ = ["AutoModel", "CosyVoice3", "load_spk2info", "resolve_model_dir", "speaker_from_upstream", "change_speed"]
