"""One model's pass over the verification inputs: logits, layer outputs, loss, gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from layerswap.comparison.inputs import pad_token_id, text_config
from layerswap.comparison.model_classes import ModelTask, task_of
from layerswap.comparison.routing import Routing, capture_decode_routing, capture_routing
from layerswap.errors import UnsupportedModelError
from layerswap.model import decoder_layers_if_known

__all__ = [
    "ContextFactory",
    "HookFactory",
    "Run",
    "capture_layers",
    "evaluation",
    "forward",
    "generate_tokens",
    "layer_hooks",
    "layer_output",
]

ContextFactory: TypeAlias = Callable[[], contextlib.AbstractContextManager[Any]]
# (position, decoder layer) -> the handle of the hook it registered on that layer
HookFactory: TypeAlias = Callable[[int, nn.Module], RemovableHandle]


@dataclass
class Run:
    """What one model produced on the verification inputs (valid positions only).

    ``gradients`` are keyed and shaped as in the original model once the caller has
    mapped a swapped model's gradients back.
    """

    logits: torch.Tensor
    is_logits: bool
    layers: list[tuple[str, torch.Tensor]]
    loss: float | None = None
    gradients: dict[str, torch.Tensor] | None = None
    tokens: torch.Tensor | None = None
    #: the logits each greedily generated token was chosen from, ``[batch, new, vocab]``
    token_logits: torch.Tensor | None = None
    #: per decoder layer, its mixture-of-experts routing of the valid tokens (``None`` for
    #: a dense layer); ``None`` for a model without such blocks or a pass not recording it
    routing: list[Routing | None] | None = None
    #: per step of cached decoding (step 0: the prompt; step ``t``: the token generated at
    #: step ``t - 1``), per decoder layer, its mixture-of-experts routing
    #: (:func:`~layerswap.comparison.routing.capture_decode_routing`); ``None``: not recorded
    decode_routing: list[list[Routing | None]] | None = None
    #: ``[batch, seq]``: the positions whose loss terms the loss and gradients left out
    #: (``forward(left_out=...)``); ``None``: it learnt from every position
    loss_left_out: torch.Tensor | None = None
    #: per step of cached decoding after the prompt (step ``t``: the token generated at
    #: step ``t - 1`` fed in), every decoder layer's output at that token, ``[batch,
    #: hidden]`` on the host; ``None``: not recorded
    decode_layers: list[list[tuple[str, torch.Tensor]]] | None = None


def layer_output(output: Any) -> torch.Tensor:
    """The hidden states a decoder layer returned."""
    # transformers 5 decoder layers return a tensor; older ones and some replacements
    # return a tuple whose first element is the hidden states
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"a decoder layer returned {type(output).__name__}, expected a tensor")


@contextlib.contextmanager
def layer_hooks(layers: Sequence[tuple[str, nn.Module]], register: HookFactory) -> Iterator[None]:
    """``register(position, layer)`` for every decoder layer; the hooks removed on exit."""
    handles: list[RemovableHandle] = []
    try:
        for position, (_, layer) in enumerate(layers):
            handles.append(register(position, layer))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_layers(
    layers: Sequence[tuple[str, nn.Module]], valid: torch.Tensor
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Record each decoder layer's output at the valid positions; hooks removed on exit.

    Forward hooks run in the order they were registered: hooks registered before these
    (one replacing a layer's output, say) have their effect recorded.
    """
    captured: list[tuple[str, torch.Tensor]] = []

    def recorder(position: int, layer: nn.Module) -> RemovableHandle:
        name = layers[position][0]

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            captured.append((name, layer_output(output).detach()[valid].clone()))

        return layer.register_forward_hook(hook)

    with layer_hooks(layers, recorder):
        yield captured


@contextlib.contextmanager
def evaluation(model: nn.Module, *, training: bool = False) -> Iterator[None]:
    """Eval mode (no dropout) for the duration, or training mode with ``training``; every
    module's own flag restored after."""
    flags = [(module, module.training) for module in model.modules()]
    try:
        model.train(training)
        yield
    finally:
        for module, training_flag in flags:
            module.training = training_flag


def forward(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    backward: bool = False,
    loss: bool = False,
    generate: int = 0,
    context: ContextFactory = contextlib.nullcontext,
    routing: bool = True,
    left_out: torch.Tensor | None = None,
    layer_outputs: bool = True,
    training: bool = False,
    outputs: bool = True,
) -> Run:
    """One forward pass, capturing every decoder layer's output, in ``context``.

    ``loss`` records the loss of the model's head (:mod:`layerswap.comparison.model_classes`: the
    language-modelling loss of a causal LM, the classification loss of a classifier...);
    ``backward`` also takes its gradient for every trainable parameter, by
    ``torch.autograd.grad`` rather than ``loss.backward()``, which leaves every ``.grad``
    as it was. ``generate`` then greedily generates that many tokens. ``routing`` records
    each mixture-of-experts block's routing (:mod:`layerswap.comparison.routing`; nothing is
    hooked in a model without one). ``left_out`` (``[batch, seq]``) masks those
    positions' terms out of the loss (:meth:`~layerswap.comparison.model_classes.ModelTask.labels`).
    ``layer_outputs=False`` captures no layer's output (``Run.layers`` is empty): a check of
    the model's outputs alone does not pay for a copy of every layer's. ``training`` runs
    the pass in training mode (eval mode by default: no dropout). ``outputs=False`` keeps
    no output (``Run.logits`` is empty): a loss taken for its gradients alone, where a
    head's training path returns no logits.
    """
    task = task_of(model)
    task.check(model, batch, generate=generate)
    valid = batch["attention_mask"].bool()
    wants_loss = loss or backward
    labels = task.labels(batch, text_config(model), left_out=left_out) if wants_loss else {}
    gradients = None
    loss_value: torch.Tensor | None = None
    layers = decoder_layers_if_known(model) if routing or layer_outputs else []
    recording = capture_routing(layers, valid) if routing else contextlib.nullcontext(None)
    capturing: contextlib.AbstractContextManager[list[tuple[str, torch.Tensor]]] = (
        capture_layers(layers, valid) if layer_outputs else contextlib.nullcontext([])
    )
    with capturing as captured, recording as routed, evaluation(model, training=training):
        if not backward:
            with torch.no_grad(), context():
                output = model(**batch, **labels, use_cache=False)
                if wants_loss:
                    loss_value = task.loss(output, batch)
        else:
            output, loss_value, gradients = _with_gradients(model, batch, labels, task, context)
    compared, is_logits = task.compared(output, valid) if outputs else (torch.empty(0), True)
    decoded: list[list[tuple[str, torch.Tensor]]] | None = (
        [] if generate and layer_outputs else None
    )
    tokens, token_logits, decode_routing = (
        _generate(model, batch, generate, context, routing=routing, decode_layers=decoded)
        if generate
        else (None, None, None)
    )
    return Run(
        compared.detach(),
        is_logits,
        list(captured),
        loss=float(loss_value.detach()) if loss_value is not None else None,
        gradients=gradients,
        tokens=tokens,
        token_logits=token_logits,
        routing=routed,
        decode_routing=decode_routing,
        loss_left_out=left_out if wants_loss else None,
        decode_layers=decoded,
    )


