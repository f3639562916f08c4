"""How much do a dtype and the weights' precision change the model? Perplexity and top-1
agreement, teacher-forced over a fixed English text that ships with this script
(``tools/data/accuracy_text.txt``, ~1,000 SmolLM2 tokens), through the engine's own
forward pass (the paged backend, its kernels, its low-bit or dense weights).

For each ``--dtypes`` × ``--quantization`` pair the model is loaded as the engine loads
it, the text is prefilled as one prompt with every position's logits kept (the
prompt-logprobs path), and the script reports:

* perplexity: exp(mean negative log-likelihood of each next token), natural log;
* top-1 agreement: the share of positions whose most likely next token equals the
  float32 reference's (the greedy decisions a dtype or precision would change), and, for
  a low-bit row, the same against ``none`` (the de-quantized weights) in its dtype;
* max |Δ logprob| of the actual next tokens against the reference.

The reference row is float32 through transformers' own forward on the de-quantized
weights (``tickserve convert --hf``). Prints one JSON document.

Usage:
    python tools/bench_accuracy.py                    # {float32, bfloat16} × {none, auto}
    python tools/bench_accuracy.py --dtypes bfloat16 --quantization none auto int8 --model FILE.gguf
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "accuracy_text.txt"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory or .gguf; empty → the embedded SmolLM2")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--quantization", nargs="+", default=["none", "auto"])
    ap.add_argument("--text", default=str(TEXT), help="the text to score")
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


def engine_logits(model: str, dtype: str, ids: list[int], quantization: str = "none"):
    """``[len(ids), vocab]`` float32 logits of every position through the engine's backend."""
    import torch

    from engine_proc.factory import build_scheduler, load_model
    from shared import config as cfg

    config = cfg.build(cfg.EngineConfig, {}, {}, model=model, dtype=dtype, max_model_len=len(ids) + 16,
                       max_batch_size=1, quantization=quantization)
    model, _ = load_model(config)
    sched = build_scheduler(config, model)
    runner = sched.backend.runner
    if quantization != "none" and runner is not None:  # the whole text is one large pass: keep it low-bit
        runner.plan.quantized_below = 1 << 30
    pool = sched.block_pool
    pool.allocate("text", [], len(ids))
    with torch.inference_mode():
        logits = sched.backend.prefill_chunk("text", ids, 0, True, all_logits=True)
    info = {"kernels": sched.backend.kernels.name, "runner": sched.backend.model_runner,
            "weights": getattr(sched.backend, "weights_precision", "") or dtype}
    return logits, info


def reference_logits(model_dir: str, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def score(logits, ids: list[int], ref=None, dense=None) -> dict:
    import torch

    targets = torch.tensor(ids[1:])
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logp.gather(1, targets[:, None])[:, 0]
    out = {"perplexity": round(math.exp(nll.mean().item()), 4), "positions": len(ids) - 1}
    if ref is not None:
        ref_logp = torch.log_softmax(ref[:-1].float(), dim=-1)
        agree = (logits[:-1].argmax(-1) == ref[:-1].argmax(-1)).float().mean().item()
        out["top1_agreement_vs_float32"] = round(agree, 4)
        out["max_abs_delta_logprob_vs_float32"] = round(
            (logp.gather(1, targets[:, None]) - ref_logp.gather(1, targets[:, None])).abs().max().item(), 4)
    if dense is not None:
        out["top1_agreement_vs_dequantized"] = round((logits[:-1].argmax(-1) == dense[:-1].argmax(-1)).float().mean().item(), 4)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from shared.models import hf_directory

    model_dir = str(hf_directory(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(Path(args.text).read_text(), add_special_tokens=True)
    bc.log(f"{len(ids)} tokens of {args.text}")
    ref = reference_logits(model_dir, ids)
    results = {"transformers float32 (reference)": score(ref, ids)}
    for dtype in args.dtypes:
        dense = None
        for quantization in args.quantization:
            logits, info = engine_logits(args.model, dtype, ids, quantization)
            name = f"engine {dtype} {quantization}"
            results[name] = {**score(logits, ids, ref, dense if quantization != "none" else None), **info}
            if quantization == "none":
                dense = logits
            bc.log(f"{name}: {results[name]}")
    bc.emit({"benchmark": "dtype_accuracy", "model": model_dir, "text": Path(args.text).name,
             "tokens": len(ids), "env": bc.torch_info(), "results": results}, args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
