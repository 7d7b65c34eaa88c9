"""What one model's substitutions replace and keep (``layerswap coverage``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from fresh import run_json
from typer.testing import CliRunner

import layerswap
from layerswap.cli import app
from layerswap.coverage import _below_decoder, _infer_reason, infer_in_processes, model_coverage
from layerswap.errors import UnknownSubstitutionError
from layerswap.registry import backends
from layerswap.registry import families as registry_families


def _rows(target: object) -> dict[str, object]:
    return {row.substitution: row for row in model_coverage(target).rows}  # type: ignore[arg-type]


def test_the_decoder_slot_replaces_every_decoder_layer_and_keeps_the_rest() -> None:
    layers = layerswap.get_family("qwen3").tiny_config().num_hidden_layers
    row = _rows("qwen3")["qwen3.decoder.fused"]

    assert row.unsupported is None and row.unmet_requirement is None
    assert row.replaces == (f"model.layers.0-{layers - 1} (Qwen3DecoderLayer)",)
    assert row.keeps == (
        "model.embed_tokens (Embedding)",
        "model.norm (Qwen3RMSNorm)",
        "model.rotary_emb (Qwen3RotaryEmbedding)",
        "lm_head (Linear)",
    )


def test_the_head_slot_replaces_the_loss_and_keeps_every_module() -> None:
    row = _rows("llama")["llama.head.fused"]

    assert row.replaces == ("the causal LM's loss and lm_head in training (LlamaForCausalLM)",)
    assert row.keeps[0].startswith("model.layers.0-") and "lm_head (Linear)" in row.keeps


def test_a_backend_that_cannot_express_the_family_says_why() -> None:
    row = _rows("olmo2")["olmo2.decoder.te"]

    assert row.unsupported == layerswap.get_backend("te").unsupported(layerswap.get_family("olmo2"))
    assert row.unsupported and row.replaces == () and row.keeps == ()


def test_a_checkpoint_directory_is_read_from_its_config(tmp_path: Path) -> None:
    config = layerswap.get_family("mistral").tiny_config(num_hidden_layers=3)
    config.save_pretrained(tmp_path)

    report = model_coverage(tmp_path)

    assert report.family == "mistral" and report.source == str(tmp_path / "config.json")
    assert report.rows[0].replaces == ("model.layers.0-2 (MistralDecoderLayer)",)


def test_a_config_no_family_covers_lists_what_the_slots_below_the_decoder_take(
    tmp_path: Path,
) -> None:
    """Jamba: no family covers its hybrid decoder layers, which the decoder rows say;
    its norms, MLPs, experts and head are swapped by the slots that take any model type."""
    config = layerswap.get("jamba.norm.fused").parts.family.tiny_config()
    config.save_pretrained(tmp_path)

    report = model_coverage(tmp_path)

    rows = {row.substitution: row for row in report.rows}
    assert report.family == "jamba" and report.source == str(tmp_path / "config.json")
    assert "decoder layers of different structure" in str(rows["jamba.decoder.fused"].unsupported)
    assert rows["jamba.decoder.fused"].replaces == ()
    for slot in ("norm", "mlp", "experts", "qkv", "head"):
        row = rows[f"jamba.{slot}.fused"]
        assert row.unsupported is None and row.unmet_requirement is None, slot
        assert row.replaces and row.keeps[0].startswith("model.layers.0-"), slot
    assert rows["jamba.norm.fused"].replaces[0].startswith("the norms (JambaRMSNorm x")


def test_a_config_of_no_causal_lm_model_type_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))

    with pytest.raises(UnknownSubstitutionError, match="'vit' model, which is no causal-LM"):
        model_coverage(tmp_path)


def test_a_config_of_a_multimodal_family_is_read_as_that_family(tmp_path: Path) -> None:
    """Qwen2-VL: a family of its own, though no causal-LM model type of transformers."""
    layerswap.get_family("qwen2_vl").tiny_config().save_pretrained(tmp_path)

    report = model_coverage(tmp_path)

    assert report.family == "qwen2_vl"
    assert {row.substitution: row for row in report.rows}["qwen2_vl.decoder.fused"].replaces


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        (
            "whisper",
            "whisper is a transformers model type that layerswap does not cover: ",
        ),
        ("t5", "t5: transformers has no causal LM for this model type"),
    ],
)
def test_the_cli_refuses_a_model_type_with_nothing_to_cover_with_the_reason(
    model_type: str, message: str
) -> None:
    result = CliRunner().invoke(app, ["coverage", model_type])

    assert result.exit_code == 2 and message in result.output, result.output


def test_the_cli_says_why_the_slots_below_the_decoder_take_nothing() -> None:
    """Whisper's tiny model does not build (its own sizes): the slots below its decoder
    layers are held back by that, and the refusal says so beside the decoder's reason."""
    result = CliRunner().invoke(app, ["coverage", "whisper"])

    assert result.exit_code == 2
    assert "; the slots below its decoder layers: its tiny model does not build here (" in (
        " ".join(result.output.split())
    )


