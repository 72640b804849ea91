"""molt-sdk core: typed, token-exact agentic RL for language models."""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("molt-sdk")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
