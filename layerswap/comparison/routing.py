"""Mixture-of-experts routing in one pass: the experts each token went to, and whether the
reference could tell them from the next ones (a near-tie).

A transformers 5 mixture-of-experts block ranks its experts for each token (router logits,
probabilities, or scores with a correction bias), keeps the top ``k`` with ``topk``, and
hands their indices to its ``experts`` module: ``experts(hidden_states, top_k_index,
top_k_weights)``. Both are read off the running block rather than declared per family: a
forward pre-hook on ``experts`` records the indices, and a :class:`TorchFunctionMode`
open only while the block routes (from the block's start to the ``experts`` call) records
every ``topk`` it computes; the one that chose those indices holds the scores the block
ranked by. A block routed some other way (no ``topk`` that chose them) records its
indices and no near-ties, so nothing it routes is ever excused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

__all__ = [
    "NEAR_TIE_EPSILONS",
    "Routing",
    "capture_decode_routing",
    "capture_routing",
    "moe_block",
    "near_ties",
]

#: a token's top-k choice is a near-tie when the scores of its k-th and (k+1)-th experts
#: are within this many machine epsilons of the block's dtype, times the token's largest
#: score magnitude (see :func:`near_ties`)
NEAR_TIE_EPSILONS = 4

_TOPK: tuple[Callable[..., Any], ...] = (torch.topk, torch.Tensor.topk)


@dataclass(frozen=True)
class Routing:
    """One mixture-of-experts block's routing of the valid tokens, in the order of the
    captured layer outputs (``output[valid]``).

    ``selected`` is ``[tokens, k]``, each row's experts in ascending order (a set);
    ``near_tie`` is ``[tokens]``, whether that set was a near-tie in the scores the block
    ranked by, or ``None`` where the ranking was not seen.
    """

    selected: torch.Tensor
    near_tie: torch.Tensor | None


def moe_block(layer: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The mixture-of-experts block inside a decoder layer and its ``experts`` module (the
    first module holding a child named ``experts``), or ``None`` for a dense layer."""
    for module in layer.modules():
        experts = getattr(module, "_modules", {}).get("experts")
        if isinstance(experts, nn.Module):
            return module, experts
    return None


