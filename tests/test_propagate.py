"""Substitutions carried to processes the user's code starts (layerswap.distributed.propagate).

A process started with ``spawn`` or ``forkserver``, or by ``torchrun``, is a fresh
interpreter. After ``propagate()`` it inherits ``LAYERSWAP_SUBSTITUTIONS`` and, on
importing layerswap, applies the substitutions before it builds a model.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import layerswap
from layerswap.distributed import (
    ENVIRONMENT,
    applied_substitutions,
    apply_from_environment,
    propagate,
)
from layerswap.errors import SubstitutionError, UnknownSubstitutionError

SUBSTITUTION = "llama.decoder.fused"


@pytest.fixture(autouse=True)
def _no_inherited_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENVIRONMENT, raising=False)


def _layer_class_in_child(queue: Any) -> None:
    from transformers import LlamaForCausalLM

    config = layerswap.get_family("llama").tiny_config(num_hidden_layers=1)
    queue.put(type(LlamaForCausalLM(config).model.layers[0]).__name__)


def _started(method: str) -> str:
    context = multiprocessing.get_context(method)
    queue = context.Queue()
    process = context.Process(target=_layer_class_in_child, args=(queue,))
    process.start()
    try:
        return str(queue.get(timeout=120))
    finally:
        process.join(timeout=60)


@pytest.mark.slow  # fresh interpreters that import torch and transformers
def test_spawned_and_forkserver_processes_apply_what_propagate_carries():
    with layerswap.use(SUBSTITUTION):
        propagation = propagate()  # what is applied here and now
    assert propagation.names == (SUBSTITUTION,)
    assert os.environ[ENVIRONMENT] == f"{SUBSTITUTION}@transformers.models.llama.modeling_llama"
    with propagation:
        assert _started("spawn") == "FusedLlamaDecoderLayer"
        assert _started("forkserver") == "FusedLlamaDecoderLayer"
    assert ENVIRONMENT not in os.environ  # stopped: put back as it was (unset)
    assert _started("spawn") == "LlamaDecoderLayer"


@pytest.mark.slow  # fresh interpreters that import torch and transformers
def test_torchrun_ranks_apply_what_propagate_carries(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            import layerswap
            from transformers import LlamaForCausalLM

            config = layerswap.get_family("llama").tiny_config(num_hidden_layers=1)
            layer = LlamaForCausalLM(config).model.layers[0]
            print(f"rank {os.environ['RANK']}: {type(layer).__name__}", flush=True)
            """
        )
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={port}",
        str(script),
    ]
    with propagate([SUBSTITUTION]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 0: FusedLlamaDecoderLayer" in done.stdout
    assert "rank 1: FusedLlamaDecoderLayer" in done.stdout
    # each rank says what it applied
    assert done.stderr.count(f"{ENVIRONMENT} applied {SUBSTITUTION} in process") == 2


def test_propagate_outside_use_without_names_refuses():
    with pytest.raises(SubstitutionError, match="no layerswap substitution is applied here"):
        propagate()
    assert ENVIRONMENT not in os.environ


def test_propagate_refuses_unknown_and_unregistered_substitutions():
    import dataclasses

    with pytest.raises(UnknownSubstitutionError):
        propagate(["llama.decoder.nope"])
    ad_hoc = dataclasses.replace(layerswap.get(SUBSTITUTION), name="llama.decoder.mine")
    with pytest.raises(SubstitutionError, match="not the registered substitution"):
        propagate([ad_hoc])
    assert ENVIRONMENT not in os.environ


def test_propagate_keeps_what_the_variable_already_carries(monkeypatch):
    monkeypatch.setenv(ENVIRONMENT, "qwen2.decoder.fused@transformers.models.qwen2.modeling_qwen2")
    with propagate([SUBSTITUTION]) as propagation:
        assert propagation.value == (
            "qwen2.decoder.fused@transformers.models.qwen2.modeling_qwen2,"
            f"{SUBSTITUTION}@transformers.models.llama.modeling_llama"
        )
    assert os.environ[ENVIRONMENT].startswith("qwen2.decoder.fused@")


def test_a_malformed_variable_is_refused_with_its_form():
    with pytest.raises(SubstitutionError, match="NAME@MODULE"):
        apply_from_environment("llama.decoder.fused")


def test_a_process_that_already_has_the_substitution_applies_nothing_twice():
    with layerswap.use(SUBSTITUTION):
        before = [sub.name for sub in applied_substitutions()]
        from layerswap.distributed import _apply_named

        _apply_named(SUBSTITUTION)  # what the import hook runs, in a forked child
        assert [sub.name for sub in applied_substitutions()] == before
