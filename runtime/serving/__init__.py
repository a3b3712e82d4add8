"""The OpenAI-compatible speech server (`trtbuild serve`): settings, errors, encodings, metrics, admission, voices
and the FastAPI app. FastAPI / uvicorn are imported only inside `create_app` / `serve`."""
from .app import create_app, serve
from .settings import ServerSettings, missing_serve_packages

__all__ = ["create_app", "serve", "ServerSettings", "missing_serve_packages"]
