"""Long input: text normalisation and sentence segmentation, as upstream CosyVoice's frontend does.

Upstream (`CosyVoiceFrontEnd.text_normalize`) normalises the text (wetext / ttsfrd), then `split_paragraph` cuts it
at sentence punctuation and merges pieces up to `token_max_n=80` tokens (closing a piece once past
`token_min_n=60`; a last piece under `merge_len=20` joins the previous one); every piece is synthesised on its own
and the audio concatenated. Here the pieces are counted in approximate tokens (CJK characters, or ~1.3 per word)
so the server needs no tokenizer; normalisation uses wetext (a maintained WeNet normaliser for zh / en) when it is
installed, else the text is left as is."""
from __future__ import annotations

import functools
import logging
import re

log = logging.getLogger("cosytrt.server")

_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff\u3040-\u30ff\uac00-\ud7af]")
# sentence ends (kept with the sentence), incl. CJK full-width forms; a '.' only when not inside a number
_SENTENCE_END = re.compile(r"(?<=[。！？；!?;])|(?<=[.])(?=\s|$)|\n+")
_WORD = re.compile(r"\S+")


def is_cjk(text: str) -> bool:
    return len(_CJK.findall(text)) > len(text) * 0.3


def units(text: str) -> int:
    """Approximate LM text tokens: CJK characters count one each, other words ~1.3."""
    cjk = len(_CJK.findall(text))
    words = len(_WORD.findall(_CJK.sub(" ", text)))
    return cjk + (words * 13 + 9) // 10


@functools.lru_cache(maxsize=4)
def _normalizer(lang: str):
    try:
        from wetext import Normalizer
    except ImportError:
        return None
    try:
        return Normalizer(lang=lang, operator="tn")
    except Exception as e:  # noqa: BLE001 - a broken install must not break serving
        log.warning("wetext normaliser for %r unavailable: %s", lang, e)
        return None


def normalizer_available() -> bool:
    return _normalizer("en") is not None


def normalize(text: str) -> str:
    """Numbers, dates, currencies and symbols spelled out (wetext, zh or en by script); unchanged without wetext.
    Text with CosyVoice control tags (`<|...|>`, `[breath]`) is left alone, as upstream does."""
    if "<|" in text or re.search(r"\[[a-z_]+\]", text):
        return text
    n = _normalizer("zh" if is_cjk(text) else "en")
    if n is None:
        return text
    try:
        out = n.normalize(text)
    except Exception:  # noqa: BLE001
        return text
    return out if out.strip() else text


def split_sentences(text: str, max_units: int = 80, min_units: int = 60, merge_units: int = 20,
                    count=None) -> list[str]:
    """Cut at sentence punctuation, merge consecutive sentences up to `max_units` (a piece closes once it reaches
    `min_units`); a last piece shorter than `merge_units` joins the previous one. A single sentence longer than
    `max_units` is cut at commas, then at word boundaries. `count(text) -> int` measures a piece (the model's
    tokenizer; default: `units`)."""
    n = count or units
    min_units, merge_units = min(min_units, max_units * 3 // 4), min(merge_units, max_units // 4)
    pieces: list[str] = []
    for s in _SENTENCE_END.split(text):
        s = s.strip() if s else ""
        if not s:
            continue
        if n(s) <= max_units:
            pieces.append(s)
            continue
        pieces.extend(_split_long(s, max_units, n))
    out: list[str] = []
    cur = ""
    sep = "" if is_cjk(text) else " "
    for p in pieces:
        cand = (cur + sep + p) if cur else p
        if cur and n(cand) > max_units:
            out.append(cur)
            cur = p
        else:
            cur = cand
        if n(cur) >= min_units:
            out.append(cur)
            cur = ""
    if cur:
        if out and n(cur) < merge_units and n(out[-1] + sep + cur) <= max_units + merge_units:
            out[-1] = out[-1] + sep + cur
        else:
            out.append(cur)
    return out


def _split_long(s: str, max_units: int, n) -> list[str]:
    parts = [p for p in re.split(r"(?<=[,，、:：])", s) if p.strip()]
    out: list[str] = []
    for p in parts:
        p = p.strip()
        if n(p) <= max_units:
            out.append(p)
            continue
        if is_cjk(p) or len(p.split()) == 1:
            step = max(1, max_units * len(p) // max(1, n(p)))
            out.extend(p[i:i + step] for i in range(0, len(p), step))
            continue
        words, cur = p.split(), []
        for w in words:
            if cur and n(" ".join(cur + [w])) > max_units:
                out.append(" ".join(cur))
                cur = []
            cur.append(w)
        if cur:
            out.append(" ".join(cur))
    return out


def segment_budget(tts, speaker, configured: int) -> tuple[int, object]:
    """(most text tokens per segment, counter): `configured` (upstream's 80), lowered so that the default length
    budget (20 speech tokens per text token) of a segment fits the model's fixed noise buffers and KV slots for this
    speaker's prompt; the counter is the model's tokenizer when it has one."""
    budget, count = configured, None
    pipeline = getattr(tts, "pipeline", None)
    tok = getattr(getattr(pipeline, "frontend", None), "tokenizer", None)
    if tok is not None and hasattr(tok, "encode"):
        def count(text, _enc=tok.encode):
            return len(_enc(text))
    try:
        feats = speaker.features
        prompt = int(feats.speech_tokens.numel())
        models = pipeline.models
        limit = min(models.flow.max_frames, models.hift.max_frames) // 2 - prompt
        budget = min(budget, max(4, limit // 20 - 2))
        ar_len = getattr(getattr(tts, "_scheduler", None), "ar_max_len", None)
        if ar_len:
            budget = min(budget, max(4, (ar_len - prompt - len(speaker.prompt_text or "")) // 21 - 2))
    except Exception:  # noqa: BLE001 - a fake or remote runtime: keep the configured budget
        pass
    return budget, count
