"""The CosyVoice3 frontend: everything before the AR LM (upstream cosyvoice/cli/frontend.py, CosyVoice3 modes).

`Frontend` turns a request (text + reference audio, or a saved speaker) into `LMRequestInputs`: text ids for the
LM, the LM's prompt speech tokens, and the flow's prompt tokens / prompt mel / speaker embedding. The two ONNX
models (`speech_tokenizer_v3.onnx`, `campplus.onnx`) run through onnxruntime. Text normalisation (wetext / ttsfrd)
and sentence splitting are not done here: text is tokenised as given.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from . import audio
from .config import SPEECH_TOKEN_SIZE
from ...engines.errors import InputError, ModelDirError
from .text import ENDOFPROMPT, SYSTEM_PROMPT, QwenTokenizer, TextTokenizer
from .tiny_frontends import CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE
from .versions import tensor_version

MAX_PROMPT_SECONDS = 30.0
SPEAKER_EMBED_DIM = 192
MEL_BINS = 80
TOKEN_MEL_RATIO = 2
SPEAKER_FORMAT = "cosytrt-speaker"
SPEAKER_FORMAT_VERSION = 1
_PROMPT_MEMO = 256  # prompt texts whose token ids a Frontend keeps


@dataclass
class PromptFeatures:
    """What the reference audio contributes: tokens and mel aligned so that mel frames = 2 x tokens."""
    speech_tokens: torch.Tensor  # int64 [N], 25 Hz
    mel: torch.Tensor            # float32 [2N, 80], 50 Hz log-mel at 24 kHz
    embedding: torch.Tensor      # float32 [192], CAM++ speaker embedding (flow only)


@dataclass
class SavedSpeaker:
    features: PromptFeatures
    prompt_text: str

    def __post_init__(self):
        if not isinstance(self.prompt_text, str):
            raise InputError(f"a saved speaker's prompt_text must be a string (empty: no transcript), got "
                             f"{type(self.prompt_text).__name__}")


@dataclass
class LMRequestInputs:
    """One request, ready for the LM and the flow.

    `text_ids` = prompt text ids + target text ids (the LM embeds them in one run); `text_len` counts the target
    part (upstream's `text_len`, used for the min / max decode lengths)."""
    mode: str                          # "zero_shot" | "cross_lingual" | "instruct"
    text_ids: torch.Tensor             # int64 [prompt_text_len + text_len]
    prompt_text_len: int
    text_len: int
    prompt_speech_tokens: torch.Tensor  # int64 [P] LM prompt speech tokens; empty for cross_lingual / instruct
    flow_prompt_tokens: torch.Tensor   # int64 [N]
    flow_prompt_mel: torch.Tensor      # float32 [2N, 80]
    embedding: torch.Tensor            # float32 [192]

    def lm_only(self) -> "LMRequestInputs":
        """These inputs without the flow prompt's mel and speaker embedding (empty): what an AR in another process or
        replica needs (it still reads the flow prompt's token count: its hop points)."""
        return dataclasses.replace(self, flow_prompt_mel=self.flow_prompt_mel[:0], embedding=self.embedding[:0])


# ------------------------------------------------------------------------------------------------ saved speakers

def save_speaker(path: str, features: PromptFeatures, prompt_text: str) -> None:
    """Write a speaker (prompt features + its transcript) as safetensors with JSON metadata."""
    from safetensors.torch import save_file
    _check_features(features, path)
    meta = {"format": SPEAKER_FORMAT, "version": SPEAKER_FORMAT_VERSION, "prompt_text": prompt_text,
            "sample_rate": audio.PROMPT_SR}
    tensors = {"speech_tokens": features.speech_tokens.to(torch.int64).contiguous(),
               "mel": features.mel.to(torch.float32).contiguous(),
               "embedding": features.embedding.to(torch.float32).contiguous()}
    if os.path.isdir(path):
        raise InputError(f"cannot write speaker file {path!r}: it is a folder")
    try:
        save_file(tensors, path, metadata={"cosytrt": json.dumps(meta, ensure_ascii=False)})
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error for a missing folder, no permission
        raise InputError(f"cannot write speaker file {path!r}: {e}") from None


def load_speaker(path: str) -> SavedSpeaker:
    """Read a file written by `save_speaker`; InputError naming the file and field when it is not one."""
    from safetensors import safe_open
    if not os.path.isfile(path):
        raise InputError(f"speaker file not found: {path!r}")
    try:
        with safe_open(path, framework="pt") as f:
            meta_raw = (f.metadata() or {}).get("cosytrt")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise InputError(f"cannot read speaker file {path!r}: {e}") from None
    try:
        meta = json.loads(meta_raw) if meta_raw is not None else None
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != SPEAKER_FORMAT:
        raise InputError(f"{path!r} is not a cosytrt speaker file (missing 'cosytrt' metadata)")
    if meta.get("version") != SPEAKER_FORMAT_VERSION:
        raise InputError(f"{path!r}: unsupported speaker file version {meta.get('version')!r}")
    if not isinstance(meta.get("prompt_text"), str):
        raise InputError(f"{path!r}: metadata field 'prompt_text' missing or not a string")
    for key in ("speech_tokens", "mel", "embedding"):
        if key not in tensors:
            raise InputError(f"{path!r}: missing tensor {key!r}")
    features = PromptFeatures(tensors["speech_tokens"], tensors["mel"], tensors["embedding"])
    _check_features(features, path)
    return SavedSpeaker(features, meta["prompt_text"])


def _stamp(f: PromptFeatures) -> tuple:
    """(tensor identity, storage, in-place version) of each feature tensor: changes when one is replaced or
    written in place; None for a field that is not a tensor (`_check_features` names it)."""
    return tuple((id(t), tensor_version(t)) if isinstance(t, torch.Tensor) else None
                 for t in (f.speech_tokens, f.mel, f.embedding))


def _check_features(f: PromptFeatures, where: str) -> None:
    tok, mel, emb = f.speech_tokens, f.mel, f.embedding
    for name, t in (("speech_tokens", tok), ("mel", mel), ("embedding", emb)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tok.dim() != 1 or tok.dtype not in (torch.int64, torch.int32) or tok.numel() == 0:
        raise InputError(f"{where}: speech_tokens must be a non-empty 1-D integer tensor, got {tuple(tok.shape)} "
                         f"{tok.dtype}")
    if int(tok.min()) < 0 or int(tok.max()) >= SPEECH_TOKEN_SIZE:
        raise InputError(f"{where}: speech_tokens outside [0, {SPEECH_TOKEN_SIZE})")
    if tuple(mel.shape) != (TOKEN_MEL_RATIO * tok.numel(), MEL_BINS) or not mel.is_floating_point():
        raise InputError(f"{where}: mel must be float [{TOKEN_MEL_RATIO * tok.numel()}, {MEL_BINS}] for "
                         f"{tok.numel()} tokens, got {tuple(mel.shape)} {mel.dtype}")
    if tuple(emb.shape) != (SPEAKER_EMBED_DIM,) or not emb.is_floating_point():
        raise InputError(f"{where}: embedding must be float [{SPEAKER_EMBED_DIM}], got {tuple(emb.shape)}")
    for name, t in (("mel", mel), ("embedding", emb)):
        if not bool(torch.isfinite(t).all()):  # they would make NaN audio
            raise InputError(f"{where}: {name} contains NaN or Inf values")


# ------------------------------------------------------------------------------------------------ frontend

def _session(path: str, what: str, providers: list[str]):
    import onnxruntime as ort
    if not os.path.isfile(path):
        raise ModelDirError(f"{what} model not found: {path!r}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1
    try:
        return ort.InferenceSession(path, sess_options=opts, providers=providers)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ModelDirError(f"cannot load {what} model {path!r}: {e}") from None


def _default_providers() -> list[str]:
    import onnxruntime as ort
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _with_system_prompt(text: str) -> str:
    """Prefix `You are a helpful assistant.<|endofprompt|>` unless the text already carries an `<|endofprompt|>`."""
    return text if ENDOFPROMPT in text else SYSTEM_PROMPT + ENDOFPROMPT + text


def _require_text(text, field: str) -> str:
    if not isinstance(text, str):
        raise InputError(f"{field} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise InputError(f"{field} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate (e.g. from a bad decode): the tokenizer cannot take it
        raise InputError(f"{field} is not valid Unicode: {e.reason} at position {e.start}") from None
    return text


class Frontend:
    """Text tokenizer + `speech_tokenizer_v3.onnx` + `campplus.onnx` -> `LMRequestInputs`.

    ONNX input names come from `session.get_inputs()`; the speech tokenizer runs on the CUDA EP when onnxruntime
    has it, CAM++ on CPU (as upstream). Pass `providers` to override both.
    """

    def __init__(self, tokenizer: TextTokenizer, speech_tokenizer_path: str, campplus_path: str,
                 providers: list[str] | None = None):
        self.tokenizer = tokenizer
        self.speech_tokenizer = _session(speech_tokenizer_path, "speech tokenizer", providers or _default_providers())
        self.campplus = _session(campplus_path, "speaker encoder (campplus)", providers or ["CPUExecutionProvider"])
        if len(self.speech_tokenizer.get_inputs()) < 2:
            raise ModelDirError(f"{speech_tokenizer_path!r}: speech tokenizer needs 2 inputs (mel, length), has "
                                f"{len(self.speech_tokenizer.get_inputs())}")
        if len(self.campplus.get_inputs()) < 1:
            raise ModelDirError(f"{campplus_path!r}: speaker encoder has no input")

    @classmethod
    def from_model_dir(cls, model_dir: str, tokenizer: TextTokenizer | None = None,
                       providers: list[str] | None = None) -> "Frontend":
        """A model directory: `speech_tokenizer_v3.onnx`, `campplus.onnx` and `CosyVoice-BlankEN/`."""
        if not os.path.isdir(model_dir):
            raise ModelDirError(f"model directory not found: {model_dir!r}")
        missing = [f for f in (SPEECH_TOKENIZER_FILE, CAMPPLUS_FILE) if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise ModelDirError(f"model directory {model_dir!r} lacks {', '.join(missing)}")
        if tokenizer is None:
            tokenizer = QwenTokenizer(os.path.join(model_dir, "CosyVoice-BlankEN"))
        return cls(tokenizer, os.path.join(model_dir, SPEECH_TOKENIZER_FILE), os.path.join(model_dir, CAMPPLUS_FILE),
                   providers=providers)

    # --------------------------------------------------------------------------------------------- features

    @staticmethod
    def _check_duration(wav16k: np.ndarray) -> None:
        seconds = wav16k.shape[-1] / audio.WHISPER_SR
        if wav16k.size == 0:
            raise InputError("prompt audio is empty")
        if seconds > MAX_PROMPT_SECONDS:
            raise InputError(f"prompt audio is {seconds:.2f} s long; at most {MAX_PROMPT_SECONDS:.0f} s is supported")

    def speech_tokens(self, wav16k) -> np.ndarray:
        """16 kHz mono samples -> int64 [N] speech tokens (25 Hz)."""
        wav16k = np.asarray(wav16k, dtype=np.float32).reshape(-1)
        self._check_duration(wav16k)
        mel = audio.whisper_log_mel(wav16k, n_mels=128)[None].numpy()  # (1, 128, T)
        inputs = self.speech_tokenizer.get_inputs()
        out = self.speech_tokenizer.run(None, {inputs[0].name: mel,
                                               inputs[1].name: np.array([mel.shape[2]], dtype=np.int32)})[0]
        return np.asarray(out).reshape(-1).astype(np.int64)

    def speaker_embedding(self, wav16k) -> np.ndarray:
        """16 kHz mono samples -> float32 [192] CAM++ embedding."""
        wav16k = np.asarray(wav16k, dtype=np.float32).reshape(-1)
        if wav16k.size == 0:
            raise InputError("prompt audio is empty")
        feat = audio.kaldi_fbank(wav16k)[None].numpy()  # (1, T, 80)
        out = self.campplus.run(None, {self.campplus.get_inputs()[0].name: feat})[0]
        return np.asarray(out, dtype=np.float32).reshape(-1)

    def prompt_features(self, wav, sr: int | None = None) -> PromptFeatures:
        """Reference audio (file path, or samples at rate `sr`) -> aligned `PromptFeatures`.

        Both rates are resampled from the source (as upstream loads the file twice): 16 kHz for tokens and the
        embedding, 24 kHz for the mel. `token_len = min(T_mel // 2, T_tok)`; mel cut to 2 * token_len frames.
        """
        if not isinstance(wav, (str, os.PathLike)) and sr is None:
            raise InputError("prompt audio given as samples needs its sample rate (sr)")
        # the length is checked before resampling: a wrong `sr` (1 for 16000) must not make hours of samples first
        wav16k = audio.load_wav(wav, audio.WHISPER_SR, sr=sr, max_seconds=MAX_PROMPT_SECONDS)  # (and not empty)
        wav24k = audio.load_wav(wav, audio.PROMPT_SR, sr=sr)
        tokens = self.speech_tokens(wav16k)
        mel = audio.prompt_mel(wav24k)
        token_len = min(mel.shape[0] // TOKEN_MEL_RATIO, tokens.shape[0])
        if token_len == 0:
            seconds = wav16k.shape[0] / audio.WHISPER_SR
            raise InputError(f"prompt audio too short: {seconds:.3f} s gives no speech token")
        if int(tokens.min()) < 0 or int(tokens.max()) >= SPEECH_TOKEN_SIZE:
            raise ModelDirError(f"speech tokenizer produced ids outside [0, {SPEECH_TOKEN_SIZE})")
        embedding = self.speaker_embedding(wav16k)
        return PromptFeatures(speech_tokens=torch.from_numpy(tokens[:token_len].copy()),
                              mel=mel[:TOKEN_MEL_RATIO * token_len].contiguous(),
                              embedding=torch.from_numpy(embedding.copy()))

    def _features(self, prompt_wav, sr, features: PromptFeatures | None) -> PromptFeatures:
        if features is not None:
            # a saved voice's features come request after request: checked once per content version
            stamp = _stamp(features)
            if getattr(features, "_cosytrt_checked", None) != stamp:
                _check_features(features, "prompt features")
                features._cosytrt_checked = stamp
            return features
        if prompt_wav is None:
            raise InputError("a request needs reference audio (prompt_wav) or saved prompt features")
        return self.prompt_features(prompt_wav, sr)

    def _encode_prompt(self, prompt_text: str) -> tuple[int, ...]:
        """Token ids of a prompt text (a saved voice's transcript or an instruction: the same string request after
        request), memoized (a bounded LRU per frontend)."""
        memo = self.__dict__.setdefault("_prompt_ids", OrderedDict())
        # pop and re-insert (the newest last): each step is atomic, so the frontend's worker threads never see a key
        # vanish between a lookup and a move (a move_to_end after another thread's eviction would raise)
        ids = memo.pop(prompt_text, None)
        if ids is None:
            ids = tuple(self.tokenizer.encode(prompt_text))
        memo[prompt_text] = ids
        while len(memo) > _PROMPT_MEMO:
            memo.popitem(last=False)
        return ids

    def _request(self, mode: str, prompt_text: str, tts_text: str, features: PromptFeatures,
                 lm_gets_prompt_speech: bool) -> LMRequestInputs:
        prompt_ids = self._encode_prompt(prompt_text) if prompt_text else ()
        text_ids = self.tokenizer.encode(tts_text)
        if not text_ids:
            raise InputError("tts text gives no tokens")
        lm_tokens = features.speech_tokens if lm_gets_prompt_speech else torch.zeros(0, dtype=torch.int64)
        return LMRequestInputs(mode=mode, text_ids=torch.tensor([*prompt_ids, *text_ids], dtype=torch.int64),
                               prompt_text_len=len(prompt_ids), text_len=len(text_ids),
                               prompt_speech_tokens=lm_tokens.to(torch.int64),
                               flow_prompt_tokens=features.speech_tokens.to(torch.int64),
                               flow_prompt_mel=features.mel.to(torch.float32),
                               embedding=features.embedding.to(torch.float32))

    # --------------------------------------------------------------------------------------------- modes

    def zero_shot(self, tts_text: str, prompt_text: str, prompt_wav=None, sr: int | None = None, *,
                  features: PromptFeatures | None = None) -> LMRequestInputs:
        """Clone the reference voice; `prompt_text` is its transcript.

        The LM's prompt text is `You are a helpful assistant.<|endofprompt|>` + transcript (unless the transcript
        already holds an `<|endofprompt|>`, as in upstream's examples), and it gets the prompt speech tokens."""
        _require_text(tts_text, "tts text")
        _require_text(prompt_text, "prompt text (transcript of the reference audio)")
        feats = self._features(prompt_wav, sr, features)
        return self._request("zero_shot", _with_system_prompt(prompt_text), tts_text, feats, True)

    def cross_lingual(self, tts_text: str, prompt_wav=None, sr: int | None = None, *,
                      features: PromptFeatures | None = None) -> LMRequestInputs:
        """Reference voice without a transcript: no prompt text or prompt speech for the LM (flow keeps both); the
        tts text carries the `You are a helpful assistant.<|endofprompt|>` prefix."""
        _require_text(tts_text, "tts text")
        feats = self._features(prompt_wav, sr, features)
        return self._request("cross_lingual", "", _with_system_prompt(tts_text), feats, False)

    def instruct(self, tts_text: str, instruction: str, prompt_wav=None, sr: int | None = None, *,
                 features: PromptFeatures | None = None) -> LMRequestInputs:
        """Upstream instruct2: the instruction is the LM's prompt text and must end in `<|endofprompt|>` (appended
        when absent); the LM gets no prompt speech tokens, the flow gets the reference's tokens, mel and voice."""
        _require_text(tts_text, "tts text")
        instruction = _require_text(instruction, "instruction").rstrip()
        if ENDOFPROMPT not in instruction:
            instruction += ENDOFPROMPT
        elif not instruction.endswith(ENDOFPROMPT):
            raise InputError(f"instruction must end with {ENDOFPROMPT}: {instruction!r}")
        feats = self._features(prompt_wav, sr, features)
        return self._request("instruct", instruction, tts_text, feats, False)

    def from_speaker(self, tts_text: str, speaker: "SavedSpeaker | str") -> LMRequestInputs:
        """Zero-shot from a saved speaker (a `SavedSpeaker` or a path for `load_speaker`): no audio frontend runs.
        A speaker saved with an empty transcript gives a cross-lingual request."""
        if not isinstance(speaker, SavedSpeaker):
            speaker = load_speaker(speaker)
        if not speaker.prompt_text.strip():  # saved without a transcript: the voice only
            return self.cross_lingual(tts_text, features=speaker.features)
        return self.zero_shot(tts_text, speaker.prompt_text, features=speaker.features)
