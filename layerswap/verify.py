"""Proof that a swapped model still computes what the original computes.

:func:`verify` runs the original model and the model with a substitution applied on the
same inputs and the same weights, and compares the logits (max absolute and relative
error, cosine similarity, top-1 agreement, KL divergence) and the output of every
decoder layer, captured with forward hooks. It names the first decoder layer whose
output is over tolerance, which is where a wrong weight mapping or a wrong kernel shows
up first. ``backward=True`` also compares the loss and every gradient (the candidate's
gradients mapped back to the original layout through the substitution's converter);
``generate=N`` compares ``N`` greedily generated tokens.

Two designs, one report:

* **full** (default): the model is deep-copied (and cast to ``dtype`` / moved to
  ``device``); the copy runs as the reference, is swapped in place, and runs again as the
  candidate. The candidate therefore holds exactly the reference's weights, converted.
  Memory: the model plus one copy.
* **streaming** (``streaming=True``): nothing is copied when the model already lives on
  the target device in the target dtype. A reference pass records every layer's output;
  a second pass replaces each decoder layer's output, through a forward hook, by the
  output of a replacement layer built from that layer's weights on the fly and dropped
  right after. The second pass therefore computes the swapped model's activations while
  only one replacement layer exists at a time. Memory: one model plus one layer.

The model passed in is never modified: its weights, gradients, hooks and training flags
are as they were when :func:`verify` returns, whatever happened inside.

Example::

    import layerswap

    model = layerswap.families()["llama"].build()      # tiny config, random weights
    report = layerswap.verify(model, "llama.decoder.fused")
    assert report.passed, report.summary()
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch
from torch import nn

from layerswap.errors import RequirementError, VerificationError

if TYPE_CHECKING:
    from layerswap.substitution import Substitution

__all__ = [
    "BackwardReport",
    "GenerationReport",
    "GradientReport",
    "LayerReport",
    "Tolerance",
    "VerificationReport",
    "assert_equivalent",
    "default_inputs",
    "resolve_device",
    "resolve_dtype",
    "verify",
]

DTypeLike: TypeAlias = "str | torch.dtype | None"
DeviceLike: TypeAlias = "str | torch.device | None"
InputsLike: TypeAlias = "torch.Tensor | Mapping[str, Any] | None"
SubstitutionLike: TypeAlias = "str | Substitution"

# --------------------------------------------------------------------------- dtypes, devices

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: DTypeLike) -> torch.dtype | None:
    """The ``torch.dtype`` named by ``dtype`` (``"bfloat16"``, ``"bf16"``, ``torch.half``...).

    ``None`` stays ``None`` (keep the model's dtype). Unknown names raise ``ValueError``
    listing the accepted ones.

    Example::

        >>> resolve_dtype("bf16")
        torch.bfloat16
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return _DTYPES[key]


def resolve_device(device: DeviceLike) -> torch.device | None:
    """The ``torch.device`` named by ``device``; ``"auto"`` is CUDA when present, else CPU.

    ``None`` stays ``None`` (keep the model's device). Asking for CUDA on a machine
    without it raises :class:`~layerswap.errors.RequirementError`.

    Example::

        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is None:
        return None
    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RequirementError(
            f"CUDA was requested but is not available (torch {torch.__version__})"
        )
    return resolved


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- tolerances


@dataclass(frozen=True)
class Tolerance:
    """How far a candidate may be from the reference and still count as the same model.

    A tensor passes when ``max|candidate - reference| <= atol + rtol * max|reference|``
    and the lowest cosine similarity between matching token vectors is at least
    ``min_cosine``. Errors are scaled by the reference's largest magnitude, not taken
    element by element, because element-wise relative errors explode on values near zero
    that carry no information. Gradients use ``gradient_rtol`` in place of ``rtol``
    (a backward pass goes through twice as many roundings); generated tokens must agree
    on at least ``min_token_agreement`` of the positions.

    Example::

        >>> Tolerance.for_dtype("bfloat16").rtol
        0.05
        >>> Tolerance.coerce(1e-3, "float32").atol
        0.001
    """

    atol: float
    rtol: float
    min_cosine: float
    gradient_rtol: float
    min_token_agreement: float = 1.0

    def allows(self, max_abs_error: float, scale: float, *, gradient: bool = False) -> bool:
        """Whether an error of ``max_abs_error`` on values of magnitude ``scale`` passes."""
        rtol = self.gradient_rtol if gradient else self.rtol
        return max_abs_error <= self.atol + rtol * scale

    @classmethod
    def for_dtype(cls, dtype: DTypeLike) -> Tolerance:
        """The default tolerance for computations in ``dtype`` (``"fp8"`` is accepted)."""
        if isinstance(dtype, str) and dtype.strip().lower() in ("fp8", "float8"):
            return _DEFAULT_TOLERANCES["fp8"]
        resolved = resolve_dtype(dtype) or torch.float32
        return _DEFAULT_TOLERANCES.get(_dtype_name(resolved), _DEFAULT_TOLERANCES["float32"])

    @classmethod
    def coerce(cls, tolerance: float | Tolerance | None, dtype: DTypeLike) -> Tolerance:
        """A :class:`Tolerance` from ``None`` (dtype default), a number or a Tolerance.

        A number sets both ``atol`` and ``rtol`` (and ``gradient_rtol``); the cosine and
        token thresholds stay the dtype's defaults.
        """
        if isinstance(tolerance, Tolerance):
            return tolerance
        default = cls.for_dtype(dtype)
        if tolerance is None:
            return default
        value = float(tolerance)
        if not value >= 0:
            raise ValueError(f"tolerance must be a non-negative number, got {tolerance!r}")
        return dataclasses.replace(default, atol=value, rtol=value, gradient_rtol=value)


# Why these numbers: a float32 swap only reorders roundings (fused matmuls, another
# attention kernel), which moves results by ~1e-7 relative per op; 1e-4 leaves room for a
# few dozen layers and still catches any wrong weight, which moves them by percents.
# bfloat16 keeps 8 bits of mantissa (relative step 2**-8 ~ 4e-3) and float16 11 bits
# (~5e-4); a few such steps add up over the layers. FP8 matmuls (e4m3, 3 bits) are
# coarser still, so only the direction of the output is held tightly.
_DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-5, rtol=1e-4, min_cosine=0.99999, gradient_rtol=1e-3),
    "float16": Tolerance(atol=1e-3, rtol=1e-2, min_cosine=0.9995, gradient_rtol=5e-2),
    "bfloat16": Tolerance(
        atol=1e-2, rtol=5e-2, min_cosine=0.995, gradient_rtol=0.1, min_token_agreement=0.75
    ),
    "fp8": Tolerance(
        atol=5e-2, rtol=0.25, min_cosine=0.95, gradient_rtol=0.5, min_token_agreement=0.5
    ),
}


# --------------------------------------------------------------------------- reports


def _finite_or_str(value: Any) -> Any:
    """Strict JSON has no NaN or infinity: write those as strings, keep everything else."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite_or_str(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_str(item) for item in value]
    return value


@dataclass(frozen=True)
class LayerReport:
    """The comparison of one decoder layer's output (valid, non-padded positions only)."""

    index: int
    name: str
    max_abs_error: float
    max_rel_error: float
    cosine: float
    passed: bool


@dataclass(frozen=True)
class GradientReport:
    """The comparison of one parameter's gradient, in the original layout."""

    name: str
    max_abs_error: float
    max_rel_error: float
    cosine: float
    passed: bool


@dataclass(frozen=True)
class BackwardReport:
    """Loss and gradients of the candidate against the reference.

    In streaming mode the gradients are per layer ("local"): each layer gets the
    reference's input for that layer and the same upstream gradient, so a difference
    points at that layer alone; the loss is still the whole model's.
    """

    passed: bool
    loss_reference: float
    loss_candidate: float
    loss_abs_error: float
    max_abs_error: float
    max_rel_error: float
    cosine: float
    gradients: tuple[GradientReport, ...]
    first_divergent_parameter: str | None
    local: bool = False


@dataclass(frozen=True)
class GenerationReport:
    """Greedy generation of ``new_tokens`` tokens by both models from the same prompt."""

    passed: bool
    new_tokens: int
    agreement: float
    first_mismatch: int | None
    reference_tokens: tuple[tuple[int, ...], ...]
    candidate_tokens: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class VerificationReport:
    """Everything :func:`verify` measured; ``passed`` is the verdict.

    ``max_abs_error``, ``max_rel_error``, ``cosine``, ``top1_agreement`` and ``kl`` are
    about the logits; ``layers`` has one entry per decoder layer, in order, and
    ``first_divergent_layer`` is the index of the first one over tolerance (or ``None``).

    Example::

        report = layerswap.verify(model, "llama.decoder.fused")
        print(report.summary())
        json.loads(report.to_json())["layers"][0]["cosine"]
    """

    passed: bool
    substitution: str | None
    mode: Literal["full", "streaming", "models"]
    device: str
    dtype: str
    tolerance: Tolerance
    max_abs_error: float
    max_rel_error: float
    cosine: float
    top1_agreement: float | None
    kl: float | None
    logits_passed: bool
    layers: tuple[LayerReport, ...]
    first_divergent_layer: int | None
    batch: int
    seq_len: int
    backward: BackwardReport | None = None
    generation: GenerationReport | None = None

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (nested dataclasses become dicts, tuples become lists)."""
        return dataclasses.asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        """Strict JSON (non-finite numbers written as strings); kwargs go to json.dumps."""
        return json.dumps(_finite_or_str(self.to_dict()), allow_nan=False, **kwargs)

    @property
    def first_divergent(self) -> LayerReport | None:
        """The :class:`LayerReport` of the first divergent layer, if any."""
        if self.first_divergent_layer is None:
            return None
        return self.layers[self.first_divergent_layer]

    def summary(self) -> str:
        """A few readable lines: verdict, logits metrics, and what diverged first."""
        verdict = "PASS" if self.passed else "FAIL"
        what = self.substitution or "candidate"
        lines = [
            f"{verdict}: {what} vs original ({self.mode}, {self.device}, {self.dtype}, "
            f"{self.batch}x{self.seq_len} tokens)",
            f"logits: max abs {self.max_abs_error:.3g}, max rel {self.max_rel_error:.3g}, "
            f"cosine {self.cosine:.6f}"
            + (f", top-1 {self.top1_agreement:.1%}" if self.top1_agreement is not None else "")
            + (f", KL {self.kl:.3g}" if self.kl is not None else ""),
        ]
        lines.extend(self._problems())
        return "\n".join(lines)

    def _problems(self) -> list[str]:
        tol = self.tolerance
        problems: list[str] = []
        layer = self.first_divergent
        if layer is not None:
            problems.append(
                f"first divergent layer: {layer.index} ({layer.name}): max abs error "
                f"{layer.max_abs_error:.3g}, max rel error {layer.max_rel_error:.3g} "
                f"(rtol {tol.rtol:g}, atol {tol.atol:g}), cosine {layer.cosine:.6f} "
                f"(min {tol.min_cosine:g})"
            )
        elif not self.logits_passed:
            problems.append(
                f"logits over tolerance although every decoder layer passed: max rel error "
                f"{self.max_rel_error:.3g} (rtol {tol.rtol:g}), cosine {self.cosine:.6f}"
            )
        if self.backward is not None and not self.backward.passed:
            bw = self.backward
            problems.append(
                f"gradients differ: first divergent parameter {bw.first_divergent_parameter}, "
                f"max rel error {bw.max_rel_error:.3g} (rtol {tol.gradient_rtol:g}); "
                f"loss {bw.loss_reference:.6g} vs {bw.loss_candidate:.6g}"
            )
        if self.generation is not None and not self.generation.passed:
            gen = self.generation
            problems.append(
                f"generated tokens differ from position {gen.first_mismatch}: agreement "
                f"{gen.agreement:.1%} (min {tol.min_token_agreement:.0%})"
            )
        return problems

    def failure_message(self) -> str:
        """One line naming what diverged first (empty when the report passed)."""
        if self.passed:
            return ""
        what = self.substitution or "candidate"
        return f"{what} does not match the original: " + "; ".join(self._problems())


# --------------------------------------------------------------------------- inputs


def default_inputs(
    vocab_size: int,
    *,
    batch: int = 2,
    seq_len: int = 16,
    padding: int = 4,
    seed: int = 0,
    pad_token_id: int = 0,
    device: DeviceLike = None,
) -> dict[str, torch.Tensor]:
    """Deterministic random token ids with a left-padded attention mask.

    The first sequence is full; every other sequence starts with ``padding`` pad tokens
    (masked out), so the masking path of the attention is exercised as well. The same
    seed gives the same tokens on every machine (a private CPU generator is used).

    Example::

        >>> batch = default_inputs(512)
        >>> batch["input_ids"].shape, int(batch["attention_mask"].sum())
        (torch.Size([2, 16]), 28)
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (batch, seq_len), generator=generator)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    pad = min(padding, seq_len - 1)
    if pad > 0:
        attention_mask[1:, :pad] = 0
        input_ids[1:, :pad] = pad_token_id
    target = resolve_device(device)
    if target is not None:
        input_ids, attention_mask = input_ids.to(target), attention_mask.to(target)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no .config; pass a transformers model")
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _prepare_inputs(
    inputs: InputsLike, model: nn.Module, device: torch.device
) -> dict[str, torch.Tensor]:
    if inputs is None:
        config = _text_config(model)
        pad = getattr(config, "pad_token_id", None)
        batch = default_inputs(config.vocab_size, pad_token_id=pad if isinstance(pad, int) else 0)
    elif isinstance(inputs, torch.Tensor):
        batch = {"input_ids": inputs}
    elif isinstance(inputs, Mapping):
        batch = dict(inputs)
    else:
        raise TypeError(
            "inputs must be None, a tensor of token ids or a mapping such as "
            f"{{'input_ids': ..., 'attention_mask': ...}}, not {type(inputs).__name__}"
        )
    if "input_ids" not in batch:
        raise ValueError("inputs must contain 'input_ids'")
    ids = batch["input_ids"]
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    batch["input_ids"] = ids
    if batch.get("attention_mask") is None:
        batch["attention_mask"] = torch.ones_like(ids)
    return {
        key: value.to(device) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
    }


