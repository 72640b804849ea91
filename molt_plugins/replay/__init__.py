"""First-party MoE routing-replay backends (R3, arXiv 2510.11370), one per ``model_type``.

* ``qwen3_moe`` -- :class:`~molt_plugins.replay.topk.Qwen3MoeReplay` (transformers'
  ``Qwen3MoeTopKRouter``: softmax over all experts, top-k, renormalised iff
  ``norm_topk_prob``, weights cast back to the logits' dtype);
* ``olmoe`` -- :class:`~molt_plugins.replay.topk.OlmoeReplay` (same arithmetic);
* ``mixtral`` -- :class:`~molt_plugins.replay.topk.MixtralReplay` (softmax, top-k, always
  renormalised = softmax over the top-k logits, weights kept in float32).
"""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_replay_backends(register):
    """Register ``qwen3_moe``, ``olmoe`` and ``mixtral``."""
    from molt_plugins.replay.topk import MixtralReplay, OlmoeReplay, Qwen3MoeReplay

    register("qwen3_moe", Qwen3MoeReplay())
    register("olmoe", OlmoeReplay())
    register("mixtral", MixtralReplay())