def _with_gradients(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    labels: Mapping[str, torch.Tensor],
    task: ModelTask,
    context: ContextFactory,
) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
    """The output, the loss and every trainable parameter's gradient by name (a zero
    tensor where the loss does not reach it), by ``torch.autograd.grad``: every
    ``.grad`` is left as it was."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with torch.enable_grad(), context():
        output = model(**batch, **labels, use_cache=False)
        loss_value = task.loss(output, batch)
        grads = torch.autograd.grad(loss_value, [p for _, p in params], allow_unused=True)
    # kept in host memory: a model's worth of gradients must not crowd the GPU
    gradients = {
        name: (grad if grad is not None else torch.zeros_like(param)).detach().cpu()
        for (name, param), grad in zip(params, grads, strict=True)
    }
    return output, loss_value, gradients


@contextlib.contextmanager
def _capture_decode_outputs(
    layers: list[tuple[str, nn.Module]], steps: list[list[tuple[str, torch.Tensor]]]
) -> Iterator[None]:
    """Append to ``steps``, for every decoding step after the prompt, each layer's output
    at the token fed (``[batch, hidden]``, on the host)."""
    calls = [0] * len(layers)

    def hook_for(position: int, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            step = calls[position]
            calls[position] += 1
            if step == 0:
                return  # the prompt: compared by the forward pass
            while len(steps) < step:
                steps.append([])
            hidden = layer_output(output)
            steps[step - 1].append((name, hidden[:, -1].detach().float().cpu()))

        return hook

    handles = [
        layer.register_forward_hook(hook_for(position, name))
        for position, (name, layer) in enumerate(layers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def generate_tokens(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    new_tokens: int,
    context: ContextFactory = contextlib.nullcontext,
    *,
    cache: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_tokens`` greedily generated tokens per sequence, and the logits each was
    chosen from (``[batch, new_tokens, vocab]``), on the host.

    ``generate`` runs the prompt once and then one token at a time with the KV cache, as
    users decode: a layer that mishandles the cache shows here, not in a forward pass.
    ``cache`` is the cache implementation (``"static"``; ``None``: the model's default,
    a dynamic cache).
    """
    tokens, logits, _ = _generate(model, batch, new_tokens, context, cache=cache)
    return tokens, logits


def _generate(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    new_tokens: int,
    context: ContextFactory = contextlib.nullcontext,
    *,
    cache: str | None = None,
    routing: bool = False,
    decode_layers: list[list[tuple[str, torch.Tensor]]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[list[Routing | None]] | None]:
    """:func:`generate_tokens`, and with ``routing`` each decoding step's mixture-of-experts
    routing (:func:`~layerswap.comparison.routing.capture_decode_routing`); ``decode_layers``
    (a list) gets every decoding step's layer outputs (:attr:`Run.decode_layers`)."""
    # disable_compile: on a GPU, generate() with a static cache compiles the forward
    # (transformers' auto-compile); what is compared is what the layers compute, eagerly,
    # the same on every device (TransformerEngine 2.20's attention cannot be traced by
    # torch 2.11's dynamo: compiling would refuse te for a reason that is not the layer's)
    options: dict[str, Any] = {"disable_compile": True}
    if cache is not None:
        options["cache_implementation"] = cache
    config = text_config(model)
    generate = getattr(model, "generate", None)
    if generate is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot generate; use generate=0 or a *ForCausalLM model"
        )
    layers = decoder_layers_if_known(model) if routing or decode_layers is not None else []
    recording = (
        capture_decode_routing(layers, batch["attention_mask"].bool())
        if routing
        else contextlib.nullcontext(None)
    )
    outputs = (
        _capture_decode_outputs(layers, decode_layers)
        if decode_layers is not None
        else contextlib.nullcontext()
    )
    with recording as decode_routing, outputs, evaluation(model), torch.no_grad(), context():
        sequences = generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad_token_id(config),
            output_logits=True,
            return_dict_in_generate=True,
            **options,
        )
    tokens: torch.Tensor = sequences.sequences[:, batch["input_ids"].shape[1] :].detach().cpu()
    logits = torch.stack([step.detach().float().cpu() for step in sequences.logits], dim=1)
    return tokens, logits, decode_routing
