"""vLLM worker extension: load new policy weights from a safetensors file inside each worker.

Passed to vLLM as ``LLM(..., worker_extension_cls="knittrans.rollout.vllm_worker.WeightFileLoader")``;
vLLM mixes the class into its worker, so ``llm.collective_rpc("knittrans_load_weights_file",
args=(path,))`` runs :meth:`WeightFileLoader.knittrans_load_weights_file` in every worker
process. Only the path crosses the RPC; each worker reads the tensors itself and hands them,
in checkpoint (Hugging Face) naming, to the worker's own ``reload_weights`` (vLLM 0.32:
``Worker.reload_weights(weights_iterator=...)`` → ``model.load_weights``). This module must not
import vllm at import time of :mod:`knittrans` (it is only imported by vLLM workers).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["WeightFileLoader"]

logger = logging.getLogger(__name__)


class WeightFileLoader:
    """Mixin for the vLLM worker; ``self`` is the vLLM ``Worker`` at run time."""

    def knittrans_load_weights_file(self, path: str) -> int:
        """Load every tensor of ``path`` (memory-mapped, one at a time) into the worker's model in place; return
        how many.

        Raises:
            KeyError: a tensor name the model does not have (raised by vLLM's loader).
        """
        from safetensors import safe_open

        worker: Any = self
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            worker.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in names))
        logger.info("loaded %d tensors from %s", len(names), path)
        return len(names)
