"""The error types, re-exported for users of `cosytrt.runtime` (they are defined in `cosytrt.engines.errors`, the
bottom layer, so every layer raises the same classes)."""
from ..engines.errors import *  # noqa: F401,F403
from ..engines.errors import __all__  # noqa: F401
