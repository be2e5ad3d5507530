"""End-to-end training throughput (tokens/s) of the recipe's model: full softmax vs MIDX.

One optimizer step = ``model(input_ids, labels=input_ids)``, ``loss.backward()``, ``AdamW.step()``, on the model
``recipes/lm_recipe.build_model`` makes (GPT-2 architecture), for these heads:

* ``hf-full``: the unwrapped model: full logits + transformers' ``ForCausalLMLoss`` (the baseline);
* ``exact-chunked``: the head wrapped by ``hf_midx.wrap`` inside ``exact_loss_only()``: the exact loss through torch's
  chunked ``linear_cross_entropy``;
* ``midx-rq``: ``MidxLMHead`` with midx-rq, M negatives per token (per-query, the paper);
* ``midx-rq-shared``: the same with one shared pool of P negatives per batch;
* ``uniform``: ``MidxLMHead`` with the uniform proposal (the cheapest sampler: a floor);
* ``midx-default``: ``MidxLMHead`` with ``MidxConfig()`` as it is (every default but the seed); ``midx-default-m<M>``
  (``--default_extra_m``): the same with M negatives per token;
* ``cce`` / ``liger``: the exact loss of Cut Cross-Entropy's ``linear_cross_entropy`` / Liger-Kernel's fused linear
  cross-entropy on the backbone's hidden states (GPU only, when installed): what large-vocabulary trainers use today.

Settings (``--settings``):

* ``recipe``: the paper's WikiText-2 model (2 layers, 4 heads, d 200, ff 1024), V = 33,278, blocks of 51 tokens, batch
  32; M = 20, K = 32 (the recipe's defaults);
* ``head-dominated`` (CPU default): 2 layers, d 256, ff 1024, V = 131,072, blocks of 128, batch 16, K = 64: a
  CPU-sized stand-in where the output layer dominates as it does in a large-vocabulary LM;
* ``gpt2-small-128k`` (GPU default): 12 layers, 12 heads, d 768, V = 131,072, blocks of 1024, batch 8, bf16 autocast,
  K = 64;
* ``gemma3-270m`` (GPU): a Gemma-3-270M-sized model from its config (``gemma3_text``: 18 layers, d 640, 4 heads of
  256, 1 KV head, ff 2048, tied embeddings, V = 262,144), sequences of 2,048, batch 4, bf16 weights: head-dominated at
  a real shape;
* ``qwen2.5-0.5b`` (GPU): a Qwen2.5-0.5B-sized model from its config (``qwen2``: 24 layers, d 896, 14 heads, 2 KV
  heads, ff 4864, tied embeddings, V = 151,936), sequences of 2,048, batch 4, bf16.

Tokens are i.i.d. Zipf(1) ids (throughput does not depend on the text). Tokens/s counts input tokens (batch x block
length), as the recipe's ``tokens_per_second`` does. The sampler's build (k-means) happens once before timing and is
reported on its own, with one ``refresh`` (warm-started k-means), which the trainer runs once per epoch by default.

Run: ``python recipes/benchmarks/bench_e2e.py --out bench-out [--quick] [--device cpu|cuda]``.
"""

from __future__ import annotations

import contextlib
import time
import types

import torch

import hf_midx

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

