from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def _requested(request):
    """Substitutions the run applies with --layerswap (None without layerswap installed)."""
    values = request.config.getoption("layerswap", default=None) or []
    return [name for value in values for name in value.split(",") if name]


def test_decoder_layer_class_follows_the_run(model, request):
    layer_class = type(model.model.layers[0])
    print(f"decoder layer class: {layer_class.__name__}")
    llama = [name for name in _requested(request) if name.startswith("llama.")]
    if llama:
        import layerswap

        assert layer_class is layerswap.get(llama[-1]).replacement_class()
    else:
        assert layer_class is LlamaDecoderLayer
    assert all(type(layer) is layer_class for layer in model.model.layers)


def test_logits_have_one_score_per_token_and_word(model, input_ids, config):
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (*input_ids.shape, config.vocab_size)
    assert torch.isfinite(logits).all()


def test_padding_does_not_change_the_real_tokens(model, input_ids):
    mask = torch.ones_like(input_ids)
    mask[1, :4] = 0  # left padding in the second row
    with torch.no_grad():
        padded = model(input_ids=input_ids, attention_mask=mask).logits
        alone = model(input_ids=input_ids[1:, 4:]).logits
    torch.testing.assert_close(padded[1, 4:], alone[0], rtol=1e-4, atol=1e-5)


def test_generate_matches_step_by_step_greedy_decoding(model, input_ids):
    prompt = input_ids[:1, :6]
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 11)
    tokens = prompt
    with torch.no_grad():
        for _ in range(5):  # no KV cache: the whole sequence each time
            logits = model(input_ids=tokens, use_cache=False).logits
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, tokens)
