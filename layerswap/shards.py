"""One parameter's shard, and the parts of a concatenation on one rank.

Under tensor parallelism (or FSDP loading) a rank holds a slice of each parameter
(:class:`Shard`, read off a ``DTensor``): the converters concatenate and split the
parts a rank holds (:func:`local_part_sizes`, :func:`stretch`), gather them from every
rank when a whole tensor is needed (:func:`gather_parts`), and write whole tensors in the
original layout (:func:`unpack_gathered`). What the plan shards is
:mod:`layerswap.parallel`'s.

Example::

    shard = parameter_shard(layer.qkv_proj.weight, 0)
    local_part_sizes([64, 16, 16], shard)     # each part's rows on this rank
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from layerswap.errors import ConversionError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Shard",
    "gather_parts",
    "local_part_sizes",
    "parameter_shard",
    "stretch",
    "unpack_gathered",
]


@dataclass(frozen=True)
class Shard:
    """How a parameter is split along one dimension: ``ranks`` ranks of a mesh dimension.

    ``packed`` when the mesh dimension is tensor parallel (each concatenated part is
    split, each rank holding its share of every part), else contiguous (FSDP: each
    rank holds its stretch of the whole tensor). ``group`` is that dimension's
    process group.
    """

    rank: int
    ranks: int
    packed: bool
    group: Any


def parameter_shard(param: Any, dim: int) -> Shard | None:
    """How ``param`` (a DTensor when transformers sharded the model) is split along ``dim``.

    ``None`` when it is whole there. Raises :class:`ConversionError` for layouts the
    converter cannot follow (split along ``dim`` over several mesh dimensions, or
    strided).

    Example::

        parameter_shard(model.get_parameter("model.layers.0.self_attn.qkv_proj.weight"), 0)
    """
    placements = getattr(param, "placements", None)
    mesh = getattr(param, "device_mesh", None)
    if placements is None or mesh is None:
        return None
    found = []
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_shard():
            if type(placement).__name__ == "_StridedShard":
                raise ConversionError(
                    f"a parameter split {placement} cannot hold a layerswap concatenation"
                )
            continue
        if placement.dim % param.ndim == dim % param.ndim:
            found.append(mesh_dim)
    if not found:
        return None
    if len(found) > 1:
        raise ConversionError(
            "a parameter split along the same dimension over several mesh dimensions "
            f"({placements}) cannot hold a layerswap concatenation; shard it over one"
        )
    (mesh_dim,) = found
    names = mesh.mesh_dim_names or ()
    packed = mesh_dim < len(names) and names[mesh_dim] == "tp"
    return Shard(
        rank=mesh.get_local_rank(mesh_dim),
        ranks=mesh.size(mesh_dim),
        packed=packed,
        group=mesh.get_group(mesh_dim),
    )


def _chunks(size: int, ranks: int) -> list[int]:
    """The extents ``torch.chunk`` (and so DTensor's ``Shard``) gives each of ``ranks``."""
    each = -(-size // ranks)
    return [max(0, min(each, size - each * rank)) for rank in range(ranks)]


def stretch(size: int, shard: Shard) -> tuple[int, int]:
    """Where this rank's contiguous stretch of ``size`` starts, and how long it is."""
    extents = _chunks(size, shard.ranks)
    return sum(extents[: shard.rank]), extents[shard.rank]


def local_part_sizes(sizes: Sequence[int], shard: Shard) -> list[int]:
    """Each concatenated part's extent on this rank, as transformers read it for ``shard``."""
    return [_chunks(size, shard.ranks)[shard.rank] for size in sizes]


def gather_parts(
    parts: Sequence[torch.Tensor], sizes: Sequence[int], dim: int, shard: Shard
) -> list[torch.Tensor]:
    """The whole parts, from each rank's slice of them (a collective over ``shard.group``)."""
    import torch
    import torch.distributed as dist

    whole = []
    for part, size in zip(parts, sizes, strict=True):
        extents = _chunks(size, shard.ranks)
        widest = max(extents)
        padded_shape = list(part.shape)
        padded_shape[dim] = widest
        padded = part.new_zeros(padded_shape)
        padded.narrow(dim, 0, part.shape[dim]).copy_(part)
        received = [torch.empty_like(padded) for _ in range(shard.ranks)]
        dist.all_gather(received, padded.contiguous(), group=shard.group)
        whole.append(
            torch.cat(
                [
                    piece.narrow(dim, 0, extent)
                    for piece, extent in zip(received, extents, strict=True)
                ],
                dim=dim,
            )
        )
    return whole


def unpack_gathered(
    tensor: torch.Tensor, sizes: Sequence[int], dim: int, ranks: int
) -> torch.Tensor:
    """``[q; k; v]`` from a packed tensor gathered over ``ranks`` ranks (``[q0 k0 v0 q1 k1 v1]``).

    Example::

        unpack_gathered(full_qkv, (256, 64, 64), 0, ranks=2)
    """
    import torch

    per_rank = [_chunks(size, ranks) for size in sizes]
    pieces = torch.split(tensor, [sum(p[r] for p in per_rank) for r in range(ranks)], dim=dim)
    by_part: list[list[torch.Tensor]] = [[] for _ in sizes]
    for rank, piece in enumerate(pieces):
        for index, part in enumerate(torch.split(piece, [p[rank] for p in per_rank], dim=dim)):
            by_part[index].append(part)
    return torch.cat([torch.cat(chunks, dim=dim) for chunks in by_part], dim=dim)
