"""How much does a dtype change the model? Perplexity and top-1 agreement with float32,
teacher-forced over a fixed English text that ships with this script
(``tools/data/accuracy_text.txt``, ~1,000 SmolLM2 tokens), through the engine's own
forward pass (the paged backend, its kernels and packed weights).

For each ``--dtypes`` entry the model is loaded as the engine loads it, the text is
prefilled as one prompt with every position's logits kept (the prompt-logprobs path),
and the script reports:

* perplexity: exp(mean negative log-likelihood of each next token), natural log;
* top-1 agreement: the share of positions whose most likely next token equals
  float32's (the greedy decisions a dtype would change);
* max |Δ logprob| of the actual next tokens against float32.

float32 through transformers' own forward is the reference row. Prints one JSON
document.

Usage:
    python tools/bench_accuracy.py                                  # float32 vs bfloat16
    python tools/bench_accuracy.py --dtypes float32 bfloat16 float16 --model DIR
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
    ap.add_argument("--text", default=str(TEXT), help="the text to score")
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


def engine_logits(model_dir: str, dtype: str, ids: list[int]):
    """``[len(ids), vocab]`` float32 logits of every position through the engine's backend."""
    import torch

    from engine_proc.factory import build_scheduler, load_model
    from shared import config as cfg

    config = cfg.build(cfg.EngineConfig, {}, {}, model=model_dir, dtype=dtype, max_model_len=len(ids) + 16,
                       max_batch_size=1)
    model, _ = load_model(config)
    sched = build_scheduler(config, model)
    pool = sched.block_pool
    pool.allocate("text", [], len(ids))
    with torch.inference_mode():
        logits = sched.backend.prefill_chunk("text", ids, 0, True, all_logits=True)
    info = {"kernels": sched.backend.kernels.name, "runner": sched.backend.model_runner}
    return logits, info


def reference_logits(model_dir: str, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def score(logits, ids: list[int], ref=None) -> dict:
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
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from shared.models import resolve_model

    model_dir = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(Path(args.text).read_text(), add_special_tokens=True)
    bc.log(f"{len(ids)} tokens of {args.text}")
    ref = reference_logits(model_dir, ids)
    results = {"transformers float32 (reference)": score(ref, ids)}
    for dtype in args.dtypes:
        logits, info = engine_logits(model_dir, dtype, ids)
        results[f"engine {dtype}"] = {**score(logits, ids, ref), **info}
        bc.log(f"{dtype}: {results[f'engine {dtype}']}")
    bc.emit({"benchmark": "dtype_accuracy", "model": model_dir, "text": Path(args.text).name,
             "tokens": len(ids), "env": bc.torch_info(), "results": results}, args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