def test_a_library_a_tiny_model_lacks_is_named_in_one_sentence() -> None:
    """transformers' import error for a missing library runs over paragraphs (Gemma 3n's
    vision tower needs timm and PIL): the reason names the libraries, on one line."""
    from transformers.utils.import_utils import BACKENDS_MAPPING

    from layerswap.trials import not_built

    # the very words transformers raises with (requires_backends)
    text = "".join(BACKENDS_MAPPING[b][1].format("TimmWrapperModel") for b in ("vision", "timm"))

    assert not_built(ImportError(text)) == (
        "its tiny model does not build here (TimmWrapperModel needs PIL, timm, not installed here)"
    )
    assert not_built(ValueError("embed_dim must be\n divisible")) == (
        "its tiny model does not build here (ValueError: embed_dim must be divisible)"
    )


def test_one_reason_holding_back_every_slot_is_listed_beside_the_decoders() -> None:
    from layerswap.coverage import Coverage

    lacking = "its tiny model does not build here (TimmWrapperModel needs timm, not installed here)"
    held = Coverage(
        "gemma3n",
        None,
        "layers differ",
        {},
        slots={"norm": {"fused": lacking}, "head": {"fused": lacking, "liger": lacking}},
    )
    differing = Coverage(
        "bert",
        None,
        "no layers",
        {},
        slots={"norm": {"fused": "no norm"}, "head": {"fused": "no head"}},
    )
    taken = Coverage(
        "gpt2", None, "no layers", {}, slots={"norm": {"fused": lacking}, "head": {"fused": None}}
    )

    assert held.slots_refusal == lacking
    assert differing.slots_refusal is None  # coverage MODEL_TYPE gives each
    assert taken.slots_refusal is None


def test_a_model_type_no_family_covers_keeps_its_language_models_layers() -> None:
    """GOT-OCR2 holds its vision tower's layers beside its language model's: the rows name
    the language model's (the text config's number of layers), not the tower's."""
    rows = {row.substitution: row for row in model_coverage("got_ocr2").rows}

    assert rows["got_ocr2.mlp.fused"].keeps[0].startswith("model.language_model.layers.0-")


def test_the_cli_covers_a_model_type_no_family_covers() -> None:
    """``layerswap coverage gpt2``: its decoder layers are covered by no family (the rows
    say why), its head is swapped; the blocks it keeps are named as a family's layers."""
    result = CliRunner().invoke(app, ["coverage", "gpt2", "--json"])

    assert result.exit_code == 0, result.output
    rows = {row["substitution"]: row for row in json.loads(result.stdout)["rows"]}
    assert "no model.layers" in rows["gpt2.decoder.fused"]["unsupported"]
    head = rows["gpt2.head.fused"]
    assert head["unsupported"] is None
    assert head["replaces"] == ["the causal LM's loss and lm_head in training (GPT2LMHeadModel)"]
    assert head["keeps"][0] == "transformer.h.0-3 (GPT2Block)"
    assert "torch's own norms" in rows["gpt2.norm.fused"]["unsupported"]


def test_the_cli_prints_the_rows_as_json_and_refuses_an_unknown_family() -> None:
    result = CliRunner().invoke(app, ["coverage", "gemma", "--json"])
    unknown = CliRunner().invoke(app, ["coverage", "gema"])

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["family"] == "gemma"
    names = {row["substitution"] for row in report["rows"]}
    assert {"gemma.decoder.fused", "gemma.head.fused", "gemma.decoder.te"} <= names
    assert unknown.exit_code == 2 and "did you mean gemma" in unknown.output


def test_a_mixture_of_experts_block_is_listed_as_kept_inside_the_replacement() -> None:
    rows = _rows("mixtral")
    layers = layerswap.get_family("mixtral").tiny_config().num_hidden_layers
    decoder = rows["mixtral.decoder.fused"]

    assert decoder.replaces == (
        f"model.layers.0-{layers - 1} (MixtralDecoderLayer): attention and norms",
    )
    assert decoder.keeps[0].startswith(f"model.layers.0-{layers - 1}.mlp (MixtralSparseMoeBlock")
    assert rows["mixtral.head.fused"].unsupported is None  # the router's loss reproduced


# --- list --all: the model types not yet answered, inferred in processes ------------------

# model types no builtin family covers, refused for different reasons (no model.layers, a
# structure the fused layer does not express, multi-head latent attention, a hybrid)
UNCOVERED = (
    "bloom",
    "gpt2",
    "opt",
    "falcon",
    "phi",
    "mpt",
    "deepseek_v3",
    "jamba",
    "bamba",
    "codegen",
    "xglm",
    "biogpt",
    "ctrl",
    "persimmon",
    "diffllama",
    "doge",
)


