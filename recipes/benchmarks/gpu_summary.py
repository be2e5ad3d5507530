"""The GPU acceptance table from gpu_check.sh's outputs: the default head against the faster of Cut
Cross-Entropy and Liger (head, T = 8192) and against the best exact loss (training step).

Run: ``python recipes/benchmarks/gpu_summary.py RESULTS_DIR`` (the folder with bench_head.json and
bench_e2e.json); prints Markdown and writes RESULTS_DIR/summary.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHAPES = {262144: "Gemma-3-270M", 151936: "Qwen2.5-0.5B", 128256: "Llama-3-8B", 256000: "Gemma-2-2B"}
KERNELS = ("cce", "liger")


def head_table(results: list[dict]) -> list[str]:
    out = [
        "| head (V x D) | HF | CCE | Liger | default, per-query | default, shared pool | per-query vs faster kernel | shared vs faster kernel | per-query memory vs CCE |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v, name in SHAPES.items():
        rows = {r["case"]: r for r in results if r["V"] == v and "ms" in r}
        if not rows:
            continue
        kernels = [rows[k] for k in KERNELS if k in rows]
        best = min(kernels, key=lambda r: r["ms"]) if kernels else None
        pq, sh = rows.get("midx-default/per-query"), rows.get("midx-default/shared")

        def ms(r):
            return "-" if r is None else f"{r['ms']:.1f} ms, {r['peak_bytes'] / 2**20:,.0f} MiB"

        def vs(r):
            return "-" if r is None or best is None else f"{best['ms'] / r['ms']:.2f}x ({best['case']})"

        mem = "-" if pq is None or "cce" not in rows else f"{pq['peak_bytes'] / rows['cce']['peak_bytes']:.2f}x"
        d = next(iter(rows.values()))["D"]
        out.append(f"| {name} ({v:,} x {d}) | {ms(rows.get('hf'))} | {ms(rows.get('cce'))} | {ms(rows.get('liger'))} "
                   f"| {ms(pq)} | {ms(sh)} | {vs(pq)} | {vs(sh)} | {mem} |")
    return out


def fewer_negatives_table(results: list[dict], key: str, speed: str) -> list[str]:
    """The default head at other M (``--default_extra_m``: cases midx-default-m<M>[/per-query]) against
    the default M and the exact losses; ``key`` groups rows (V or setting), ``speed`` is ms or tokens_per_s."""
    extra = [r for r in results if r["case"].startswith("midx-default-m") and speed in r]
    if not extra:
        return []
    faster = min if speed == "ms" else max
    out = ["| shape | case | time or throughput | peak memory | vs default M | vs fastest exact |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in extra:
        same = [x for x in results if x[key] == r[key] and speed in x]
        default = next((x for x in same if x["case"] in ("midx-default", "midx-default/per-query")), None)
        exact = [x for x in same if x["case"] in ("hf", "hf-full", "cce", "liger")]
        best = faster(exact, key=lambda x: x[speed]) if exact else None

        def ratio(other, r=r):
            if other is None:
                return "-"
            return f"{other['ms'] / r['ms']:.2f}x" if speed == "ms" else f"{r[speed] / other[speed]:.2f}x"

        value = f"{r['ms']:.1f} ms" if speed == "ms" else f"{r[speed]:,.0f} tok/s"
        name = SHAPES.get(r[key], r[key]) if key == "V" else r[key]
        vs_best = "-" if best is None else f"{ratio(best)} ({best['case']})"
        memory = f"{r['peak_bytes'] / 2**20:,.0f} MiB"
        out.append(f"| {name} | {r['case']} | {value} | {memory} | {ratio(default)} | {vs_best} |")
    return out


def e2e_table(results: list[dict]) -> list[str]:
    out = ["| model | full softmax (HF) | CCE | Liger | default | default vs best exact |",
           "| --- | --- | --- | --- | --- | --- |"]
    for setting in dict.fromkeys(r["setting"] for r in results):
        rows = {r["case"]: r for r in results if r["setting"] == setting and "tokens_per_s" in r}

        def cell(case):
            r = rows.get(case)
            return "-" if r is None else f"{r['tokens_per_s']:,.0f} tok/s, {r['peak_bytes'] / 2**30:.2f} GiB"

        d = rows.get("midx-default")
        vs = "-" if d is None else f"{d['speedup_vs_best_exact']:.2f}x ({d['best_exact']})"
        out.append(f"| {setting} | {cell('hf-full')} | {cell('cce')} | {cell('liger')} | {cell('midx-default')} | {vs} |")
    return out


def main(argv=None) -> str:
    folder = Path((argv or sys.argv[1:])[0])
    head = json.loads((folder / "bench_head.json").read_text())
    env = head["environment"]
    lines = [f"# GPU summary ({env.get('device', '?')})", ""]
    versions = ("torch", "cuda", "transformers", "accelerate", "triton", "cut_cross_entropy", "liger_kernel", "hf_midx")
    listed = ", ".join(f"{k} {env.get(k)}" for k in versions)
    lines += [f"Versions: {listed}; git {env.get('git', {}).get('commit')}.", ""]
    lines += ["Head + loss, forward + backward, bf16, T = 8,192 tokens (median of up to 5 warm calls):", ""]
    lines += head_table(head["results"])
    fewer = fewer_negatives_table(head["results"], "V", "ms")
    if fewer:
        lines += ["", "The default head with fewer negatives per token (head, as above):", "", *fewer]
    e2e_path = folder / "bench_e2e.json"
    if e2e_path.exists():
        e2e = json.loads(e2e_path.read_text())["results"]
        lines += ["", "Training step (forward, backward, AdamW), bf16, batch 4 x 2,048 tokens:", ""]
        lines += e2e_table(e2e)
        fewer = fewer_negatives_table(e2e, "setting", "tokens_per_s")
        if fewer:
            lines += ["", "The default head with fewer negatives per token (training step, as above):", "", *fewer]
    text = "\n".join(lines) + "\n"
    (folder / "summary.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
