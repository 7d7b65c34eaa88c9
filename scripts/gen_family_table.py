"""Write the builtin family table into docs/substitutions.md and the family list into README.md.

Both are generated from the registry: every registered family, how it is declared, the
structural features its declaration names, and per backend whether its decoder layer
covers it (and if not, why). ``tests/test_docs.py`` checks that both files are fresh.

    python scripts/gen_family_table.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from layerswap.family import GATED_MLP, PRE_NORMS, SEPARATE_QKV, Family  # noqa: E402
from layerswap.registry import backends, families  # noqa: E402

DOCS = ROOT / "docs" / "substitutions.md"
README = ROOT / "README.md"
START, END = "<!-- families:start -->", "<!-- families:end -->"


def features(family: Family) -> str:
    """The structural features a declaration names, in words."""
    found = []
    norm = {"rms": "RMSNorm", "layer": "LayerNorm with bias", "layer_nobias": "bias-free LayerNorm"}
    kind = norm.get(family.normalization.kind, family.normalization.kind)
    if not family.normalization.scale:
        kind = {"rms": "RMSNorm", "layer_nobias": "LayerNorm"}.get(family.normalization.kind, kind)
        kind += " without a weight (no parameters)"
    found.append(f"{kind} scaling by `1 + weight`" if family.normalization.offset == 1.0 else kind)
    if family.composite:
        text = family.tiny.get("text_config", {})
        sections = (text.get("rope_parameters") or {}).get("mrope_section")
        found.insert(
            0, f"the text decoder of `{family.causal_lm}`" + (" (M-RoPE)" if sections else "")
        )
    if family.normalization.switch is not None:
        field, switched = family.normalization.switch
        found[-1] += f" (a {norm.get(switched, switched)} where `{field}` is unset)"
    if family.normalization.places != PRE_NORMS:
        places = ", ".join(f"`{name}` ({place})" for place, name in family.normalization.places)
        found.append(f"norms: {places}")
    if family.layer.parallel:
        found.append("attention and MLP in parallel")
    qk = {True: "q/k norms per head", "across": "q/k norms across heads"}
    if family.attention.qk_norm:
        text = qk.get(family.attention.qk_norm, "q/k norms with a weight per head")
        found.append(
            text
            + (f" (`{family.attention.qk_norm_switch}`)" if family.attention.qk_norm_switch else "")
        )
    if family.feed_forward.kind == "original":
        where = (
            ""
            if family.feed_forward.attribute == "mlp"
            else f" as `{family.feed_forward.attribute}`"
        )
        found.append(
            f"the original's `{family.feed_forward.module_class}`{where} (mixture of experts)"
        )
    elif family.feed_forward.kind != "gated":
        found.append(f"plain MLP `{'`/`'.join(family.feed_forward.modules)}`")
    elif family.feed_forward.modules != GATED_MLP:
        found.append(f"its own `{family.feed_forward.modules[0]}`")
    if family.attention.qkv_modules != SEPARATE_QKV:
        found.append(f"its own `{family.attention.qkv_modules[0]}`")
    if family.rope.layout != "half":
        found.append(f"rotary `{family.rope.layout}`")
    if family.rope.layers != "all":
        found.append(f"rotary on some layers only (`{family.rope.layers}`)")
    if family.attention.sinks:
        found.append("attention sinks (`self_attn.sinks`)")
    if family.layer.residual_dropout is not None:
        found.append(f"dropout `{family.layer.residual_dropout}` after the output projections")
    if family.attention.qk_norm_modules != ("q_norm", "k_norm"):
        found.append(f"q/k norms `{'`/`'.join(family.attention.qk_norm_modules)}`")
    if family.attention.qk_norm_after_rotary:
        found.append("q/k norms after the rotary embedding")
    if family.attention.query_scale is not None:
        found.append(f"queries scaled by position (`{family.attention.query_scale}`)")
    if family.attention.clip_qkv is not None:
        found.append(f"q/k/v clamped where `{family.attention.clip_qkv}` is set")
    biases = []
    for value, label in (
        (family.attention.qkv_bias, "q/k/v"),
        (family.attention.o_bias, "output"),
        (family.feed_forward.bias, "MLP"),
    ):
        if value is True:
            biases.append(f"{label} biases")
        elif isinstance(value, str):
            biases.append(f"{label} biases by `{value}`")
    found.extend(biases)
    return "; ".join(found)


def table() -> str:
    declared = sorted(backends())
    reasons: list[str] = []
    rows = [
        "| family | declared | structure | " + " | ".join(f"`{b}`" for b in declared) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in declared) + " |",
    ]
    for name, family in sorted(families().items()):
        how = "inferred" if family.description.startswith("inferred") else "by hand"
        cells = []
        for backend in declared:
            reason = backends()[backend].unsupported(family)
            if reason is None:
                cells.append("yes")
                continue
            if reason not in reasons:
                reasons.append(reason)
            cells.append(f"no [{reasons.index(reason) + 1}]")
        rows.append(f"| `{name}` | {how} | {features(family)} | " + " | ".join(cells) + " |")
    notes = [f"{number}. {reason}" for number, reason in enumerate(reasons, 1)]
    count = (
        f"{len(families())} families, generated from the registry by `scripts/gen_family_table.py`."
    )
    return "\n".join([count, "", *rows, "", "Why a backend does not cover a family:", "", *notes])


def family_list() -> str:
    names = sorted(families())
    return f"{len(names)} families: " + ", ".join(names)


def _replace(text: str, body: str) -> str:
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"no {START} ... {END} markers")
    return pattern.sub(lambda _: f"{START}\n{body}\n{END}", text)


def render() -> dict[Path, str]:
    """Each generated file's whole new text."""
    return {
        DOCS: _replace(DOCS.read_text(), table()),
        README: _replace(README.read_text(), family_list()),
    }


def main() -> None:
    for path, text in render().items():
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
