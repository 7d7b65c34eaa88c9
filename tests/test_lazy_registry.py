"""The registry reads declarations, not layers: what users feel as a CLI that answers at
once, and a ``get`` that imports only the family it is asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fresh import run_json

import layerswap
from layerswap import verdicts
from layerswap.registry import offers


def _run(code: str, cache: Path) -> dict[str, object]:
    """``code`` in a fresh interpreter (answers kept under ``cache``); the JSON it prints."""
    found: dict[str, object] = run_json(code, cache)
    return found


LISTING = """
    import json, sys
    from layerswap.registry import offers
    rows = [(offer.name, offer.unmet_requirement()) for offer in offers()]
    modeling = [m for m in sys.modules if ".modeling_" in m]
    print(json.dumps({"rows": len(rows), "torch": "torch" in sys.modules,
                      "transformers": "transformers" in sys.modules, "modeling": modeling}))
"""


@pytest.mark.slow  # fresh interpreters
def test_listing_imports_no_torch_transformers_or_layer_once_answered(tmp_path: Path) -> None:
    """The first listing on a transformers release reads each causal LM's source (the head
    slot's refusals) and keeps the answers; from then on ``layerswap list`` reads only
    declarations."""
    first = _run(LISTING, tmp_path)
    assert first["rows"] == len(layerswap.substitutions())
    again = _run(LISTING, tmp_path)
    assert again == {"rows": first["rows"], "torch": False, "transformers": False, "modeling": []}


@pytest.mark.slow  # fresh interpreters
def test_get_imports_no_other_familys_modeling_module(tmp_path: Path) -> None:
    """Making ``qwen3.decoder.fused``, or every substitution of qwen3, reads qwen3's
    declaration and the backends'; no other family's modeling module is imported
    (transformers' own auto mapping aside)."""
    found = _run(
        """
        import json, sys, layerswap
        layerswap.get("qwen3.decoder.fused")
        assert "qwen3.head.fused" in [sub.name for sub in layerswap.substitutions(family="qwen3")]
        print(json.dumps({"modeling": sorted(m for m in sys.modules
                          if m.startswith("transformers.models.") and ".modeling_" in m
                          and not m.startswith("transformers.models.auto."))}))
        """,
        tmp_path,
    )
    assert set(found["modeling"]) <= {"transformers.models.qwen3.modeling_qwen3"}


@pytest.mark.slow  # fresh interpreters
def test_an_unknown_family_is_answered_without_torch(tmp_path: Path) -> None:
    """A typo on the command line: the error, with close names, before torch is imported."""
    env = {**os.environ, "LAYERSWAP_CACHE": str(tmp_path)}
    code = (
        "import sys\nfrom layerswap.cli import main\n"
        "try:\n    main(['patch', '--model', 'lama'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "did you mean llama" in done.stderr
    assert done.stdout.split() == ["2", "False", "False"]


def test_offers_are_what_substitutions_makes() -> None:
    made = {sub.name: sub for sub in layerswap.substitutions()}
    listed = {offer.name: offer for offer in offers()}
    assert set(listed) == set(made)
    for name, offer in listed.items():
        sub = made[name]
        assert (offer.family, offer.backend, offer.slot, offer.description) == (
            sub.family,
            sub.backend,
            sub.slot,
            sub.description,
        )
        assert offer.unmet_requirement() == sub.unmet_requirement()
    for family in ("llama", "qwen3_moe", "unknown"):  # one family's, asked of it alone
        asked = [(o.name, o.description) for o in offers(family=family)]
        assert asked == sorted(
            (o.name, o.description) for o in listed.values() if o.family == family
        )


def test_an_answer_is_kept_per_release_and_asked_again_when_its_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path))
    monkeypatch.setattr(verdicts, "_ANSWERS", {})
    stamp = {"now": "100:1"}
    monkeypatch.setattr(verdicts, "_source_stamp", lambda module: stamp["now"])
    asked: list[int] = []

    def compute() -> str:
        asked.append(1)
        return f"answer {len(asked)}"

    module = "transformers.models.llama.modeling_llama"
    assert verdicts.remembered("test", "llama", compute, module=module) == "answer 1"
    monkeypatch.setattr(verdicts, "_ANSWERS", {})  # a new process: read from disk
    assert verdicts.remembered("test", "llama", compute, module=module) == "answer 1"
    assert len(asked) == 1
    stamp["now"] = "101:2"  # the modeling file was edited
    assert verdicts.remembered("test", "llama", compute, module=module) == "answer 2"
    assert list(tmp_path.joinpath("answers").glob("*.json"))


