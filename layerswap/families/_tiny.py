"""The tiny configuration shared by the builtin families."""

from __future__ import annotations

from typing import Any

# big enough to be meaningful (several layers, grouped-query attention), small enough
# that build + forward takes well under a second on a CPU
TINY: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
