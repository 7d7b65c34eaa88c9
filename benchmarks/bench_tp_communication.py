"""Bytes communicated by one tensor-parallel training step: packed shards against gathers.

Two CPU processes (gloo) load the same Llama (hidden 512, 4 layers, 8 heads, 2 key/value
heads, vocabulary 1000) inside ``layerswap.use("llama.decoder.fused")`` with
``DistributedConfig(tp_size=2)`` and take one forward and backward pass on 4 x 128
tokens, counting the payload of every collective (all-reduce, all-gather,
reduce-scatter) rank 0 issues:

- ``packed``: layerswap's translated plan, ``qkv_proj`` and ``gate_up_proj``
  ``colwise`` (each rank its heads of q, k and v and its part of gate and up),
  ``o_proj``/``down_proj`` ``rowwise``: no gather inside a layer.
- ``gathered``: the same model under the form transformers gives phi3's own fused
  projections (``colwise_gather_output``, then ``rowwise_split_input``): an all-gather
  after each fused projection. Used here only to count its collectives, whose sizes
  depend on shapes alone (with packed weights its outputs are not the model's).

Run: ``python benchmarks/bench_tp_communication.py``.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter")
GATHERED_PLAN = {
    "model.layers.*.self_attn.qkv_proj": "colwise_gather_output",
    "model.layers.*.self_attn.o_proj": "rowwise_split_input",
    "model.layers.*.mlp.gate_up_proj": "colwise_gather_output",
    "model.layers.*.mlp.down_proj": "rowwise_split_input",
}


class CollectiveBytes(TorchDispatchMode):
    """Sums the bytes of the tensors handed to collectives, by collective."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if func.namespace in ("_c10d_functional", "c10d") and name.startswith(COLLECTIVES):
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            self.by_op[name] = self.by_op.get(name, 0) + size
        return func(*args, **(kwargs or {}))


def _rank(rank: int, port: int, checkpoint: str) -> None:
    addresses = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    os.environ.update(addresses, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import layerswap

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(minutes=5))
    input_ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(0))
    totals = {}
    for label, plan in (("packed", None), ("gathered", GATHERED_PLAN)):
        with layerswap.use("llama.decoder.fused"):
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint, distributed_config=DistributedConfig(tp_size=2, tp_plan=plan)
            )
        model.train()
        counter = CollectiveBytes()
        with counter:
            model(input_ids, labels=input_ids).loss.backward()
        totals[label] = sum(counter.by_op.values())
        if rank == 0:
            shown = ", ".join(
                f"{op} {size / 2**20:.2f}" for op, size in sorted(counter.by_op.items())
            )
            print(f"{label:9s} {totals[label] / 2**20:7.2f} MiB per step ({shown})", flush=True)
    if rank == 0:
        print(f"gathered / packed: {totals['gathered'] / totals['packed']:.2f}x", flush=True)
    dist.destroy_process_group()


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=1000,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        LlamaForCausalLM(config).save_pretrained(directory)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        print(f"torch {torch.__version__}, python {sys.version.split()[0]}, 2 ranks (gloo, CPU)")
        mp.spawn(_rank, args=(port, directory), nprocs=2)


if __name__ == "__main__":
    main()