# --------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class _Diff:
    max_abs_error: float
    max_rel_error: float
    cosine: float
    scale: float


def _as_float(value: torch.Tensor) -> float:
    number = float(value)
    return number if not math.isnan(number) else math.inf


def _diff(reference: torch.Tensor, candidate: torch.Tensor, *, rowwise: bool) -> _Diff:
    """Errors of ``candidate`` against ``reference``, computed in float32.

    ``rowwise`` takes the cosine of every last-dimension vector (one per token) and
    keeps the lowest; otherwise the cosine of the two flattened tensors.
    """
    if reference.shape != candidate.shape:
        raise VerificationError(
            f"shapes differ: reference {tuple(reference.shape)}, candidate {tuple(candidate.shape)}"
        )
    ref = reference.detach().to(torch.float32)
    cand = candidate.detach().to(device=ref.device, dtype=torch.float32)
    if ref.numel() == 0:
        return _Diff(0.0, 0.0, 1.0, 0.0)
    max_abs = _as_float((ref - cand).abs().max())
    if not torch.isfinite(cand).all():
        max_abs = math.inf
    scale = float(ref.abs().max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    # float64 for the cosine: in float32 two equal vectors come out at 0.9999998
    width = ref.shape[-1] if rowwise and ref.dim() > 1 else ref.numel()
    ref_rows = ref.reshape(-1, width).to(torch.float64)
    cand_rows = cand.reshape(-1, width).to(torch.float64)
    cosines = torch.nn.functional.cosine_similarity(ref_rows, cand_rows, dim=-1, eps=1e-12)
    # two all-zero vectors are identical, though cosine_similarity calls them orthogonal
    both_zero = (ref_rows.abs().amax(-1) == 0) & (cand_rows.abs().amax(-1) == 0)
    cosines = torch.where(both_zero, torch.ones_like(cosines), cosines)
    cosine = float(cosines.min()) if torch.isfinite(cosines).all() else -math.inf
    return _Diff(max_abs, max_rel, cosine, scale)


def _passes(diff: _Diff, tolerance: Tolerance, *, gradient: bool = False) -> bool:
    return tolerance.allows(diff.max_abs_error, diff.scale, gradient=gradient) and (
        diff.cosine >= tolerance.min_cosine
    )


@dataclass
class _Run:
    """What one model produced on the verification inputs (valid positions only)."""

    logits: torch.Tensor
    is_logits: bool
    layers: list[tuple[str, torch.Tensor]]
    loss: float | None = None
    gradients: dict[str, torch.Tensor] | None = None
    tokens: torch.Tensor | None = None


def _layer_output(output: Any) -> torch.Tensor:
    # transformers 5 decoder layers return a tensor; older ones and some replacements
    # return a tuple whose first element is the hidden states
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"a decoder layer returned {type(output).__name__}, expected a tensor")


