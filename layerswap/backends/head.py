"""What every replacement causal-LM head shares: the transformers ``*ForCausalLM`` head contract.

A head substitution keeps the model object and its modules; it changes the model's class
to a subclass of the original (``model.__class__ = Fused<Name>``) whose ``forward`` runs
the original's ``forward`` and, in training, takes the loss another way. Nothing is
converted: ``state_dict``, ``save_pretrained`` (``architectures`` included: the subclass
keeps the original's ``__name__``), tied embeddings and every parameter are untouched,
and undo is setting the class back.

What the original's ``forward`` does between ``self.lm_head(...)`` and its ``return`` is
read from the installed transformers source (:func:`head_contract`): a family's
``final_logit_softcapping``, ``logits_scaling`` or ``logit_scale`` is found there and
reproduced; anything else after the projection (a router's auxiliary loss, a second
head) is refused with :class:`~layerswap.errors.UpstreamDriftError` naming the statement.

The training path (``labels`` given, model in training mode): the original ``forward``
runs with ``labels=None`` while a pre-hook on ``lm_head`` records its input and hands it
an empty sequence, so no logits are computed; the backend's ``loss`` then computes the
language-modelling loss from the recorded hidden states, as transformers'
``ForCausalLMLoss`` does (label shift, ``shift_labels``, ``ignore_index``,
``num_items_in_batch``). ``logits`` is then ``None``; pass ``skip_logits=False`` to get
the original computation (and the logits) instead. Without labels, or in eval mode, the
original ``forward`` runs untouched.

Example::

    class PlainHead(CausalLMHead):
        backend = "plain"

        def _loss(self, hidden, weight, bias, targets, transforms, ignore_index):
            return my_summed_cross_entropy(...)

    BACKEND = Backend(name="plain", slots={"head": head_implementation(PlainHead, ...)})
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from layerswap import zero3
from layerswap.adapter_layers import is_adapter_layer
from layerswap.backend import Implementation
from layerswap.backends.declarations.head_slot import head_refusal, head_slot
from layerswap.backends.head_contract import HeadContract, head_contract, read_path
from layerswap.backends.per_family import class_named, family_class
from layerswap.errors import ParallelismError, UnsupportedModelError, UpstreamDriftError
from layerswap.family import Family
from layerswap.ops.linear_cross_entropy import LogitTransform
from layerswap.substitution import Substitution, UpstreamCheck
from layerswap.trials import not_built
from layerswap.weights import Converter

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "CausalLMHead",
    "HeadContract",
    "check_head",
    "fused_loss_in_eval",
    "head_class",
    "head_class_named",
    "head_contract",
    "head_implementation",
    "head_refusal",
]

# --- the replacement class ----------------------------------------------------------------

# set by the head slot's forward context: the fused loss also in eval mode (logits kept)
_FUSED_IN_EVAL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "layerswap_fused_loss_in_eval", default=False
)


@contextlib.contextmanager
def fused_loss_in_eval() -> Iterator[None]:
    """Inside the block a swapped head takes its fused loss in eval mode too, logits kept.

    Verification runs models in eval mode (no dropout); this makes it compare the loss and
    gradients of the path training takes, next to the logits of the inference path.
    """
    token = _FUSED_IN_EVAL.set(True)
    try:
        yield
    finally:
        _FUSED_IN_EVAL.reset(token)


class CausalLMHead(nn.Module):
    """Mixed in before a family's ``*ForCausalLM``: the head-slot ``forward`` (module docstring).

    A backend subclasses it and implements :meth:`_summed_loss`. The contract is read
    when the class is made: :func:`head_class` raises :class:`UpstreamDriftError` for a
    family whose head it cannot reproduce.
    """

    backend: ClassVar[str] = ""
    summary: ClassVar[str] = "causal-LM head"
    _layerswap_original: ClassVar[type[nn.Module]]
    _layerswap_family: ClassVar[str]
    _layerswap_contract: ClassVar[HeadContract]

    def _summed_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        transforms: Sequence[LogitTransform],
        ignore_index: int,
    ) -> torch.Tensor:
        """The summed cross-entropy of ``transforms(F.linear(hidden, weight, bias))``."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"head={self._layerswap_family}.head.{self.backend} ({self.summary})"

    def _layerswap_forward(self, *args: Any, **kwargs: Any) -> Any:
        original = self._layerswap_original.forward
        skip_logits = kwargs.pop("skip_logits", None)
        signature = inspect.signature(original)
        bound = signature.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None or skip_logits is False:
            return original(self, *args, **kwargs)
        if skip_logits is None and not self.training:
            if not _FUSED_IN_EVAL.get():
                return original(self, *args, **kwargs)
            keep_logits = True
        else:
            keep_logits = False
        extra = _var_keyword(signature, bound)
        config = getattr(self, "config", None)
        if "return_dict" in signature.parameters:  # a parameter of its own (BLOOM, MPT)
            return_dict = bound.arguments.get("return_dict")
            bound.arguments["return_dict"] = True
        else:
            return_dict = extra.pop("return_dict", None)
            extra["return_dict"] = True
        if return_dict is None:
            return_dict = getattr(config, "return_dict", True)
        bound.arguments["labels"] = None
        output, projected = self._projected_input(
            lambda: original(*bound.args, **bound.kwargs), keep_logits
        )
        loss = self._causal_lm_loss(projected, labels, extra)
        coef = self._layerswap_contract.aux_coef
        aux = output.get("aux_loss") if coef is not None else None
        if aux is not None:  # the router loss the original adds (output_router_logits)
            loss = loss + read_path(self, coef) * aux.to(loss.device)  # type: ignore[arg-type]
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        output = type(output)(loss=loss, logits=output.logits if keep_logits else None, **fields)
        if return_dict is not False:
            return output
        # to_tuple() leaves out what is None: the logits not computed keep their place, so
        # that the tuple's positions are the original's
        values = output.to_tuple()
        return values if keep_logits else (*values[:1], None, *values[1:])

    def _projected_input(
        self, run: Callable[[], Any], keep_logits: bool
    ) -> tuple[Any, torch.Tensor]:
        """Run the original forward; record what the head (``lm_head``) receives (and skip it
        unless kept)."""
        lm_head = self.get_submodule(self._layerswap_contract.head)
        self._check_head(lm_head)
        recorded: list[torch.Tensor] = []
        thread = threading.get_ident()

        def record(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            if threading.get_ident() != thread or recorded:
                return None  # another thread's call on this model, or a second projection
            (hidden,) = args
            recorded.append(hidden)
            return None if keep_logits else (hidden.narrow(-2, 0, 0),)

        handle = lm_head.register_forward_pre_hook(record)
        try:
            output = run()
        finally:
            handle.remove()
        if len(recorded) != 1:
            raise UnsupportedModelError(
                f"{type(self).__name__}.forward did not call {self._layerswap_contract.head} "
                "once; the fused head "
                "cannot find the hidden states it projects"
            )
        return output, recorded[0]

    def _check_head(self, lm_head: nn.Module) -> None:
        name = f"{self._layerswap_family}.head.{self.backend}"
        head = self._layerswap_contract.head  # lm_head, unless the model names it otherwise
        if _fsdp_unit(lm_head):
            raise ParallelismError(
                f"{name} reads {head}'s weight outside {head}.forward, but {head} is its "
                f"own FSDP unit (fully_shard({head})), whose weight is sharded there; shard "
                f"{head} with its parent (fully_shard(model) without fully_shard({head})), "
                "or undo the head swap"
            )
        if is_adapter_layer(lm_head):
            raise UnsupportedModelError(
                f"{name} computes {head} as a plain nn.Linear from {head}.weight, but this "
                f"model's {head} is a PEFT {type(lm_head).__qualname__} (an adapter on "
                f"{head}, or {head} in modules_to_save): the fused loss would bypass it and "
                f"train something else. Leave {head} out of the adapter, merge it "
                "(merge_and_unload), or undo the head swap"
            )
        if type(lm_head) is not nn.Linear:
            raise UnsupportedModelError(
                f"{name} computes {head} as a plain nn.Linear, but this model's {head} is a "
                f"{type(lm_head).__module__}.{type(lm_head).__qualname__} (an adapter or a "
                "quantised layer?); its own computation would be bypassed. Undo the head "
                "swap, or merge the adapter first"
            )
        if any(p.is_shard() for p in getattr(lm_head.weight, "placements", ())):
            raise ParallelismError(
                f"{name} projects onto the whole vocabulary, but tensor parallelism split "
                f"{head}'s weight across ranks; shard only the decoder layers (no head "
                "substitution), or load the model without tensor parallelism"
            )
        # DeepSpeed ZeRO-3's own hooks gather and release the weight: the loss gathers it
        hooks = [
            hook
            for attribute in ("_forward_hooks", "_forward_pre_hooks")
            for hook in getattr(lm_head, attribute).values()
            if not zero3.is_partitioning_hook(hook)
        ]
        if hooks:
            raise UnsupportedModelError(
                f"{name} does not run {head} on the full hidden states, so the hooks on it "
                f"would not see them: {', '.join(map(repr, hooks))}"
            )
        from transformers.loss.loss_utils import ForCausalLMLoss

        loss_function = getattr(self, "loss_function", None)
        if loss_function is not ForCausalLMLoss:
            raise UnsupportedModelError(
                f"{name} reproduces transformers' ForCausalLMLoss, but this model's "
                f"loss_function is {loss_function!r}"
            )

    def _causal_lm_loss(
        self, hidden: torch.Tensor, labels: torch.Tensor, extra: dict[str, Any]
    ) -> torch.Tensor:
        """transformers' ``ForCausalLMLoss`` on the projection of ``hidden``, without logits."""
        ignore_index = int(extra.get("ignore_index", -100))
        targets = extra.get("shift_labels")
        if targets is None:
            targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = targets.reshape(-1).to(hidden.device)
        rows = hidden.reshape(-1, hidden.shape[-1])
        if rows.shape[0] != targets.shape[0]:
            raise UnsupportedModelError(
                f"the head projects {rows.shape[0]} positions (hidden states "
                f"{tuple(hidden.shape)}) but there are {targets.shape[0]} labels; with "
                "logits_to_keep, pass labels (or shift_labels) for the kept positions only"
            )
        lm_head = self.get_submodule(self._layerswap_contract.head)
        assert isinstance(lm_head, nn.Linear)  # _check_head refused anything else
        # under ZeRO-3 lm_head's weight is whole only inside lm_head.forward: gather it here
        # (read-only; its gradient, computed in this pass, reaches the partitioned parameter)
        tensors = [lm_head.weight] if lm_head.bias is None else [lm_head.weight, lm_head.bias]
        with zero3.gathered(tensors):
            summed = self._summed_loss(
                rows,
                lm_head.weight,
                lm_head.bias,
                targets,
                self._layerswap_contract.transforms(self),
                ignore_index,
            )
        num_items = extra.get("num_items_in_batch")
        if num_items is None:
            return summed / (targets != ignore_index).sum()
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.to(summed.device)
        result: torch.Tensor = summed / num_items
        return result


def _fsdp_unit(module: nn.Module) -> bool:
    """Whether ``module`` is its own FSDP2 unit (``fully_shard(module)``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def _var_keyword(signature: inspect.Signature, bound: inspect.BoundArguments) -> dict[str, Any]:
    """The ``**kwargs`` dict of a bound call (created empty when absent)."""
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            extra: dict[str, Any] = bound.arguments.setdefault(parameter.name, {})
            return extra
    raise UpstreamDriftError(
        "the original forward takes no **kwargs; the head substitution passes "
        "return_dict and reads num_items_in_batch through them"
    )


def head_class(base: type[CausalLMHead], family: Family) -> type[nn.Module]:
    """``base`` mixed into ``family``'s causal LM class (made once, then cached).

    The class keeps the original's ``__name__`` (``save_pretrained`` writes it into
    ``architectures``; the Trainer reads it) and is importable from ``base``'s module under
    its ``__qualname__``, ``<Backend><Original>`` (``FusedLlamaForCausalLM``): the head
    slot's substitutions name it so (resolved on use, by :func:`head_class_named`); a pickle
    holds how to make it again (:mod:`layerswap.backends.per_family`).
    """
    original = family.causal_lm_class()
    qualname = f"{base.backend.capitalize()}{original.__name__}"

    def make(meta: type[type]) -> type[nn.Module]:
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return CausalLMHead._layerswap_forward(self, *args, **kwargs)

        forward.__signature__ = inspect.signature(original.forward)  # type: ignore[attr-defined]
        forward.__doc__ = original.forward.__doc__
        forward.__qualname__ = f"{qualname}.forward"
        made: type[nn.Module] = meta(
            original.__name__,
            (base, original),
            {
                "__module__": base.__module__,
                "__qualname__": qualname,
                "forward": forward,
                "_layerswap_original": original,
                "_layerswap_family": family.name,
                "_layerswap_contract": head_contract(original),
            },
        )
        return made

    # a class made for a causal LM that was since replaced (a patched module) is made again
    return family_class(
        base,
        family,
        make,
        factory=head_class,
        current=lambda made: getattr(made, "_layerswap_original", None) is original,
    )


def head_class_named(base: type[CausalLMHead], qualname: str) -> type[nn.Module]:
    """The head class called ``qualname`` (``FusedLlamaForCausalLM``), for its module's
    ``__getattr__``: the head slot's substitutions name their class so, and it is made on
    first use, for the causal-LM class the family has then."""
    prefix = base.backend.capitalize()
    return class_named(
        base,
        qualname,
        lambda family: f"{prefix}{family.causal_lm}",
        lambda family: head_class(base, family),
    )


def check_head(sub: Substitution, config: PreTrainedConfig) -> None:
    """The original causal LM's ``forward`` still has the head the substitution reproduces."""
    head_contract(sub.original_class())