def test_answers_kept_together_are_written_once_on_leaving_even_on_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``layerswap list --all`` keeps thousands of answers: one write per table, not per
    answer; each is read back from memory meanwhile, and an error keeps what was asked."""
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path))
    monkeypatch.setattr(verdicts, "_ANSWERS", {})
    writes: list[str] = []
    real = verdicts.write

    def counted(key: str, verdict: dict[str, object], kind: str | None = None) -> bool:
        writes.append(key)
        return real(key, verdict, kind)

    monkeypatch.setattr(verdicts, "write", counted)
    with pytest.raises(KeyboardInterrupt), verdicts.kept_together():
        for i in range(5):
            assert verdicts.remembered("test", f"k{i}", lambda i=i: f"a{i}") == f"a{i}"
        assert verdicts.remembered("test", "k0", lambda: "asked again") == "a0"
        verdicts.remembered("other", "k", lambda: "b")
        assert not writes
        raise KeyboardInterrupt
    assert len(writes) == 2  # one per table
    monkeypatch.setattr(verdicts, "_ANSWERS", {})  # a new process: read from disk
    kept = [verdicts.remembered("test", f"k{i}", lambda: "asked again") for i in range(5)]
    assert kept == [f"a{i}" for i in range(5)]
    assert verdicts.remembered("other", "k", lambda: "asked again") == "b"
    verdicts.remembered("test", "later", lambda: "c")  # outside the block: written at once
    assert len(writes) == 3


def test_answers_collected_in_one_process_are_kept_by_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a forked process asked is sent back and kept by its parent, stamps included."""
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path))
    monkeypatch.setattr(verdicts, "_ANSWERS", {})
    monkeypatch.setattr(verdicts, "_source_stamp", lambda module: "100:1")
    module = "transformers.models.llama.modeling_llama"
    verdicts.remembered("test", "before", lambda: "outside")
    with verdicts.collected() as outer:
        with verdicts.collected() as found:
            verdicts.remembered("test", "llama", lambda: "answer", module=module)
            verdicts.remembered("test", "before", lambda: "asked again")  # kept already
        verdicts.remembered("test", "after", lambda: "later")
    assert found == {"test": {"llama": {"answer": "answer", "stamp": "100:1"}}}
    assert set(outer["test"]) == {"llama", "after"}
    monkeypatch.setattr(verdicts, "_ANSWERS", {})  # the parent: it never asked
    tmp_path.joinpath("answers").rename(tmp_path / "elsewhere")
    verdicts.adopt(found)
    monkeypatch.setattr(verdicts, "_ANSWERS", {})  # read from disk
    assert verdicts.remembered("test", "llama", lambda: "asked again", module=module) == "answer"
    assert verdicts.remembered("test", "after", lambda: "asked again") == "asked again"


def test_a_visible_family_is_seen_by_its_own_thread_alone() -> None:
    """How inference proves a family it inferred: known while proven, to that thread only,
    never registered (two threads inferring at once cannot see each other's)."""
    import dataclasses
    import threading

    from layerswap.errors import UnknownSubstitutionError
    from layerswap.registry import families, get_family, visible

    family = dataclasses.replace(get_family("llama"), name="llama_seen_here")
    elsewhere: dict[str, bool] = {}
    with visible(family):
        assert get_family("llama_seen_here") is family
        assert [o.name for o in offers(family="llama_seen_here", slot="decoder")] == [
            "llama_seen_here.decoder.fused",
            "llama_seen_here.decoder.liger",
            "llama_seen_here.decoder.te",
            "llama_seen_here.decoder.te_fp8",
        ]
        assert layerswap.get("llama_seen_here.decoder.fused").family == "llama_seen_here"
        thread = threading.Thread(
            target=lambda: elsewhere.update(known="llama_seen_here" in families())
        )
        thread.start()
        thread.join()
    assert elsewhere == {"known": False}
    assert "llama_seen_here" not in families()
    with pytest.raises(UnknownSubstitutionError):
        layerswap.get("llama_seen_here.decoder.fused")


def test_the_public_names_are_one_list_for_type_checkers_and_the_runtime() -> None:
    """``layerswap/__init__.py`` writes the API twice (imports for type checkers, a table
    for lazy imports at run time): the two name the same objects."""
    import ast

    source = Path(layerswap.__file__).read_text()
    block = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    typed = {
        alias.asname or alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == layerswap._EXPORTS
    assert set(layerswap.__all__) == {"__version__", *typed}
    assert layerswap.get_slot is __import__("layerswap.slots", fromlist=["get_slot"]).get_slot
