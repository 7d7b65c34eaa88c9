"""``patches(...)``: several patches, all or nothing (``patch_many([...])``, its alias for a list)."""

from __future__ import annotations

from collections.abc import Iterable

from layerswap.errors import TargetTypeError
from layerswap.patching.scoped import Scoped

__all__ = ["PatchGroup", "patch_many", "patches"]


class PatchGroup(Scoped):
    """Starts its members in order; if the k-th fails, the first k-1 are stopped again.

    Stopping stops the members in reverse order.
    """

    def __init__(self, members: Iterable[Scoped]) -> None:
        self._members = list(members)
        for member in self._members:
            if not isinstance(member, Scoped):
                raise TargetTypeError(
                    f"patches() takes patch objects (patch(), patch_dict(), wrap(), use()...), "
                    f"got {member!r}"
                )
        self._members_started: list[Scoped] = []

    @property
    def members(self) -> list[Scoped]:
        return list(self._members)

    def _label(self) -> str:
        return "patches(" + ", ".join(m._label() for m in self._members) + ")"

    def _copy(self) -> PatchGroup:
        return PatchGroup(m._copy() for m in self._members)

    def _apply(self) -> None:
        started: list[Scoped] = []
        origin = self._origin_for_members()
        try:
            for member in self._members:
                member._start(manual=False, origin=origin)
                started.append(member)
        except BaseException:
            for member in reversed(started):
                member.stop()
            raise
        self._members_started = started

    def _origin_for_members(self) -> tuple[str, int, str]:
        from layerswap.patching.scoped import _caller_origin

        return _caller_origin()

    def _revert(self) -> None:
        started, self._members_started = self._members_started, []
        errors: list[BaseException] = []
        for member in reversed(started):
            try:
                member.stop()
            except BaseException as exc:  # stop the rest, then re-raise the first
                errors.append(exc)
        if errors:
            raise errors[0]


def patches(*members: Scoped) -> PatchGroup:
    """Group patches into one all-or-nothing unit.

    Starting the group starts the members in order; if one fails, those already
    started are stopped again and the error propagates. Stopping the group stops
    them newest first.

    Example::

        with layerswap.patches(
            layerswap.patch("pkg.mod:A", new_a),
            layerswap.patch_dict(os.environ, {"X": "1"}),
        ):
            ...
    """
    return PatchGroup(members)


def patch_many(members: Iterable[Scoped]) -> PatchGroup:
    """:func:`patches` for patches already in a list (or any iterable).

    ``patch_many(ps)`` is ``patches(*ps)``; the alias is kept for code that builds
    its patches in a list first.

    Example::

        timers = [layerswap.wrap(layer, "forward", profiled(stats)) for layer in layers]
        with layerswap.patch_many(timers):
            model(input_ids)
    """
    return patches(*members)
