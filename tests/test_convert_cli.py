"""`tickserve convert --hf`: the float32 Hugging Face directory other tools read (vLLM,
lm-eval, the accuracy benchmark's reference), beside the packed low-bit weights the
engine runs, and one line with a non-zero exit for a model that is not there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", "convert", *args], capture_output=True, text=True,
                          timeout=600)


def test_convert_hf_prints_a_directory_transformers_and_vllm_can_read(smol_dir):
    done = _convert("--hf")
    assert done.returncode == 0, done.stderr
    out = Path(done.stdout.strip())
    assert out == smol_dir
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= names
    # the packed weights sit beside it under a name no checkpoint reader globs
    assert not [n for n in names if n.endswith(".safetensors") and n != "model.safetensors"]


def test_convert_hf_of_a_missing_model_is_one_line_and_a_non_zero_exit(tmp_path):
    done = _convert("--hf", str(tmp_path / "nothing.gguf"))
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1 and "nothing.gguf" in done.stderr
    assert done.stdout == ""
