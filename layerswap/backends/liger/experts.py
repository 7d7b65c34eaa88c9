"""The ``liger`` backend's experts: Liger-Kernel's fused mixture-of-experts kernel
(``LigerFusedMoEFunction``, what Liger's own ``LigerExperts`` runs), one Triton pass over
every (token, chosen expert) pair for the gate/up product, SwiGLU and down projection
(GPU only).

The kernel takes the layout of Mixtral's and Qwen3-MoE's experts: ``gate_up_proj`` of
``experts x 2·intermediate x hidden`` with the gate first, ``down_proj`` of ``experts x
hidden x intermediate``, no biases, SiLU; experts laid out otherwise (transposed, gate and
up interleaved, biased, normed after each expert) or gated otherwise stay the original's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from layerswap.backends.experts import ExpertsReplacement
from layerswap.experts import ExpertsSpec

__all__ = ["LigerExperts"]


class LigerExperts(ExpertsReplacement):
    """A model's own experts computed by Liger's fused mixture-of-experts kernel."""

    backend = "liger"
    kernels: ClassVar[Mapping[str, Any]] = {"silu": True}

    @classmethod
    def layout_refusal(cls, spec: ExpertsSpec) -> str | None:
        held = [
            word
            for flag, word in (
                (spec.transposed, "transposed weights"),
                (not spec.concatenated, "gate and up interleaved"),
                (spec.bias, "biases"),
                (spec.post_norm, "a norm after each expert"),
            )
            if flag
        ]
        if held:
            return f"Liger's fused MoE kernel takes no {', '.join(held)}"
        return None

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        index = top_k_index.reshape(-1, top_k_index.shape[-1]).int()
        weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
        out: Tensor = LigerFusedMoEFunction.apply(
            x, self.gate_up_proj, self.down_proj, index, weights
        )
        return out.reshape(shape)
