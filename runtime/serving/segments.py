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


def split_sentences(text: str, max_units: int = 80, min_units: int = 60, merge_units: int = 20) -> list[str]:
    """Cut at sentence punctuation, merge consecutive sentences up to `max_units` (a piece closes once it reaches
    `min_units`); a last piece shorter than `merge_units` joins the previous one. A single sentence longer than
    `max_units` is cut at commas, then at word boundaries."""
    pieces: list[str] = []
    for s in _SENTENCE_END.split(text):
        s = s.strip() if s else ""
        if not s:
            continue
        if units(s) <= max_units:
            pieces.append(s)
            continue
        pieces.extend(_split_long(s, max_units))
    out: list[str] = []
    cur = ""
    sep = "" if is_cjk(text) else " "
    for p in pieces:
        cand = (cur + sep + p) if cur else p
        if cur and units(cand) > max_units:
            out.append(cur)
            cur = p
        else:
            cur = cand
        if units(cur) >= min_units:
            out.append(cur)
            cur = ""
    if cur:
        if out and units(cur) < merge_units and units(out[-1] + sep + cur) <= max_units + merge_units:
            out[-1] = out[-1] + sep + cur
        else:
            out.append(cur)
    return out


def _split_long(s: str, max_units: int) -> list[str]:
    parts = [p for p in re.split(r"(?<=[,，、:：])", s) if p.strip()]
    out: list[str] = []
    for p in parts:
        p = p.strip()
        if units(p) <= max_units:
            out.append(p)
            continue
        if is_cjk(p):
            step = max_units
            out.extend(p[i:i + step] for i in range(0, len(p), step))
            continue
        words, cur = p.split(), []
        for w in words:
            if cur and units(" ".join(cur + [w])) > max_units:
                out.append(" ".join(cur))
                cur = []
            cur.append(w)
        if cur:
            out.append(" ".join(cur))
    return out
