"""The comparison core: two models run the same way and judged under one tolerance.

Both :func:`layerswap.verify` (a user's model against its swapped copy, reported per
layer) and the first-use proof (:mod:`layerswap.proof`, a tiny pair it builds) run and
judge with these modules, and nothing here swaps a model, proves or reports to a user:

``inputs`` (the batch, its padding, a multimodal wrapper's text config), ``multimodal``
(a wrapper's media tokens kept out of the prompt), ``placement`` (device and dtype),
``model_classes`` (what each model class outputs and learns from: causal LM, sequence,
token and question-answering classifiers, base model), ``forward`` (one model's pass:
layer outputs, loss, gradients, greedy decoding with a dynamic or static cache),
``routing`` and ``excused`` (a mixture-of-experts token the candidate routes elsewhere
at a near-tie of the reference's router is left out, with what it reaches, and
counted), ``distance`` (how far one tensor is from its reference), ``tolerance``,
``fp8`` (TransformerEngine's FP8 judged against ideal FP8 rounding of the original),
``generation`` (two greedy generations: token agreement and each step's logits),
``gradients`` (a swapped model's gradients mapped back to the original's layout),
``compare`` (two passes into a report), ``report``, and ``first_difference`` (two
models run and judged the same way, the first difference named, in words).

Example::

    from layerswap.comparison.first_difference import first_difference
    from layerswap.comparison.tolerance import Tolerance

    check, detail = first_difference(reference, candidate, batch, Tolerance.scaled(1e-4))
    check      # None: every check within tolerance
"""