NAME = "bench_e2e"
SETTINGS = {
    "recipe": {"overrides": None, "vocab": 33278, "block": 51, "batch": 32, "num_samples": 100, "codebook_size": 128,
               "what": "the WikiText-2 recipe's transformer (2 layers, 4 heads, d 200, ff 1024) and MIDX defaults"},
    "head-dominated": {"overrides": "n_embd=256,n_layer=2,n_head=4,n_inner=1024", "vocab": 131072, "block": 128,
                       "batch": 16, "num_samples": 20, "codebook_size": 64,
                       "what": "CPU-sized, head-dominated: 2 layers, d 256, ff 1024, V=131072"},
    "gpt2-small-128k": {"overrides": "n_embd=768,n_layer=12,n_head=12,n_inner=3072", "vocab": 131072, "block": 1024,
                        "batch": 8, "num_samples": 20, "codebook_size": 64,
                        "what": "GPT-2 small (12 layers, 12 heads, d 768) with V=131072, bf16 autocast"},
    "gemma3-270m": {"arch": "gemma3_text", "vocab": 262144, "block": 2048, "batch": 4, "num_samples": 20,
                    "codebook_size": 64, "dtype": "bfloat16",
                    "config": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                                   tie_word_embeddings=True),
                    "what": "Gemma-3-270M-sized (18 layers, d 640, V=262144) from its config, bf16 weights"},
    "qwen2.5-0.5b": {"arch": "qwen2", "vocab": 151936, "block": 2048, "batch": 4, "num_samples": 20,
                     "codebook_size": 64, "dtype": "bfloat16",
                     "config": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                    num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True),
                     "what": "Qwen2.5-0.5B-sized (24 layers, d 896, V=151936) from its config, bf16 weights"},
}  # fmt: skip
CASES = ("hf-full", "exact-chunked", "cce", "liger", "midx-default", "midx-rq", "midx-rq-shared", "uniform")
#: Cases that compute the exact loss (the yardstick of a sampled head).
EXACT_CASES = ("hf-full", "exact-chunked", "cce", "liger")


def parse_args(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], pool_size=1024, budget_s=(None, "default 120; quick 5"),
                           default_extra_m=[])
    p.add_argument("--settings", nargs="+", default=None, choices=list(SETTINGS),
                   help="default: recipe head-dominated (CPU); recipe gpt2-small-128k (GPU)")  # fmt: skip
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per case (default 5; quick 2)")
    p.add_argument("--bf16", default="auto", choices=["auto", "on", "off"], help="bf16 autocast (auto: on a GPU)")
    args = common.parse(p, argv)
    args.cases = list(dict.fromkeys([*args.cases, *(f"midx-default-m{m}" for m in args.default_extra_m)]))
    return args


def make_model(setting: dict, vocab: int, block: int, seed: int, device: torch.device):
    """The recipe's model (lm_recipe.build_model), or the setting's architecture from its config, on ``device``."""
    from transformers import set_seed  # noqa: PLC0415

    set_seed(seed)
    if "arch" in setting:
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

        config = AutoConfig.for_model(setting["arch"], vocab_size=vocab, **setting["config"])
        dtype = getattr(torch, setting.get("dtype", "float32"))
        with device:  # initialized where it trains: a 0.5B model's CPU init alone takes many seconds
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    lm_recipe = common.import_recipe("lm_recipe")
    data = types.SimpleNamespace(vocab_size=vocab, eos_token_id=1)
    model_args = lm_recipe.ModelArguments(config_overrides=setting["overrides"])
    return lm_recipe.build_model(model_args, data, block - 1).to(device)


