"""The rows a comparison leaves out: tokens the candidate routed to other experts where the
reference's own routing was a near-tie, and what those tokens reach after.

A mixture-of-experts router whose k-th and (k+1)-th experts score within rounding of each
other (:func:`~layerswap.comparison.routing.near_ties`) is decided by rounding: the original in
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
* in cached decoding (:func:`decoding_excused_from`), a token the candidate routes
  differently at a reference near-tie while decoding (the prompt at step 0, the token
  generated at step ``t - 1`` at step ``t``), its sequence having generated the same
  tokens before, leaves out that step of its sequence and every later one: their logits,
  and their tokens (greedy decoding reads each from the step's logits);
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

from layerswap.comparison.routing import Routing

__all__ = ["Excused", "decoding_excused_from", "excused_rows"]


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


def decoding_excused_from(
    reference: Sequence[Sequence[Routing | None]] | None,
    candidate: Sequence[Sequence[Routing | None]] | None,
    reference_tokens: torch.Tensor,
    candidate_tokens: torch.Tensor,
    prompt: torch.Tensor,
) -> torch.Tensor | None:
    """``[batch]``: per sequence, the first step of cached decoding left out (the number of
    steps where none is), or ``None`` where nothing is.

    Step ``t`` (:attr:`~layerswap.comparison.forward.Run.decode_routing`; step 0 routes the
    prompt's valid positions, ``prompt`` ``[batch, seq]``, step ``t > 0`` the token each
    sequence generated at step ``t - 1``) is left out of a sequence where, at any layer,
    the candidate routes one of that step's tokens of the sequence to other experts at a
    near-tie of the reference's: the step's logits then differ by an expert's output, and
    so may every later token (greedy) and logit. Only where the sequence generated the
    same tokens before that step in both runs: a token routed otherwise after the tokens
    parted routes another input, and is the comparison's to judge.
    """
    if reference is None or candidate is None:
        return None
    batch, new = reference_tokens.shape[0], reference_tokens.shape[1]
    sequences_of_prompt = prompt.cpu().nonzero()[:, 0]
    width = min(new, candidate_tokens.shape[1])
    same = (
        reference_tokens[:, :width] == candidate_tokens[:, :width].to(reference_tokens.device)
    ).cpu()
    # same_before[:, t]: the sequence generated the same tokens at steps 0 .. t - 1
    same_before = torch.ones(batch, width + 1, dtype=torch.bool)
    same_before[:, 1:] = same.cumprod(dim=1).bool()
    first = torch.full((batch,), new, dtype=torch.long)
    for step, (ref_layers, cand_layers) in enumerate(zip(reference, candidate, strict=False)):
        if step >= new or step > width:
            break
        rows_to_sequences = sequences_of_prompt if step == 0 else torch.arange(batch)
        for ref, cand in zip(ref_layers, cand_layers, strict=False):
            if ref is None or cand is None:
                continue
            flips = _flipped_at_a_near_tie(ref, cand)
            if flips is None or flips.shape[0] != rows_to_sequences.shape[0]:
                continue
            hit = torch.zeros(batch, dtype=torch.bool)
            hit[rows_to_sequences[flips]] = True
            hit &= same_before[:, step]
            first[hit] = torch.minimum(first[hit], torch.tensor(step))
    return first if bool((first < new).any()) else None
