"""The rows a comparison leaves out: tokens the candidate routed to other experts where the
reference's own routing was a near-tie, and what those tokens reach after.

A mixture-of-experts router whose k-th and (k+1)-th experts score within rounding of each
other (:func:`~layerswap.verify.routing.near_ties`) is decided by rounding: the original in
bfloat16 routes such tokens differently from itself in float32, and a correct swap, which
only rounds differently, may too. The token's hidden state then differs by a whole expert's
output, which no tolerance should absorb, and which says nothing about the swap. So:

* at the layer where the candidate routes a token differently and the reference was at a
  near-tie, that token's row is left out of the layer's comparison (its *near-tie*);
* from the next layer on, that token and every later position of its sequence (a causal
  decoder's attention carries the change there, and only there) are left out too, and so
  are their rows of the logits; a sequence whose last token is left out has its pooled
  output and its cached decoding left out (both read that token, and decoding the keys
  and values the near-tie changed);
* with ``backward=True`` the loss learns from none of the rows left out of the output
  (:mod:`layerswap.verify.kept_loss`);
* everything else is compared as before, with the same tolerance: a token routed
  differently where the reference was not at a near-tie fails its layer, and a router
  computed wrong moves every token's routing weights, so the rows still compared fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from layerswap.verify.routing import Routing

__all__ = ["Excused", "excused_rows"]


@dataclass(frozen=True)
class Excused:
    """Per decoder layer, the rows (valid tokens) left out of its comparison (``rows``) and
    how many of them are that layer's own near-tie flips (``near_ties``); ``positions`` is
    each row's (sequence, position) in the batch."""

    rows: list[torch.Tensor]
    near_ties: list[int]
    positions: torch.Tensor

    @property
    def after_last_layer(self) -> torch.Tensor:
        """The rows left out of what the model outputs (the last layer's, and its own flips)."""
        return self.rows[-1]

    def output_positions(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """``[batch, seq]`` (``shape``): the positions whose rows are left out after the last
        layer, where the model's output is read; the loss then learns from none of them
        (see :mod:`layerswap.verify.kept_loss`)."""
        left_out = torch.zeros(shape, dtype=torch.bool)
        left_out[self.positions[:, 0], self.positions[:, 1]] = self.after_last_layer.cpu()
        return left_out

    def sequences(self, batch: int) -> torch.Tensor:
        """``[batch]``: whether a sequence's last token is excused after the last layer. Its
        pooled output and its decoding read that token, and the cached keys and values of
        every excused token from the layer after its near-tie on (which the suffix reaches
        first at that layer: the last token is excused exactly when one of them exists)."""
        last_rows = torch.zeros(batch, dtype=torch.long).scatter_reduce_(
            0, self.positions[:, 0], torch.arange(len(self.positions)), reduce="amax"
        )
        hit = torch.zeros(batch, dtype=torch.bool)
        present = torch.zeros(batch, dtype=torch.bool)
        present[self.positions[:, 0]] = True
        hit[present] = self.after_last_layer.cpu()[last_rows[present]]
        return hit


def _flipped_at_a_near_tie(reference: Routing, candidate: Routing) -> torch.Tensor | None:
    """Rows routed to another set of experts in the candidate, at a near-tie in the reference."""
    if reference.near_tie is None or reference.selected.shape != candidate.selected.shape:
        return None
    other = candidate.selected.to(reference.selected.device)
    flipped = (reference.selected != other).any(dim=-1)
    return (flipped & reference.near_tie.to(flipped.device)).cpu()


def excused_rows(
    reference: Sequence[Routing | None] | None,
    candidate: Sequence[Routing | None] | None,
    valid: torch.Tensor,
) -> Excused | None:
    """The rows each layer's comparison leaves out (see the module docstring), or ``None``
    where neither run routed through a mixture-of-experts block or no token needs it."""
    if reference is None or candidate is None or len(reference) != len(candidate):
        return None
    positions = valid.cpu().nonzero()
    sequences, places = positions[:, 0], positions[:, 1]
    # per sequence, the first position an earlier layer's near-tie reaches (none: past the end)
    reached_from = torch.full((valid.shape[0],), valid.shape[1], dtype=torch.long)
    rows, counts = [], []
    for ref, cand in zip(reference, candidate, strict=True):
        downstream = places >= reached_from[sequences]
        ties = None
        if ref is not None and cand is not None:
            ties = _flipped_at_a_near_tie(ref, cand)
        if ties is None:
            ties = torch.zeros_like(downstream)
        ties &= ~downstream
        rows.append(downstream | ties)
        counts.append(int(ties.sum()))
        if ties.any():
            reached_from.scatter_reduce_(0, sequences[ties], places[ties], reduce="amin")
    if not any(counts):
        return None
    return Excused(rows, counts, positions)