@pytest.mark.slow  # a fresh interpreter that forks, inferring 16 model types
def test_model_types_inferred_in_processes_get_the_answers_inferred_here(tmp_path: Path) -> None:
    code = f"""
        import json
        from layerswap.coverage import _stored, infer_in_processes
        types = {list(UNCOVERED)!r}
        steps = []
        infer_in_processes(types, jobs=2, on_step=lambda done, total, t: steps.append(done))
        print(json.dumps({{"answers": {{t: _stored(t) for t in types}}, "steps": steps}}))
    """
    found = run_json(code, tmp_path)
    # every answer stored by the processes (the fallback stores none), each as inferred here
    assert found["steps"] == list(range(len(UNCOVERED)))
    expected = {model_type: _infer_reason(model_type) for model_type in UNCOVERED}
    assert found["answers"] == expected


@pytest.mark.slow  # a fresh interpreter that forks, inferring 16 model types
def test_families_slots_asked_in_processes_are_answered_and_kept_here(tmp_path: Path) -> None:
    """``list --all`` asks the families' slots below the decoder layer in the forked
    processes too: the same answers as asked here, and kept by this process."""
    families = ("llama", "qwen3_moe", "gemma3_text")
    code = f"""
        import json
        from layerswap import verdicts
        from layerswap.coverage import _below_decoder, inferring
        from layerswap.registry import backends, families
        import layerswap.slots.class_swap as class_swap
        with verdicts.kept_together():
            with inferring({list(UNCOVERED)!r}, jobs=2, family_types={families!r}) as below:
                pass
        # as a new process: read from disk, never building a tiny model again
        verdicts._ANSWERS.clear()
        def asked_again(family):
            raise AssertionError(f"asked again: {{family.name}}")
        class_swap.tiny_on_meta = asked_again
        by_type = {{f.model_type: f for f in families().values()}}
        again = {{t: _below_decoder(t, by_type[t], backends()) for t in {families!r}}}
        print(json.dumps({{"below": below, "again": again}}))
    """
    found = run_json(code, tmp_path)
    by_type = {family.model_type: family for family in registry_families().values()}
    expected = {t: _below_decoder(t, by_type[t], backends()) for t in families}
    assert found["below"] == expected
    assert found["again"] == expected
    assert any(
        why is None
        for t in families
        for answers in expected[t].values()
        for why in answers.values()
    )


@pytest.mark.slow  # a fresh interpreter that forks
def test_a_process_that_dies_leaves_its_model_types_to_be_inferred_here(tmp_path: Path) -> None:
    code = f"""
        import importlib, json, os
        module = importlib.import_module("layerswap.coverage")
        types = {list(UNCOVERED)!r}
        infer = module.infer_family
        # the process inferring gpt2 ends at once, as if killed (the processes are forked:
        # they call what the module holds here)
        module.infer_family = lambda t: os._exit(1) if t == "gpt2" else infer(t)
        module.infer_in_processes(types, jobs=2)
        module.infer_family = infer
        assert module._stored("gpt2") is None
        print(json.dumps({{t: module.why_not_covered(t) for t in types}}))
    """
    found = run_json(code, tmp_path)
    assert found == {model_type: _infer_reason(model_type) for model_type in UNCOVERED}


def test_with_another_thread_running_nothing_is_forked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forking a process that runs threads can deadlock the child (a lock held by a thread
    that is not copied): the model types are then left to be inferred one by one."""
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        infer_in_processes(list(UNCOVERED), jobs=2)
    finally:
        stop.set()
        other.join()
    assert not list(tmp_path.rglob("*.json"))  # nothing answered, nothing forked


def test_after_cuda_was_initialised_nothing_is_forked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked process cannot use CUDA its parent initialised: every model type inferred
    there would be answered with that error (and the answer kept)."""
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path))
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # as if alone (xdist runs threads)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    infer_in_processes(list(UNCOVERED), jobs=2)
    assert not list(tmp_path.rglob("*.json"))


def test_jobs_without_all_is_refused() -> None:
    result = CliRunner().invoke(app, ["list", "--jobs", "2"])
    assert result.exit_code == 2
    assert "--jobs goes with --all" in result.output


@pytest.mark.parametrize(
    ("indices", "written"),
    [([3], "3"), ([0, 1, 2, 4], "0-2, 4"), ([0, 1, 2, 5, 6], "0-2, 5-6"), ([], "")],
)
def test_layer_indices_are_written_as_runs(indices: list[int], written: str) -> None:
    from layerswap.spans import index_spans

    assert index_spans(indices) == written


def test_list_all_says_what_holds_back_the_other_slots(capsys: pytest.CaptureFixture[str]) -> None:
    from layerswap.cli.output import Output
    from layerswap.cli.render import render_coverage

    row = {
        "model_type": "gemma3n",
        "family": None,
        "backends": [],
        "reason": "layers differ",
        "below_decoder": {},
        "slots_refusal": "its tiny model does not build here (X needs timm, not installed here)",
        "not_covered": {},
    }
    render_coverage(Output(), [row])

    shown = " ".join(capsys.readouterr().out.split())
    assert "layers differ; other slots: its tiny model does not build here (X needs timm" in shown