def run_setting(key: str, args, device, bf16: bool, warmup: int, steps: int) -> list[dict]:
    s = dict(SETTINGS[key])
    if args.smoke:
        s.update({"vocab": 2048, "batch": 2, "block": 17})
    elif args.quick:
        s.update({"vocab": s["vocab"] if s["vocab"] <= 65536 else 32768, "batch": max(2, s["batch"] // 4)})
    v, block, batch = s["vocab"], s["block"], s["batch"]
    gen = torch.Generator().manual_seed(args.seed)
    counts = common.zipf_counts(v, tokens=1e7) + 1
    batches = [torch.multinomial(counts, batch * block, replacement=True, generator=gen).view(batch, block).to(device)
               for _ in range(4)]  # fmt: skip
    print(f"\n-- {key}: {s['what']}; V={v}, batch {batch} x {block} tokens{', bf16' if bf16 else ''} --")
    kernels = common.exact_kernels(device)
    out = []
    for case in args.cases:
        if case in kernels and kernels[case] is None:
            print(f"{case:24s} skipped: needs a GPU and the package ({'cut-cross-entropy' if case == 'cce' else 'liger-kernel'})")
            continue
        model = make_model(s, v, block, args.seed, device)
        model.train()
        rec = {"setting": key, "case": case, "V": v, "batch": batch, "block": block, "d": model.config.hidden_size,
               "layers": model.config.num_hidden_layers, "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
        exact, loss_of = contextlib.nullcontext, None  # loss_of: a loss from the backbone's hidden states
        if case in kernels:
            loss_of = _kernel_loss(kernels[case], model, getattr(model.config, "final_logit_softcapping", None))
        elif case != "hf-full":
            exact = _wrap(case, model, rec, s, counts, args, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        it = iter(range(1 << 30))

        def step():
            x = batches[next(it) % len(batches)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), exact():
                loss = loss_of(x) if loss_of else model(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        rec.update(common.measure(case, step, device, warmup=warmup, repeats=steps, budget_s=args.budget_s))
        if "ms" in rec:
            rec.update(step_ms=rec.pop("ms"), step_ms_p20=rec.pop("ms_p20"), step_ms_p80=rec.pop("ms_p80"))
            rec["tokens_per_s"] = batch * block / (rec["step_ms"] / 1e3)
            print(f"{'':24s} {rec['tokens_per_s']:>9.0f} tokens/s" + (f"  (build {rec['build_s']:.1f} s, refresh "
                  f"{rec.get('refresh_s', 0):.1f} s)" if "build_s" in rec else ""))  # fmt: skip
        out.append(rec)
        model = opt = None
        common.free_memory(device)
    base = next((r for r in out if r["case"] == "hf-full" and "tokens_per_s" in r), None)
    exact = [r for r in out if r["case"] in EXACT_CASES and "tokens_per_s" in r]
    best = max(exact, key=lambda r: r["tokens_per_s"]) if exact else None
    for r in (r for r in out if "tokens_per_s" in r):
        if base:
            r["speedup_vs_hf"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["memory_ratio_vs_hf"] = base["peak_bytes"] / max(r["peak_bytes"], 1)
        if best:
            r["best_exact"], r["speedup_vs_best_exact"] = best["case"], r["tokens_per_s"] / best["tokens_per_s"]
    return out


def _wrap(case: str, model, rec: dict, s: dict, counts, args, device):
    """Wrap ``model`` with the case's MIDX head (``hf_midx.wrap``); returns the context its steps run in."""
    shared, default = case == "midx-rq-shared", case.startswith("midx-default")
    sampler = "uniform" if case == "uniform" else "midx-rq"
    # midx-default(-m<M>): MidxConfig() as it is (but M); the others: the setting's M and K, the benchmark's P.
    config = hf_midx.MidxConfig(seed=args.seed, log_kl=False) if default else hf_midx.MidxConfig(
        sampler=sampler, num_samples=args.pool_size if shared else s["num_samples"], seed=args.seed,
        negatives="shared" if shared else "per-query", codebook_size=s["codebook_size"], log_kl=False)  # fmt: skip
    if case.startswith("midx-default-m"):
        config = config.replace(num_samples=int(case.removeprefix("midx-default-m")))
    t0 = time.perf_counter()
    hf_midx.wrap(model, config, class_counts=counts, verify=False)
    common.sync(device)
    rec.update(build_s=time.perf_counter() - t0, sampler=config.sampler, num_samples=config.num_samples,
               negatives=config.negatives)  # fmt: skip
    if default:
        return contextlib.nullcontext
    head = model.get_output_embeddings()  # the MidxLMHead
    rec["codebook_size"] = config.codebook_size
    if sampler.startswith("midx"):
        t0 = time.perf_counter()
        head.refresh()
        common.sync(device)
        rec["refresh_s"] = time.perf_counter() - t0
    return head.exact_loss_only if case == "exact-chunked" else contextlib.nullcontext


def _kernel_loss(kernel, model, softcap):
    """x (B, S) -> the exact causal-LM loss of ``kernel`` on the backbone's last hidden states."""
    backbone, weight = model.get_decoder(), model.get_output_embeddings().weight
    liger = isinstance(kernel, type)
    fn = kernel(softcap=softcap) if liger else kernel

    def loss_of(x):
        hidden = backbone(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1]).to(weight.dtype)
        y = x[:, 1:].reshape(-1)
        return fn(weight, h, y) if liger else fn(h, weight, y, softcap=softcap)

    return loss_of


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    bf16 = device.type == "cuda" if args.bf16 == "auto" else args.bf16 == "on"
    if bf16 and device.type == "cpu":
        print("note: bf16 autocast on CPU is slow on most CPUs; timings measure that.")
    warmup, steps = common.repeats_of(args, full=5, quick=1 if args.smoke else 2)
    if args.budget_s is None:
        args.budget_s = 5.0 if args.quick else 120.0
    steps = args.steps or steps
    keys = args.settings or (["recipe"] if args.quick else ["recipe", "gpt2-small-128k" if device.type == "cuda" else "head-dominated"])
    note = {"quick_note": common.by_size(args, "smoke: V=2048, batch 2 x 17 tokens (for the test suite only)",
                                         "quick: V above 65536 capped at 32768, batch divided by 4", None)}  # fmt: skip
    env, settings = common.start(
        NAME, args, device, settings={k: SETTINGS[k] for k in keys}, cases=args.cases, steps=steps, warmup=warmup,
        pool_size=args.pool_size, bf16=bf16, optimizer="AdamW lr 1e-4", timed="forward + backward + optimizer step",
        tokens="input tokens per second (batch x block)", **(note if note["quick_note"] else {}))  # fmt: skip
    results = []
    for key in keys:
        results += run_setting(key, args, device, bf16, warmup, steps)
    rows = common.rows(env, results, op="train_step", provider="case", x_name="setting", x="setting", extra=("V",),
                       metrics={"tokens_per_s": ("tokens_per_s", "tokens/s"), "peak_bytes": ("peak_memory", "bytes")})
    md = render_markdown(env, settings, results)
    return common.finish(args, NAME, env, settings, md, lambda: plot(args.out, results), rows=rows, results=results)


def render_markdown(env, settings, results):
    parts = []
    for key in dict.fromkeys(r["setting"] for r in results):
        rs = [r for r in results if r["setting"] == key]
        parts.append(f"## {key}: {settings['settings'][key]['what']}\n")
        parts.append(f"V={rs[0]['V']}, batch {rs[0]['batch']} x {rs[0]['block']} tokens, "
                     f"{rs[0]['parameters'] / 1e6:.1f}M parameters.\n")  # fmt: skip
        parts.append(common.markdown_table(rs, [
            ("case", "case"), ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else r.get("skipped")),
            ("step (p50)", lambda r: common.fmt_ms(r.get("step_ms"))),
            ("peak memory", lambda r: common.fmt_bytes(r.get("peak_bytes"))),
            ("speed-up vs hf-full", lambda r: common.fmt_ratio(r.get("speedup_vs_hf"), 2)),
            ("memory vs hf-full", lambda r: common.fmt_ratio(r.get("memory_ratio_vs_hf"))),
            ("vs best exact", lambda r: common.fmt_ratio(r.get("speedup_vs_best_exact"), 2)),
            ("sampler build", lambda r: f"{r['build_s']:.1f} s" if "build_s" in r else "-"),
            ("one refresh", lambda r: f"{r['refresh_s']:.1f} s" if "refresh_s" in r else "-")]) + "\n")  # fmt: skip
    return common.report("End-to-end training throughput", env, settings, *parts)


def plot(out_dir, results):
    def bars(key):
        rs = [r for r in results if r["setting"] == key and "tokens_per_s" in r]

        def extra(ax):  # bars, not lines: one number per case
            colors = ["black" if r["case"] == "hf-full" else "tab:blue" for r in rs]
            ax.bar([r["case"] for r in rs], [r["tokens_per_s"] for r in rs], color=colors)
            ax.tick_params(axis="x", rotation=30)

        return {"lines": {}, "extra": extra, "legend": 0, "ylabel": "training tokens / s", "title": key}

    common.plot_panels(out_dir, f"{NAME}.png", [bars(k) for k in dict.fromkeys(r["setting"] for r in results)], size=(5.5, 4))

if __name__ == "__main__":
    main()
