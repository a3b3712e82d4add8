"""cosytrt: compiled-engine inference toolkit for CosyVoice3 text-to-speech."""

__version__ = "0.1.0"
