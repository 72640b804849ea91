"""Test-wide settings: single-threaded torch, offline hubs."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# the tests run their own code, not a model's: the sandbox's process fallback may run it as root (a CI
# container without bubblewrap or unshare); tests/test_sandbox.py checks the refusal without it
os.environ.setdefault("MOLT_SANDBOX_PROCESS_AS_ROOT", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


import pytest  # noqa: E402

#: the builtin tiny vision-language model of the image tests
VL = "builtin:tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def vl_tok():
    """The tokenizer of ``builtin:tiny-qwen2.5-vl`` (the text vocabulary + vision tokens 512..515)."""
    from molt_core.models import load_tokenizer

    return load_tokenizer(VL)


@pytest.fixture(scope="module")
def vl_vp(vl_tok):
    """Its ``VisionProcessor`` (module scope: its processed-pixel cache is not shared across files)."""
    from molt_plugins.vision.processor import load_vision_processor

    return load_vision_processor(VL, vl_tok)


@pytest.fixture(scope="module")
def vl(vl_tok, vl_vp):
    """``(tokenizer, VisionProcessor)`` of ``builtin:tiny-qwen2.5-vl``."""
    return vl_tok, vl_vp