def head_implementation(
    base: type[CausalLMHead],
    *,
    description: str,
    upstream: UpstreamCheck = check_head,
) -> Implementation:
    """The ``head`` slot of a backend whose head is ``base``: the family's causal LM class
    made a subclass of ``base`` (lazily, by name: ``"<module>:Fused<Original>"``), no
    weights converted, verified with the fused loss in eval mode too.

    Example::

        Backend(name="mine", slots={"head": head_implementation(MyHead, description="...")})
    """
    module = sys.modules[base.__module__].__name__
    return head_slot(module, base.backend.capitalize(), description=description, upstream=upstream)


def read_head_refusal(family: Family) -> str | None:
    """Why the head substitution cannot take ``family``'s causal LM, read from its source
    now (:func:`~layerswap.backends.declarations.head_slot.head_refusal` keeps the answer per
    transformers release)."""
    try:
        contract = head_contract(family.causal_lm_class())
    except UpstreamDriftError as exc:
        return str(exc)
    # a model type no family covers, or a head of another name: the head, on the meta device
    if not family.decoder or contract.head != "lm_head":
        try:
            with torch.device("meta"):
                head = getattr(family.causal_lm_class()(family.tiny_config()), contract.head, None)
        except Exception as exc:
            return not_built(exc)
        if type(head) is not nn.Linear:
            return (
                f"its {contract.head} is a {type(head).__module__}.{type(head).__qualname__}, "
                "not the plain nn.Linear the fused loss computes"
            )
    return None


def no_conversion(family: Family) -> Converter:
    """A head converts no weights."""
    return Converter()
