"""The vLLM engine (:mod:`.engine`, extra ``molt-sdk[vllm]``) and its ``collective``
weight-sync transport (:mod:`.weight_sync`: trainer rank 0 -> every vLLM worker, no vLLM
import on the sender's side)."""
