"""Text tokenizers with one interface: `encode(text) -> list[int]`, `decode(ids) -> str`, `endofprompt_id`.

- `ByteTokenizer`: the tiny model's tokenizer (UTF-8 bytes + a few specials; no files needed).
- `QwenTokenizer`: the real one, `<model_dir>/CosyVoice-BlankEN` loaded with transformers, plus the CosyVoice3
  additional special tokens in upstream's order (so `<|endofprompt|>` is 151646).
"""
from __future__ import annotations

import os
import re
from typing import Protocol, Sequence

from .config import ENDOFPROMPT_TEXT_ID
from ...engines.errors import ConfigError, InputError, ModelDirError

ENDOFPROMPT = "<|endofprompt|>"
SYSTEM_PROMPT = "You are a helpful assistant."


class TextTokenizer(Protocol):
    endofprompt_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


# --------------------------------------------------------------------------------------------- tiny tokenizer

class ByteTokenizer:
    """UTF-8 bytes at ids `byte + 3`; specials 0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|endofprompt|>`, then a few
    paralinguistic tags right after the 256 byte ids. Special-token strings in the text map to their ids."""

    BYTE_OFFSET = 3
    CORE_SPECIALS = ("<|endoftext|>", "<|im_start|>", ENDOFPROMPT)
    EXTRA_SPECIALS = ("<|im_end|>", "<|endofsystem|>", "[breath]", "[laughter]", "[noise]", "<strong>", "</strong>")

    def __init__(self, vocab_size: int = 512):
        needed = self.BYTE_OFFSET + 256 + len(self.EXTRA_SPECIALS)
        if vocab_size < needed:
            raise ConfigError(f"ByteTokenizer: vocab_size {vocab_size} too small (needs at least {needed})")
        self.vocab_size = vocab_size
        self.special_to_id = {t: i for i, t in enumerate(self.CORE_SPECIALS)}
        first_extra = self.BYTE_OFFSET + 256
        self.special_to_id.update({t: first_extra + i for i, t in enumerate(self.EXTRA_SPECIALS)})
        self.id_to_special = {i: t for t, i in self.special_to_id.items()}
        # longest first, so a special that is a prefix of another never wins
        alternatives = sorted(self.special_to_id, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in alternatives) + ")")

    @property
    def endofprompt_id(self) -> int:
        return self.special_to_id[ENDOFPROMPT]

    @property
    def eos_id(self) -> int:
        return self.special_to_id["<|endoftext|>"]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._special_re.split(text):
            if not piece:
                continue
            if piece in self.special_to_id:
                ids.append(self.special_to_id[piece])
            else:
                ids.extend(b + self.BYTE_OFFSET for b in piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            i = int(i)
            if self.BYTE_OFFSET <= i < self.BYTE_OFFSET + 256:
                pending.append(i - self.BYTE_OFFSET)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
            if i in self.id_to_special:
                if not skip_special_tokens:
                    out.append(self.id_to_special[i])
            elif not 0 <= i < self.vocab_size:
                raise InputError(f"ByteTokenizer.decode: id {i} outside the vocabulary [0, {self.vocab_size})")
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def __len__(self) -> int:
        return self.vocab_size


# --------------------------------------------------------------------------------------------- Qwen tokenizer

# CosyVoice3Tokenizer's additional special tokens, in upstream's order (ids follow this order after the Qwen2
# vocabulary; `<|im_start|>` / `<|im_end|>` already exist there, so `<|endofprompt|>` lands on 151646).
_ENGLISH_PHONES = [
    "AA", "AA0", "AA1", "AA2", "AE", "AE0", "AE1", "AE2", "AH", "AH0", "AH1", "AH2", "AO", "AO0", "AO1", "AO2",
    "AW", "AW0", "AW1", "AW2", "AY", "AY0", "AY1", "AY2", "B", "CH", "D", "DH", "EH", "EH0", "EH1", "EH2", "ER",
    "ER0", "ER1", "ER2", "EY", "EY0", "EY1", "EY2", "F", "G", "HH", "IH", "IH0", "IH1", "IH2", "IY", "IY0", "IY1",
    "IY2", "JH", "K", "L", "M", "N", "NG", "OW", "OW0", "OW1", "OW2", "OY", "OY0", "OY1", "OY2", "P", "R", "S", "SH",
    "T", "TH", "UH", "UH0", "UH1", "UH2", "UW", "UW0", "UW1", "UW2", "V", "W", "Y", "Z", "ZH",
]
_PINYIN_PHONES = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù iú "
    "iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà uài "
    "uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à "
    "ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi "
    "ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ"
).split()
COSYVOICE3_SPECIAL_TOKENS = [
    "<|im_start|>", "<|im_end|>", ENDOFPROMPT,
    "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
    "<|endofsystem|>",
    *(f"[{p}]" for p in _ENGLISH_PHONES),
    *(f"[{p}]" for p in _PINYIN_PHONES),
]


class QwenTokenizer:
    """`CosyVoice-BlankEN` Qwen2 tokenizer with the CosyVoice3 specials (upstream `get_qwen_tokenizer`, cosyvoice3).

    `expected_endofprompt_id` (151646 for the released model; None to skip the check) guards against a tokenizer
    directory whose vocabulary does not match the LM's text embedding.
    """

    def __init__(self, path: str, skip_special_tokens: bool = True,
                 expected_endofprompt_id: int | None = ENDOFPROMPT_TEXT_ID):
        if not os.path.isdir(path):
            raise ModelDirError(f"tokenizer directory not found: {path!r} (expected <model_dir>/CosyVoice-BlankEN)")
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - re-raised with the directory named
            raise ModelDirError(f"cannot load the tokenizer in {path!r}: {e}") from None
        tok.add_special_tokens({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                "additional_special_tokens": list(COSYVOICE3_SPECIAL_TOKENS)})
        self._tok = tok
        self.path = path
        self.skip_special_tokens = skip_special_tokens
        self.endofprompt_id = int(tok.convert_tokens_to_ids(ENDOFPROMPT))
        if expected_endofprompt_id is not None and self.endofprompt_id != expected_endofprompt_id:
            raise ConfigError(f"tokenizer {path!r}: {ENDOFPROMPT} maps to id {self.endofprompt_id}, expected "
                              f"{expected_endofprompt_id} (wrong or modified CosyVoice-BlankEN vocabulary)")

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok(text)["input_ids"]]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool | None = None) -> str:
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip)

    def __len__(self) -> int:
        return len(self._tok)
