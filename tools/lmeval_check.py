"""Score continuations with lm-evaluation-harness's ``local-completions`` client (the model
it uses for loglikelihood tasks: ``echo``, ``logprobs: 1``, prompt logprobs) against a
running tickserve, and compare with teacher-forced logprobs of the same model in
transformers.

Usage (lm_eval beside tickserve's packages, e.g. ``pip install lm_eval aiohttp tenacity``)::

    python tools/lmeval_check.py PORT MODEL_DIR

MODEL_DIR: the converted model the server runs (``/version`` names it).
"""

import sys

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

port, model_dir = sys.argv[1], sys.argv[2]
lm = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{port}/v1/completions", model="SmolLM2-135M-Instruct",
                         tokenizer_backend="huggingface", tokenizer=model_dir, tokenized_requests=True,
                         num_concurrent=2, max_retries=1)
pairs = [("The capital of France is", " Paris"), ("The capital of France is", " Berlin"),
         ("Two plus two equals", " four"), ("Water boils at one hundred degrees", " Celsius")]
reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
got = lm.loglikelihood(reqs)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
worst = 0.0
for (ctx, cont), (ll, greedy) in zip(pairs, got):
    c, w = tok.encode(ctx), tok.encode(ctx + cont)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([w])).logits[0].float(), -1)
    ref = sum(lp[i - 1, w[i]].item() for i in range(len(c), len(w)))
    worst = max(worst, abs(ref - ll))
    print(f"{ctx!r} + {cont!r}: tickserve {ll:.4f} (greedy {greedy}), transformers {ref:.4f}")
print(f"max |difference| {worst:.2e}")
