"""Drop-in adapters for users of other TTS front ends: `CosyVoice3` / `AutoModel` with the official
FunAudioLLM/CosyVoice call shapes over cosytrt's runtime (see cosyvoice.py)."""


def __getattr__(name):  # lazy: importing the package loads no model code
    if name in ("AutoModel", "CosyVoice3", "load_spk2info", "resolve_model_dir", "speaker_from_upstream"):
        from . import cosyvoice

        return getattr(cosyvoice, name)
    raise AttributeError(name)


__all__ = ["AutoModel", "CosyVoice3", "load_spk2info", "resolve_model_dir", "speaker_from_upstream"]