def near_ties(scores: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Per row of ``scores`` (``[tokens, experts]``): whether its top-``k`` set is a near-tie.

    The margin between the k-th and the (k+1)-th score is at most
    :data:`NEAR_TIE_EPSILONS` epsilons of ``dtype`` (the block's dtype) times the row's
    largest score magnitude. Why that scale: the scores are dot products of the block's
    input, which carries the rounding of every layer before it, so a run that rounds
    differently moves each score by a few units in the last place of the *largest* terms,
    not of the score itself, and a margin that small does not decide the routing at this
    precision. With ``k`` equal to the number of experts there is no boundary: no tie.

    Example::

        >>> near_ties(torch.tensor([[3.0, 1.0, 1.0], [3.0, 2.0, 1.0]]), 2, torch.bfloat16)
        tensor([ True, False])
    """
    rows = scores.detach().reshape(-1, scores.shape[-1]).to(torch.float32)
    if k >= rows.shape[-1]:
        return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    ranked = rows.topk(k + 1, dim=-1).values
    margin = ranked[:, k - 1] - ranked[:, k]
    resolution = NEAR_TIE_EPSILONS * torch.finfo(dtype).eps * rows.abs().amax(dim=-1)
    return margin <= resolution


class _RankingRecorder(TorchFunctionMode):
    """Every ``topk`` computed while it is open: the scores ranked and the indices kept."""

    def __init__(self) -> None:
        super().__init__()
        self.rankings: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in _TOPK and args and isinstance(args[0], torch.Tensor):
            self.rankings.append((args[0], result[1]))
        return result


def _expert_indices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The expert indices an ``experts`` module was called with: its first integer tensor
    after the hidden states (``top_k_index``; GPT-OSS's ``router_indices``)."""
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            return value
    return None


def _routing(
    indices: torch.Tensor,
    rankings: Sequence[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    valid: torch.Tensor | None,
) -> Routing | None:
    """The routing of the valid tokens, with near-ties from the ``topk`` that chose
    ``indices``; ``None`` when the block saw other than one row per position of ``valid``
    (``valid`` ``None``: every row it saw is kept)."""
    k = indices.shape[-1]
    chosen = indices.detach().reshape(-1, k).sort(dim=-1).values
    if valid is None:
        valid = torch.ones(chosen.shape[0], dtype=torch.bool)
    if chosen.shape[0] != valid.numel():
        return None
    tie = next(
        (
            near_ties(scores, k, dtype)
            for scores, kept in reversed(rankings)
            if kept.shape[-1] == k
            and kept.numel() == chosen.numel()
            and torch.equal(kept.reshape(-1, k).sort(dim=-1).values, chosen)
        ),
        None,
    )
    flat = valid.reshape(-1).to(chosen.device)
    return Routing(chosen[flat], tie[flat.to(tie.device)] if tie is not None else None)


#: called with a decoder layer's position, its block's expert indices, the ``topk`` seen
#: while it routed, and its dtype: each time the block routes
_Routed = Callable[
    [int, torch.Tensor, Sequence[tuple[torch.Tensor, torch.Tensor]], torch.dtype], None
]


@contextlib.contextmanager
def _watching(
    blocks: Sequence[tuple[nn.Module, nn.Module] | None],
    routed: _Routed,
    wanted: Callable[[int], bool],
) -> Iterator[None]:
    """Hook every block: while one routes (and ``wanted(position)``), a recorder of its
    ``topk``; at its ``experts`` call, ``routed(...)``. Hooks removed on exit."""
    # the recorder open while a block routes, and the stack that closes it
    open_recorder: list[tuple[_RankingRecorder, contextlib.ExitStack]] = []
    handles: list[RemovableHandle] = []

    def close() -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not open_recorder:
            return []
        recorder, stack = open_recorder.pop()
        stack.close()
        return recorder.rankings

    def watch(position: int, block: nn.Module, experts: nn.Module) -> None:
        def start(module: nn.Module, args: Any) -> None:
            if wanted(position) and not open_recorder:
                stack = contextlib.ExitStack()
                open_recorder.append((stack.enter_context(_RankingRecorder()), stack))

        def routed_to(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            rankings = close()
            indices = _expert_indices(args, kwargs)
            if not wanted(position) or indices is None or not args:
                return
            dtype = args[0].dtype if isinstance(args[0], torch.Tensor) else torch.float32
            routed(position, indices, rankings, dtype)

        def end(module: nn.Module, args: Any, output: Any) -> None:
            close()  # routed without calling experts, or raised: never leave the mode open

        handles.append(block.register_forward_pre_hook(start))
        handles.append(experts.register_forward_pre_hook(routed_to, with_kwargs=True))
        handles.append(block.register_forward_hook(end, always_call=True))

    try:
        for position, found in enumerate(blocks):
            if found is not None:
                watch(position, *found)
        yield
    finally:
        close()
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_routing(
    layers: Sequence[tuple[str, nn.Module]], valid: torch.Tensor
) -> Iterator[list[Routing | None] | None]:
    """Record each decoder layer's mixture-of-experts routing (one entry per layer, ``None``
    for a dense layer); hooks removed on exit. A model without such a block gets no hook
    and ``None``: its pass is exactly what it was. Only a block's first call is kept."""
    blocks = [moe_block(layer) for _, layer in layers]
    if all(found is None for found in blocks):
        yield None
        return
    routed: list[Routing | None] = [None] * len(layers)
    seen = [False] * len(layers)

    def record(
        position: int,
        indices: torch.Tensor,
        rankings: Sequence[tuple[torch.Tensor, torch.Tensor]],
        dtype: torch.dtype,
    ) -> None:
        seen[position] = True
        routed[position] = _routing(indices, rankings, dtype, valid)

    with _watching(blocks, record, lambda position: not seen[position]):
        yield routed


@contextlib.contextmanager
def capture_decode_routing(
    layers: Sequence[tuple[str, nn.Module]], prompt: torch.Tensor
) -> Iterator[list[list[Routing | None]] | None]:
    """Record each decoder layer's mixture-of-experts routing at every step of cached
    decoding: one entry per step (per layer, as :func:`capture_routing`). Step 0 runs the
    prompt (its valid positions: ``prompt``, ``[batch, seq]``); every later step one token
    per sequence, the one generated at the step before (its rows: the batch's sequences).
    ``None`` for a model without such blocks (nothing hooked)."""
    blocks = [moe_block(layer) for _, layer in layers]
    if all(found is None for found in blocks):
        yield None
        return
    calls: list[list[Routing | None]] = [[] for _ in layers]

    def record(
        position: int,
        indices: torch.Tensor,
        rankings: Sequence[tuple[torch.Tensor, torch.Tensor]],
        dtype: torch.dtype,
    ) -> None:
        valid = prompt if not calls[position] else None
        calls[position].append(_routing(indices, rankings, dtype, valid))

    steps: list[list[Routing | None]] = []
    try:
        with _watching(blocks, record, lambda position: True):
            yield steps
    finally:
        # per step, every layer's routing (a dense layer, or a step a block missed: None)
        count = max(len(layer_calls) for layer_calls in calls)
        steps.extend(
            [
                layer_calls[step]
                if blocks[position] is not None and step < len(layer_calls)
                else None
                for position, layer_calls in enumerate(calls)
            ]
            for step in range(count)
        )
