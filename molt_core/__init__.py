"""molt-sdk core: typed, token-exact agentic RL for language models."""

from importlib.metadata import PackageNotFoundError, version as _version

from molt_core import _moved

try:
    __version__ = _version("molt-sdk")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+local"

_moved.install()  # old module paths keep working for one minor release, with a warning

__all__ = ["__version__"]
