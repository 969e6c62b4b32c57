# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV-quality harness's Markdown: one table per model, from quality.json."""

from typing import Any

DASH = "—"


def _num(x: float | None, fmt: str) -> str:
    return DASH if x is None else format(x, fmt)


def _int(x: int | None) -> str:
    return DASH if x is None else f"{x:,}"


def _skip_label(cell: dict) -> str:
    # Only TurboQuant reads the skip list; auto and fp8 run every layer alike.
    if not cell["kv"].startswith("turboquant_"):
        return DASH
    return cell["skip"]


def _quantized(cell: dict) -> str:
    facts = cell.get("facts") or {}
    q, n = facts.get("quantized_layers"), facts.get("attention_layers")
    return DASH if q is None or n is None else f"{q}/{n}"


def _bits(cell: dict) -> str:
    bits = (cell.get("facts") or {}).get("kv_bits")
    if not isinstance(bits, dict):
        return DASH
    return f"{_num(bits.get('quantized'), '.2f')} / {_num(bits.get('cache'), '.2f')}"


def _recall(needle: dict) -> str:
    pct, ci = needle.get("recall_pct"), needle.get("ci95_pct")
    if pct is None or not ci:
        return _num(pct, ".1f")
    return f"{pct:.1f} ({ci[0]:.0f}-{ci[1]:.0f})"


def _lost(needle: dict) -> str:
    if "lost" not in needle:
        return DASH
    return f"{needle['lost']} / {needle['gained']}"


def _ratio(ppl: dict) -> str:
    vs = ppl.get("windows_vs_auto")
    ratio = _num(ppl.get("ratio_to_auto"), ".4f")
    return ratio if not vs or ratio == DASH else f"{ratio} ± {vs['se']:.4f}"


def _answer(answer: dict) -> str:
    vs = answer.get("vs_auto")
    return DASH if not vs else f"{vs['mean']:+.3f} ± {vs['se']:.3f}"


def header_line(meta: dict) -> str:
    devices = meta.get("devices") or []
    names = sorted({d.get("name", "?") for d in devices})
    device = ", ".join(f"{len(devices)}x {n}" for n in names) if devices else "unknown"
    v = meta.get("versions") or {}
    versions = " · ".join(
        f"{k} {v[k]}" for k in ("vllm", "torch", "triton") if v.get(k)
    )
    return (
        f"Device: {device} · {versions} · date {meta.get('date', '?')} · "
        f"command: `{meta.get('command', '?')}`"
    )


def model_table(name: str, model: dict, cells: list[dict]) -> list[str]:
    inputs = model.get("inputs") or {}
    needle = inputs.get("needle") or {}
    lengths = [str(n) for n in needle.get("lengths", [])]
    # Results written before --needle-sample existed are sample 0's.
    sample = needle.get("sample", 0)
    cases = len(needle.get("cases", []))
    ppl = inputs.get("ppl") or {}
    agree = len((inputs.get("agreement") or {}).get("prompts", []))
    lines = [
        f"## {name}",
        "",
        f"Checkpoint `{model.get('dir')}`, max_model_len {model.get('context')}; "
        f"corpus {_int(inputs.get('corpus_tokens'))} tokens. Perplexity over "
        f"{ppl.get('windows', '?')} windows of {ppl.get('window_tokens', '?')} "
        f"tokens; needle recall over {cases} cases of sample {sample} (lengths "
        f"{', '.join(lengths)}; depths 0.1-0.9; in brackets its 95 % Wilson "
        "interval; lost / gained: cases auto found and this did not, and the "
        "reverse; answer nats: the number's negative log-likelihood after "
        "the prompt under teacher forcing, this minus auto's, mean over the "
        "cases ± its standard error); x auto: ± the standard error of the "
        "windows' mean log ratio to auto's same windows; agreement: "
        f"{agree} prompts x 64 greedy "
        "tokens, tokens equal to auto's before the first difference; K/V "
        "bits: per K/V element with norms, scales and padding, over the "
        "quantized layers / over one request's whole cache at max_model_len, "
        "bf16 layers included.",
        "",
    ]
    head = [
        "KV",
        "skip layers",
        "quantized layers",
        "K/V bits",
        "KV tokens",
        "perplexity",
        "x auto",
        "needle % (95 % CI)",
        "lost / gained",
        "answer nats vs auto",
        *(f"@{n}" for n in lengths),
        "agree %",
        "equal",
        "status",
    ]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for c in cells:
        ppl_c = c.get("ppl") or {}
        needle = c.get("needle") or {}
        per_length = needle.get("per_length") or {}
        agr = c.get("agreement") or {}
        equal = (
            f"{agr['prompts_equal']}/{agr['prompts']}"
            if "prompts_equal" in agr
            else DASH
        )
        row = [
            c["kv"],
            _skip_label(c),
            _quantized(c),
            _bits(c),
            _int(c.get("kv_tokens")),
            _num(ppl_c.get("ppl"), ".3f"),
            _ratio(ppl_c),
            _recall(needle),
            _lost(needle),
            _answer(c.get("answer") or {}),
            *(_num(per_length.get(n), ".0f") for n in lengths),
            _num(agr.get("pct"), ".1f"),
            equal,
            c["status"],
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    meta = result.get("meta") or {}
    lines = ["# KV-cache quality on trained weights", "", header_line(meta), ""]
    if not meta.get("complete", True):
        lines += ["**Partial: the run was still going when this was written.**", ""]
    for name, model in (result.get("models") or {}).items():
        cells = [c for c in result.get("cells", []) if c["model"] == name]
        lines += model_table(name, model, cells)
        lines.append("")
    failed = [c for c in result.get("cells", []) if c["status"] != "ok"]
    if failed:
        lines.append("Cells that did not finish:")
        lines.append("")
        for c in failed:
            cause = c.get("root_cause") or ""
            lines.append(
                f"- `{c['key']}`: {c['status']}" + (f" — {cause}" if cause else "")
            )
        lines.append("")
    return "\n".join(lines)
