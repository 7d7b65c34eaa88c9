"""Your own decoder layer as a layerswap substitution, and a new model family.

1. ``PackedLlamaLayer`` names its weights like Meta's reference Llama code
   (``wqkv``, ``wo``, ``w13``, ``w2``, ``attn_norm``, ``mlp_norm``). A converter of
   four rules maps the transformers layout onto it; the substitution is registered,
   swapped into a model, checked against the original, saved in the original
   layout and loaded back with ``use``.
2. A family is one ``Family`` declaration. Ministral's, written by hand here, is
   exactly what layerswap infers from transformers' modeling module for its builtin
   ``ministral`` family; the ``fused`` backend serves it.

Run: ``python examples/custom_substitution.py``
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import layerswap
from layerswap.backends.fused import FusedRMSNorm
from layerswap.family import Family
from layerswap.substitution import Substitution
from layerswap.weights import Converter, Rename, gate_up_concat, head_dim, qkv_concat, qkv_sizes


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split convention (as transformers' Llama)."""
    half = x.shape[-1] // 2
    rotated: torch.Tensor = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    return rotated


class PackedLlamaLayer(nn.Module):
    """A Llama decoder layer with packed projections, following the transformers 5 contract."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim(config)
        self.sizes = list(qkv_sizes(config))
        hidden, inter = config.hidden_size, config.intermediate_size
        self.attn_norm = FusedRMSNorm(hidden, config.rms_norm_eps)
        self.wqkv = nn.Linear(hidden, sum(self.sizes), bias=False)
        self.wo = nn.Linear(self.sizes[0], hidden, bias=False)
        self.mlp_norm = FusedRMSNorm(hidden, config.rms_norm_eps)
        self.w13 = nn.Linear(hidden, 2 * inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    #: what transformers calls a decoder layer with, on every release layerswap supports:
    #: read below through layerswap.read_layer_call, so the upstream check lets it run
    handles = layerswap.LAYER_CALL_PARAMETERS

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        # the cache as this transformers release passes it (cache or past_key_values)
        call = layerswap.read_layer_call(
            kwargs, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            use_cache=use_cache, position_embeddings=position_embeddings,
        )  # fmt: skip
        assert position_embeddings is not None, "transformers 5 passes (cos, sin)"
        batch, length, _ = hidden_states.shape
        q, k, v = (
            part.view(batch, length, -1, self.head_dim).transpose(1, 2)
            for part in self.wqkv(self.attn_norm(hidden_states)).split(self.sizes, dim=-1)
        )
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = call.cache.update(k, v, self.layer_idx, position_embeddings)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None and length > 1
        )
        hidden_states = hidden_states + self.wo(attended.transpose(1, 2).reshape(batch, length, -1))
        gate, up = self.w13(self.mlp_norm(hidden_states)).chunk(2, dim=-1)
        output: torch.Tensor = hidden_states + self.w2(F.silu(gate) * up)
        return output


PACKED = Substitution(
    name="llama.decoder.packed",
    family="llama",
    backend="packed",
    original="transformers.models.llama.modeling_llama:LlamaDecoderLayer",
    replacement=PackedLlamaLayer,
    # passthrough=False: every tensor must be named by a rule, nothing slips by
    converter=Converter(
        (
            Rename("input_layernorm.weight", "attn_norm.weight"),
            qkv_concat("wqkv"),
            Rename("self_attn.o_proj.weight", "wo.weight"),
            Rename("post_attention_layernorm.weight", "mlp_norm.weight"),
            gate_up_concat("w13"),
            Rename("mlp.down_proj.weight", "w2.weight"),
        ),
        passthrough=False,
    ),
    description="Meta-style packed projections (example)",
)

MINISTRAL = Family(
    name="ministral",
    model_type="ministral",
    module="transformers.models.ministral.modeling_ministral",
    decoder="MinistralDecoderLayer",
    config_class="MinistralConfig",
    causal_lm="MinistralForCausalLM",
    qkv_bias=False,
    o_bias=False,
    tiny={
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "sliding_window": 8,
    },
)


def max_difference(model: nn.Module, ids: torch.Tensor, expected: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(ids).logits - expected).abs().max())


def main() -> dict[str, float]:
    differences = {}

    # 1. a custom layer for an existing family
    layerswap.register(PACKED, replace=True)
    llama = layerswap.families()["llama"]
    model = llama.build(llama.tiny_config(num_hidden_layers=2), seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
    handle = layerswap.swap(model, "llama.decoder.packed")
    print(handle.report())
    differences["swapped"] = max_difference(model, ids, expected)

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)  # written in the original (transformers) layout
        plain = llama.causal_lm_class().from_pretrained(directory)
        differences["saved, loaded by plain transformers"] = max_difference(plain, ids, expected)
        with layerswap.use("llama.decoder.packed"):
            packed = llama.causal_lm_class().from_pretrained(directory)
        assert isinstance(packed.model.layers[0], PackedLlamaLayer)
        differences["loaded inside use()"] = max_difference(packed, ids, expected)
    handle.undo()
    differences["after undo"] = max_difference(model, ids, expected)

    # a variant is one dataclasses.replace away (here: refuse to run without CUDA)
    gpu_only = dataclasses.replace(
        PACKED,
        name="llama.decoder.packed-gpu",
        requirement=lambda: None if torch.cuda.is_available() else "needs CUDA",
    )
    print(f"{gpu_only.name}: {gpu_only.unmet_requirement() or 'runs here'}")

    # 2. a family: one declaration (for a family transformers adds later, pass it to
    # register_family); this one equals the declaration inferred from transformers
    assert layerswap.families()["ministral"] == MINISTRAL
    ministral = MINISTRAL.build(seed=0)
    ids = torch.randint(0, ministral.config.vocab_size, (1, 20))
    with torch.no_grad():
        expected = ministral(ids).logits
    with layerswap.swap(ministral, backend="fused"):
        differences["ministral fused"] = max_difference(ministral, ids, expected)

    for what, difference in differences.items():
        print(f"max |logit difference| {what:<38} {difference:.1e}")
        assert difference < 1e-5, what
    return differences


if __name__ == "__main__":
    main()
