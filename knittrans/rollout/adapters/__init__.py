"""Pure conversions from engine outputs (transformers ``generate()``, vLLM ``RequestOutput``) to groups."""

from __future__ import annotations

from knittrans.rollout.adapters.hf import groups_from_generate_output, sampled_logprobs
from knittrans.rollout.adapters.trajectory import to_trajectory_group
from knittrans.rollout.adapters.vllm import group_from_request_output, vllm_prompt

__all__ = [
    "group_from_request_output",
    "groups_from_generate_output",
    "sampled_logprobs",
    "to_trajectory_group",
    "vllm_prompt",
]
