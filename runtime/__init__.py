"""Runtime half: eager models, bucket selection, scheduler, pipeline, metrics.

`from cosytrt.runtime import TTS` is the library entry point.
"""


def __getattr__(name):  # lazy, so `import cosytrt.runtime.models.config` stays light
    if name == "TTS":
        from .tts import TTS

        return TTS
    raise AttributeError(name)


__all__ = ["TTS"]
