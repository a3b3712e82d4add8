"""Drop-in adapters for users of other TTS front ends (the official CosyVoice repository)."""