@contextlib.contextmanager
def _capture_layers(
    layers: Sequence[tuple[str, nn.Module]], valid: torch.Tensor
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Record each decoder layer's output at the valid positions; hooks removed on exit."""
    captured: list[tuple[str, torch.Tensor]] = []
    handles = []

    def recorder(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            captured.append((name, _layer_output(output).detach()[valid].clone()))

        return hook

    try:
        for name, layer in layers:
            handles.append(layer.register_forward_hook(recorder(name)))
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _evaluation(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the duration; every module's own flag restored after."""
    flags = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for module, training in flags:
            module.training = training


def _labels(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    # A label is predicted from the position before it: with left padding, the first
    # real token is predicted from a padded row, whose value differs between attention
    # kernels and means nothing. Mask those labels as well as the padding itself.
    mask = batch["attention_mask"] == 0
    labels = batch["input_ids"].masked_fill(mask, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1], -100)
    return labels


def _forward(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    layers: Sequence[tuple[str, nn.Module]],
    *,
    backward: bool,
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> _Run:
    """One forward pass (and, if asked, gradients by ``torch.autograd.grad``).

    ``autograd.grad`` rather than ``loss.backward()`` leaves every ``.grad`` as it was.
    """
    valid = batch["attention_mask"].bool()
    with _capture_layers(layers, valid) as captured, _evaluation(model):
        if not backward:
            with torch.no_grad(), context():
                output = model(**batch, use_cache=False)
            loss = None
            gradients = None
        else:
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            with torch.enable_grad(), context():
                output = model(**batch, labels=_labels(batch), use_cache=False)
                grads = torch.autograd.grad(output.loss, [p for _, p in params], allow_unused=True)
            loss = float(output.loss.detach())
            # kept in host memory: a model's worth of gradients must not crowd the GPU
            gradients = {
                name: (grad if grad is not None else torch.zeros_like(param)).detach().cpu()
                for (name, param), grad in zip(params, grads, strict=True)
            }
    logits = getattr(output, "logits", None)
    is_logits = logits is not None
    if logits is None:
        logits = output.last_hidden_state
    return _Run(logits.detach()[valid], is_logits, list(captured), loss, gradients)


def _generate(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    new_tokens: int,
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> torch.Tensor:
    config = _text_config(model)
    pad = getattr(config, "pad_token_id", None)
    generate = getattr(model, "generate", None)
    if generate is None:
        raise TypeError(f"{type(model).__name__} cannot generate; use a *ForCausalLM model")
    with _evaluation(model), torch.no_grad(), context():
        sequences = generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad if isinstance(pad, int) else 0,
        )
    result: torch.Tensor = sequences[:, batch["input_ids"].shape[1] :].detach().cpu()
    return result


def _compare_generation(
    reference: torch.Tensor, candidate: torch.Tensor, tolerance: Tolerance
) -> GenerationReport:
    width = min(reference.shape[1], candidate.shape[1])
    same = reference[:, :width] == candidate[:, :width]
    agreement = float(same.float().mean()) if same.numel() else 1.0
    if reference.shape != candidate.shape:
        agreement = min(agreement, width / max(reference.shape[1], candidate.shape[1]))
    mismatched = (~same).any(dim=0).nonzero()
    first_mismatch = int(mismatched[0]) if len(mismatched) else None
    if first_mismatch is None and reference.shape != candidate.shape:
        first_mismatch = width
    exact = first_mismatch is None
    return GenerationReport(
        passed=exact or agreement >= tolerance.min_token_agreement,
        new_tokens=int(reference.shape[1]),
        agreement=agreement,
        first_mismatch=first_mismatch,
        reference_tokens=tuple(tuple(int(t) for t in row) for row in reference),
        candidate_tokens=tuple(tuple(int(t) for t in row) for row in candidate),
    )


def _compare_gradients(
    reference: Mapping[str, torch.Tensor],
    candidate: Mapping[str, torch.Tensor],
    loss_reference: float,
    loss_candidate: float,
    tolerance: Tolerance,
    *,
    local: bool,
) -> BackwardReport:
    missing = [name for name in reference if name not in candidate]
    if missing:
        raise VerificationError(
            f"the candidate has no gradient for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + "; pass substitution= so its gradients can be mapped to the original layout"
        )
    reports = []
    for name, ref_grad in reference.items():
        diff = _diff(ref_grad, candidate[name], rowwise=False)
        reports.append(
            GradientReport(
                name=name,
                max_abs_error=diff.max_abs_error,
                max_rel_error=diff.max_rel_error,
                cosine=diff.cosine,
                passed=_passes(diff, tolerance, gradient=True),
            )
        )
    first = next((r.name for r in reports if not r.passed), None)
    loss_error = abs(loss_reference - loss_candidate)
    if math.isnan(loss_error):
        loss_error = math.inf
    loss_ok = tolerance.allows(loss_error, abs(loss_reference))
    return BackwardReport(
        passed=loss_ok and first is None,
        loss_reference=loss_reference,
        loss_candidate=loss_candidate,
        loss_abs_error=loss_error,
        max_abs_error=max((r.max_abs_error for r in reports), default=0.0),
        max_rel_error=max((r.max_rel_error for r in reports), default=0.0),
        cosine=min((r.cosine for r in reports), default=1.0),
        gradients=tuple(reports),
        first_divergent_parameter=first,
        local=local,
    )


def _build_report(
    reference: _Run,
    candidate: _Run,
    tolerance: Tolerance,
    *,
    substitution: str | None,
    mode: Literal["full", "streaming", "models"],
    device: torch.device,
    dtype: str,
    batch: Mapping[str, torch.Tensor],
    backward: BackwardReport | None,
    generation: GenerationReport | None,
) -> VerificationReport:
    if len(reference.layers) != len(candidate.layers):
        raise VerificationError(
            f"the reference ran {len(reference.layers)} decoder layers, "
            f"the candidate {len(candidate.layers)}"
        )
    layers = []
    for index, ((name, ref_out), (_, cand_out)) in enumerate(
        zip(reference.layers, candidate.layers, strict=True)
    ):
        diff = _diff(ref_out, cand_out, rowwise=True)
        layers.append(
            LayerReport(
                index=index,
                name=name,
                max_abs_error=diff.max_abs_error,
                max_rel_error=diff.max_rel_error,
                cosine=diff.cosine,
                passed=_passes(diff, tolerance),
            )
        )
    logits = _diff(reference.logits, candidate.logits, rowwise=True)
    top1: float | None = None
    kl: float | None = None
    if reference.is_logits and reference.logits.numel():
        ref_logits = reference.logits.to(torch.float32)
        cand_logits = candidate.logits.to(device=ref_logits.device, dtype=torch.float32)
        top1 = float((ref_logits.argmax(-1) == cand_logits.argmax(-1)).float().mean())
        ref_logp = torch.log_softmax(ref_logits, dim=-1)
        cand_logp = torch.log_softmax(cand_logits, dim=-1)
        kl_rows = (ref_logp.exp() * (ref_logp - cand_logp)).sum(-1)
        kl = max(_as_float(kl_rows.mean()), 0.0)  # rounding can make a zero KL negative
    logits_passed = _passes(logits, tolerance)
    first = next((layer.index for layer in layers if not layer.passed), None)
    passed = (
        logits_passed
        and first is None
        and (backward is None or backward.passed)
        and (generation is None or generation.passed)
    )
    ids = batch["input_ids"]
    return VerificationReport(
        passed=passed,
        substitution=substitution,
        mode=mode,
        device=str(device),
        dtype=dtype,
        tolerance=tolerance,
        max_abs_error=logits.max_abs_error,
        max_rel_error=logits.max_rel_error,
        cosine=logits.cosine,
        top1_agreement=top1,
        kl=kl,
        logits_passed=logits_passed,
        layers=tuple(layers),
        first_divergent_layer=first,
        batch=int(ids.shape[0]),
        seq_len=int(ids.shape[1]),
        backward=backward,
        generation=generation,
    )


# --------------------------------------------------------------------------- substitution glue


def _substitution(substitution: SubstitutionLike) -> Substitution:
    from layerswap.substitution import get

    sub = get(substitution)
    reason = sub.unmet_requirement()
    if reason is not None:
        raise RequirementError(f"{sub.name} cannot run here: {reason}")
    return sub


def _model_placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for param in model.parameters():
        if param.is_floating_point():
            return param.device, param.dtype
    return torch.device("cpu"), torch.float32


def _working_copy(
    model: nn.Module, device: torch.device, dtype: torch.dtype, *, trainable: bool
) -> nn.Module:
    """A deep copy on ``device`` in ``dtype``; the caller's model is only read."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("cannot verify a model on the meta device: it has no weights")
    work = copy.deepcopy(model)
    work.to(device=device, dtype=dtype)
    for param in work.parameters():
        param.grad = None
        if trainable and param.is_floating_point():
            param.requires_grad_(True)
    return work


def _layer_gradients_to_original(
    layer: nn.Module,
    gradients: Mapping[str, torch.Tensor],
    substitution: Substitution,
    config: Any,
) -> dict[str, torch.Tensor]:
    """Map one replacement layer's gradients (relative names) to the original layout.

    The converter maps weights, ``w_replacement = to_replacement(w_original)``; the
    gradient of the original weights is the vector-Jacobian product of that map with the
    replacement's gradients. Autograd through the converter gets it right for any
    differentiable converter: renames, concatenations and custom rules alike (applying
    ``to_original`` to the gradients would be wrong for a rule that scales or shifts).
    """
    converter = substitution.converter
    state = {key: value.detach() for key, value in layer.state_dict().items()}
    with torch.no_grad():
        original = converter.to_original(state, config)
    leaves = {
        key: value.detach().clone().requires_grad_(True)
        for key, value in original.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    }
    with torch.enable_grad():
        converted = converter.to_replacement(dict(leaves), config)
        terms = [
            (converted[key] * grad.to(converted[key])).sum()
            for key, grad in gradients.items()
            if key in converted and converted[key].requires_grad
        ]
        if not terms:
            return {key: torch.zeros_like(leaf) for key, leaf in leaves.items()}
        grads = torch.autograd.grad(
            torch.stack(terms).sum(), list(leaves.values()), allow_unused=True
        )
    return {
        key: (grad if grad is not None else torch.zeros_like(leaf)).detach().cpu()
        for (key, leaf), grad in zip(leaves.items(), grads, strict=True)
    }


def _gradients_to_original(
    model: nn.Module,
    gradients: Mapping[str, torch.Tensor],
    substitution: Substitution,
) -> dict[str, torch.Tensor]:
    """The swapped model's gradients, keyed and shaped as in the original model."""
    from layerswap.swap import decoder_layers

    replacement = substitution.replacement_class()
    config = _text_config(model)
    mapped = dict(gradients)
    for qualname, layer in decoder_layers(model):
        if not isinstance(layer, replacement):
            continue
        prefix = qualname + "."
        local = {
            name[len(prefix) :]: mapped.pop(name)
            for name in list(mapped)
            if name.startswith(prefix)
        }
        converted = _layer_gradients_to_original(layer, local, substitution, config)
        mapped.update({prefix + key: value for key, value in converted.items()})
    return mapped


def _precision(substitution: Substitution | None, dtype: torch.dtype) -> DTypeLike:
    """What the default tolerance is chosen for: ``"fp8"`` for substitutions that compute
    in FP8 (their backend or name says so: ``te_fp8``), else the parameters' dtype."""
    if substitution is not None and any(
        "fp8" in label.lower() for label in (substitution.backend, substitution.name)
    ):
        return "fp8"
    return dtype


def _candidate_context(
    substitution: Substitution | None,
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The context a substitution's layers must run in (e.g. an FP8 autocast), if any."""
    factory = getattr(substitution, "forward_context", None) if substitution else None
    return factory if callable(factory) else contextlib.nullcontext


# --------------------------------------------------------------------------- public entry points


def verify(
    model: nn.Module,
    substitution: SubstitutionLike,
    inputs: InputsLike = None,
    *,
    dtype: DTypeLike = None,
    device: DeviceLike = None,
    backward: bool = False,
    generate: int = 0,
    tolerance: float | Tolerance | None = None,
    streaming: bool = False,
) -> VerificationReport:
    """Compare ``model`` with ``model`` swapped by ``substitution``, on the same inputs.

    ``substitution`` is a registered name or a :class:`~layerswap.Substitution` (so a
    variant made with ``dataclasses.replace`` can be checked before it is registered).
    ``inputs`` defaults to :func:`default_inputs` for the model's vocabulary; a tensor of
    token ids or a mapping with ``input_ids`` (and ``attention_mask``) is accepted.
    ``dtype`` / ``device`` cast a copy (``device="auto"``: CUDA when present); ``None``
    keeps the model's. ``tolerance`` is a number (atol and rtol) or a :class:`Tolerance`;
    the default depends on the dtype. ``streaming=True`` keeps memory near one model
    plus one layer (see the module docstring); it does not support ``generate``.

    The model is left exactly as it was. Raises
    :class:`~layerswap.errors.RequirementError` when the substitution cannot run here.

    Example::

        report = layerswap.verify(model, "llama.decoder.fused", backward=True, generate=4)
        if not report.passed:
            print(report.summary())      # names the first divergent layer
    """
    sub = _substitution(substitution)
    if generate < 0:
        raise ValueError(f"generate must be >= 0, got {generate}")
    if streaming and generate:
        raise ValueError(
            "generate= needs the whole swapped model; use streaming=False to compare generation"
        )
    model_device, model_dtype = _model_placement(model)
    target_device = resolve_device(device) or model_device
    target_dtype = resolve_dtype(dtype) or model_dtype
    tol = Tolerance.coerce(tolerance, _precision(sub, target_dtype))
    batch = _prepare_inputs(inputs, model, target_device)
    if streaming:
        return _verify_streaming(
            model, sub, batch, target_device, target_dtype, tol, backward=backward
        )

    from layerswap.swap import decoder_layers, swap

    work = _working_copy(model, target_device, target_dtype, trainable=backward)
    reference = _forward(work, batch, decoder_layers(work), backward=backward)
    if generate:
        reference.tokens = _generate(work, batch, generate)
    swap(work, sub)
    context = _candidate_context(sub)
    candidate = _forward(work, batch, decoder_layers(work), backward=backward, context=context)
    if generate:
        candidate.tokens = _generate(work, batch, generate, context)
    backward_report = None
    if backward:
        assert reference.gradients is not None and candidate.gradients is not None
        assert reference.loss is not None and candidate.loss is not None
        mapped = _gradients_to_original(work, candidate.gradients, sub)
        backward_report = _compare_gradients(
            reference.gradients, mapped, reference.loss, candidate.loss, tol, local=False
        )
    generation = None
    if reference.tokens is not None and candidate.tokens is not None:
        generation = _compare_generation(reference.tokens, candidate.tokens, tol)
    return _build_report(
        reference,
        candidate,
        tol,
        substitution=sub.name,
        mode="full",
        device=target_device,
        dtype=_dtype_name(target_dtype),
        batch=batch,
        backward=backward_report,
        generation=generation,
    )


def assert_equivalent(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: InputsLike = None,
    *,
    tolerance: float | Tolerance | None = None,
    substitution: SubstitutionLike | None = None,
    backward: bool = False,
    generate: int = 0,
) -> VerificationReport:
    """Raise :class:`~layerswap.errors.VerificationError` unless ``candidate`` matches.

    For tests: both models run on ``inputs`` (default :func:`default_inputs`) on the
    reference's device; their logits and every decoder layer's output are compared. The
    error message names the first divergent layer and its errors. ``substitution`` lets
    ``backward=True`` map the candidate's gradients to the original layout (needed when
    the candidate is swapped). Neither model is modified. Returns the report on success.

    Example::

        candidate = copy.deepcopy(model)
        layerswap.swap(candidate, "llama.decoder.fused")
        layerswap.assert_equivalent(model, candidate, tolerance=1e-4)
    """
    __tracebackhide__ = True
    from layerswap.swap import decoder_layers

    sub = _substitution(substitution) if substitution is not None else None
    device, dtype = _model_placement(reference)
    tol = Tolerance.coerce(tolerance, _precision(sub, dtype))
    batch = _prepare_inputs(inputs, reference, device)
    ref_run = _forward(reference, batch, decoder_layers(reference), backward=backward)
    context = _candidate_context(sub)
    cand_batch = _prepare_inputs(batch, candidate, _model_placement(candidate)[0])
    cand_run = _forward(
        candidate, cand_batch, decoder_layers(candidate), backward=backward, context=context
    )
    backward_report = None
    if backward:
        assert ref_run.gradients is not None and cand_run.gradients is not None
        assert ref_run.loss is not None and cand_run.loss is not None
        cand_grads = cand_run.gradients
        if sub is not None:
            cand_grads = _gradients_to_original(candidate, cand_grads, sub)
        backward_report = _compare_gradients(
            ref_run.gradients, cand_grads, ref_run.loss, cand_run.loss, tol, local=False
        )
    generation = None
    if generate:
        generation = _compare_generation(
            _generate(reference, batch, generate),
            _generate(candidate, cand_batch, generate, context),
            tol,
        )
    report = _build_report(
        ref_run,
        cand_run,
        tol,
        substitution=sub.name if sub is not None else None,
        mode="models",
        device=device,
        dtype=_dtype_name(dtype),
        batch=batch,
        backward=backward_report,
        generation=generation,
    )
    if not report.passed:
        raise VerificationError(report.failure_message())
    return report


# --------------------------------------------------------------------------- streaming mode


def _replacement_layer(
    sub: Substitution, layer: nn.Module, position: int, config: Any
) -> nn.Module:
    """The replacement for one original ``layer``, built the way :func:`swap` builds it.

    The original is only read: renamed tensors are shared with it (detached), computed
    ones are new, so the replacement costs at most one layer of memory.
    """
    from layerswap.swap import _build

    layer_idx = position
    for holder in (layer, getattr(layer, "self_attn", None)):
        index = getattr(holder, "layer_idx", None)
        if isinstance(index, int):
            layer_idx = index
            break
    state = {key: value.detach() for key, value in layer.state_dict(keep_vars=True).items()}
    with torch.no_grad():
        converted = sub.converter.to_replacement(state, config)
    device = next(iter(state.values())).device if state else torch.device("cpu")
    replacement = _build(
        sub.replacement_class(), config, layer_idx, device, converted, f"layer {position}"
    )
    return replacement.eval()


def _verify_streaming(
    model: nn.Module,
    sub: Substitution,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    tolerance: Tolerance,
    *,
    backward: bool,
) -> VerificationReport:
    from layerswap.swap import decoder_layers

    model_device, model_dtype = _model_placement(model)
    in_place = model_device == device and model_dtype == dtype
    host = model if in_place else _working_copy(model, device, dtype, trainable=False)
    layers = decoder_layers(host)
    config = _text_config(host)
    context = _candidate_context(sub)
    valid = batch["attention_mask"].bool()
    labels = _labels(batch) if backward else None

    # pass 1: the reference, with every layer's input kept for the local backward check
    layer_inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def keep_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        layer_inputs.append(
            (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), dict(kwargs))
        )

    handles = (
        [layer.register_forward_pre_hook(keep_input, with_kwargs=True) for _, layer in layers]
        if backward
        else []
    )
    try:
        with _capture_layers(layers, valid) as ref_layers, _evaluation(host), torch.no_grad():
            ref_out = host(**batch, labels=labels, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    reference = _Run(ref_out.logits.detach()[valid], True, list(ref_layers))

    # pass 2: each decoder layer's output replaced by its replacement's, built on the fly
    def substitute(layer_idx: int) -> Callable[..., Any]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            replacement = _replacement_layer(sub, module, layer_idx, config)
            with context():
                return replacement(*args, **kwargs)

        return hook

    handles = [
        layer.register_forward_hook(substitute(index), with_kwargs=True)
        for index, (_, layer) in enumerate(layers)
    ]
    try:
        with _capture_layers(layers, valid) as cand_layers, _evaluation(host), torch.no_grad():
            cand_out = host(**batch, labels=labels, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    candidate = _Run(cand_out.logits.detach()[valid], True, list(cand_layers))

    backward_report = None
    if backward:
        backward_report = _local_backward(
            layers,
            layer_inputs,
            sub,
            config,
            valid,
            tolerance,
            context,
            float(ref_out.loss),
            float(cand_out.loss),
        )
    return _build_report(
        reference,
        candidate,
        tolerance,
        substitution=sub.name,
        mode="streaming",
        device=device,
        dtype=_dtype_name(dtype),
        batch=batch,
        backward=backward_report,
        generation=None,
    )


def _local_backward(
    layers: Sequence[tuple[str, nn.Module]],
    layer_inputs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    sub: Substitution,
    config: Any,
    valid: torch.Tensor,
    tolerance: Tolerance,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
    loss_reference: float,
    loss_candidate: float,
) -> BackwardReport:
    """Per-layer gradients on the reference's inputs, one replacement layer at a time."""
    ref_grads: dict[str, torch.Tensor] = {}
    cand_grads: dict[str, torch.Tensor] = {}
    for layer_idx, ((qualname, layer), (args, kwargs)) in enumerate(
        zip(layers, layer_inputs, strict=True)
    ):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        rest = args[1:]
        generator = torch.Generator().manual_seed(layer_idx)
        upstream = torch.randn(hidden.shape, generator=generator).to(hidden)
        upstream = upstream * valid.unsqueeze(-1).to(upstream)
        replacement = _replacement_layer(sub, layer, layer_idx, config)
        for target, module, ctx in (
            (ref_grads, layer, contextlib.nullcontext),
            (cand_grads, replacement, context),
        ):
            params = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
            flags = [p.requires_grad for _, p in params]
            x = hidden.detach().clone().requires_grad_(True)
            try:
                for _, p in params:
                    p.requires_grad_(True)
                with torch.enable_grad(), ctx(), _evaluation(module):
                    out = _layer_output(module(x, *rest, **kwargs))
                    grads = torch.autograd.grad(
                        out, [x, *(p for _, p in params)], upstream, allow_unused=True
                    )
            finally:
                for (_, p), flag in zip(params, flags, strict=True):
                    p.requires_grad_(flag)
            local = {
                name: (g if g is not None else torch.zeros_like(p)).detach()
                for (name, p), g in zip(params, grads[1:], strict=True)
            }
            if module is replacement:
                local = _layer_gradients_to_original(replacement, local, sub, config)
            target[f"{qualname}.<input>"] = grads[0].detach()[valid]
            target.update({f"{qualname}.{name}": value for name, value in local.items()})
        del replacement
    return _compare_gradients(
        ref_grads, cand_grads, loss_reference, loss_candidate, tolerance, local=True
    )
