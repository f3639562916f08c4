"""Low-bit weights in their own precision: GGUF blocks repacked into the kernel's tiles
(exactly the numbers the file holds), ``qmatmul.c`` against the de-quantized weight on
every code path the host can run, a GGUF file written here read back with llama.cpp's
q/k permutation undone, and the tiny Llama generating on its packed weights."""

from __future__ import annotations

import ctypes
import platform
import subprocess

import numpy as np
import pytest
import torch

from engine_proc import quant
from engine_proc.kernels.build import CFLAGS, DTYPES, QMATMUL_SIGNATURES, QMATMUL_SOURCE
from shared.native_build import compiler
from tests.conftest import TINY_LLAMA
from tests.helpers import make_request, make_scheduler, reference_logits, run_until_idle, tokens_of

gguf = pytest.importorskip("gguf")
needs_c = pytest.mark.skipif(compiler() is None or platform.system() != "Linux",
                             reason="no C compiler: qmatmul cannot be built here")
TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("gguf_type", TYPES)
def test_packed_tiles_hold_exactly_the_files_numbers(gguf_type):
    w = _weight(48, 96).numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[gguf_type])
    packed = quant.from_gguf(raw, gguf_type, 48, 96)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[gguf_type]).reshape(48, 96)
    assert torch.equal(quant.dequantize(packed), torch.from_numpy(want))
    codes, d, m = quant.unpack(packed)
    assert torch.equal(quant.dequantize(quant.pack(codes, d, m, gguf_type)), quant.dequantize(packed))


def test_pack_refuses_a_shape_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="out % 16"):
        quant.quantize(_weight(40, 64), "Q8_0")
    with pytest.raises(ValueError, match="is not"):
        quant.from_gguf(np.zeros(100, np.uint8), "Q4_0", 16, 64)


def _rel_err(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gguf_type", TYPES)
def test_qmatmul_matches_the_dequantized_weight(dtype, gguf_type):
    """y = x·Wᵀ + b on the tiles, for pass sizes that take the kernel's 1-, 2-, 4- and
    8-row paths and their remainders; the activations are quantized to int8 per 16 inputs,
    so the result is within 1 % of float32 on the de-quantized weight."""
    from engine_proc.kernels import QMatmul

    w = quant.quantize(_weight(64, 256, seed=1), gguf_type)
    dense = quant.dequantize(w)
    bias = torch.randn(64) * 0.1
    mm = QMatmul(dtype, num_threads=2)
    for rows in (1, 2, 3, 5, 8, 13, 37):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = x.float() @ dense.T + bias
        got = mm(w, x, bias, out_f32=True)
        assert got.dtype == torch.float32 and got.shape == (rows, 64)
        assert _rel_err(got, want) < 0.01, (rows, _rel_err(got, want))
        assert mm(w, x).dtype == dtype
        mm.num_threads = 1  # each output belongs to one thread: the same numbers
        assert torch.equal(got, mm(w, x, bias, out_f32=True))
        mm.num_threads = 2
    with pytest.raises(ValueError, match="qmatmul wants"):
        mm(w, torch.randn(3, 128).to(dtype))


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@needs_c
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 code paths")
def test_every_code_path_the_host_runs_gives_the_same_numbers(tmp_path):
    """The AVX-512 VNNI, AVX2 and portable builds of qmatmul.c agree on one input (their
    integer dot products are exact; only the order of the float scaling differs)."""
    flags = _cpu_flags()
    marches = {"generic": "-march=x86-64"}
    if {"avx2", "fma", "f16c"} <= flags:
        marches["avx2"] = "-march=x86-64-v3"
    if {"avx512f", "avx512bw", "avx512_vnni", "avx512vl"} <= flags:
        marches["avx512vnni"] = "-march=x86-64-v4 -mavx512vnni"
    cc = compiler()
    w = quant.quantize(_weight(32, 128, seed=2), "Q4_1")
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3))
    results = {}
    for isa, march in marches.items():
        out = tmp_path / f"qmatmul-{isa}.so"
        cflags = [f for f in CFLAGS if not f.startswith("-march")] + march.split()
        subprocess.run([cc, *cflags, f"-DSCALAR_BF16={DTYPES[torch.float32]}", str(QMATMUL_SOURCE), "-o", str(out),
                        "-lm"], check=True, capture_output=True, timeout=120)
        lib = ctypes.CDLL(str(out))
        for name, (args, res) in QMATMUL_SIGNATURES.items():
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
        assert lib.qmatmul_isa().decode() == isa
        y = torch.empty(9, 32)
        assert lib.qmatmul(int(w.fmt), w.data.data_ptr(), 32, 128, x.data_ptr(), 128, 9, None, y.data_ptr(), 32, 1,
                           1) == 0
        results[isa] = y
    for isa, y in results.items():
        torch.testing.assert_close(y, results["generic"], rtol=1e-5, atol=1e-5, msg=isa)
    assert _rel_err(results["generic"], x @ quant.dequantize(w).T) < 0.01


def _build_qmatmul(tmp_path, name: str, dtype: torch.dtype, extra: list[str]) -> ctypes.CDLL:
    out = tmp_path / f"qmatmul-{name}.so"
    subprocess.run([compiler(), *CFLAGS, *extra, f"-DSCALAR_BF16={DTYPES[dtype]}", str(QMATMUL_SOURCE), "-o", str(out),
                    "-lm"], check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(out))
    for name_, (args, res) in QMATMUL_SIGNATURES.items():
        getattr(lib, name_).argtypes, getattr(lib, name_).restype = args, res
    return lib


@needs_c
@pytest.mark.skipif(not {"amx_tile", "amx_bf16", "avx512_bf16"} <= _cpu_flags(), reason="no AMX on this CPU")
@pytest.mark.parametrize("gguf_type", TYPES)
def test_amx_tiles_match_the_dequantized_weight_and_the_int8_path(gguf_type, tmp_path):
    """bfloat16 passes of 4 rows or more run on AMX tiles (each tile-block de-quantized
    in registers): within 1 % of float32 on the de-quantized weight at every row count
    around the tiles' 16 and 32 rows and from the first tiled one, on both loops (the column loop up to 64 rows, the
    panel loop above) and with an odd tile count; the same numbers on one
    thread as on two; and close to the int8 vector path a build without AMX takes."""
    from engine_proc.kernels import QMatmul

    n, k = 80, 256  # five 16-row tiles: one pair is split off alone
    w = quant.quantize(_weight(n, k, seed=4), gguf_type)
    dense = quant.dequantize(w)
    bias = torch.randn(n) * 0.1
    mm = QMatmul(torch.bfloat16, num_threads=2)
    assert mm.tile_rows == 4 and "amx-bf16" in mm.description
    vector = _build_qmatmul(tmp_path, "no-amx", torch.bfloat16, ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"])
    assert vector.qmatmul_tile_rows() == 0
    for rows in (4, 9, 16, 17, 31, 32, 33, 48, 64, 65, 70):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = x.float() @ dense.T + bias
        got = mm(w, x, bias, out_f32=True)
        assert _rel_err(got, want) < 0.01, (rows, _rel_err(got, want))
        assert torch.equal(mm(w, x, bias).float(), got.to(torch.bfloat16).float())  # bfloat16 out: rounded alike
        mm.num_threads = 1
        assert torch.equal(got, mm(w, x, bias, out_f32=True))
        mm.num_threads = 2
        y = torch.empty(rows, n)
        assert vector.qmatmul(int(w.fmt), w.data.data_ptr(), n, k, x.data_ptr(), k, rows, bias.data_ptr(),
                              y.data_ptr(), n, 1, 1) == 0
        assert _rel_err(y, want) < 0.01 and _rel_err(got, y) < 0.01


# ------------------------------------------------------------------ a GGUF file

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (``permute`` in convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, path, types: dict[str, str]):
    """The tiny Llama's tensors under llama.cpp's names, each projection in its type."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def put(name, a, kind="F32"):
        a = np.ascontiguousarray(a, dtype=np.float32)
        if kind == "F32":
            writer.add_tensor(name, a)
        else:
            qt = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)

    put("token_embd.weight", sd["model.embed_tokens.weight"], "Q8_0")
    put("output.weight", sd["lm_head.weight"], types["output"])
    put("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads), types["attn"])
        put(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
            types["attn"])
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], types["attn"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], types["attn"])
        for g, h in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            put(f"blk.{i}.{g}.weight", sd[p + f"mlp.{h}.weight"], types["ffn"])
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(model, path, {"attn": "Q4_0", "ffn": "Q4_1", "output": "Q8_0"})
    return model, path


def test_a_gguf_file_reads_back_with_its_rows_in_transformers_order(tiny_gguf):
    from engine_proc import gguf_weights

    model, path = tiny_gguf
    weights = gguf_weights.read(path, model.config)
    assert weights.summary == "Q4_0×8 Q4_1×6 Q8_0×1"
    assert weights.embed is not None and weights.embed.source == "Q8_0"
    for (i, name), w in weights.layers.items():
        parent = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        want = getattr(getattr(model.model.layers[i], parent), name).weight.detach()
        # 4-bit blocks: within a few percent; rows out of order would be ~140 % off
        assert _rel_err(quant.dequantize(w), want) < 0.1, (i, name)
    torch.testing.assert_close(torch.from_numpy(weights.floats["model.norm.weight"]), model.model.norm.weight.detach())


@needs_c
def test_the_tiny_llama_generates_on_its_packed_weights(tiny_gguf, tiny_model_dir):
    """The paged backend on the packed tiles, batched and chunked, against the same model
    de-quantized to float32, teacher-forced on the tokens it chose: its logits are as close
    to the reference as the de-quantized model's own bfloat16 rounding is (the tiny random
    model amplifies any rounding: 2-20 % per step; wrong rows or scales give ~100 %), and
    not bit-identical (the low-bit path ran)."""
    from engine_proc import gguf_weights, lowbit_model

    model, path = tiny_gguf
    weights = gguf_weights.read(path, model.config)
    packed_model = lowbit_model.model_from_packed(tiny_model_dir, weights, torch.float32)
    setattr(packed_model, lowbit_model.LOW_BIT_ATTR, weights)
    dense_model = lowbit_model.model_from_packed(tiny_model_dir, weights, torch.float32)
    sched = make_scheduler(packed_model, prefill_mode="chunked", prefill_chunk_size=8)
    assert "Q4_0" in sched.backend.weights_precision
    sched.backend.runner.plan.quantized_below = 1 << 30  # every pass on the tiles
    prompts = [[5, 17, 99, 1234, 7], [300, 301, 302], list(range(40, 75))]
    reqs = [make_request(p, max_tokens=6, ignore_eos=True) for p in prompts]
    outs = run_until_idle(sched, {0: reqs[:2], 2: reqs[2:]})
    bf16_model = lowbit_model.model_from_packed(tiny_model_dir, weights, torch.bfloat16)
    low_err, bf16_err = [], []
    for req in reqs:
        tokens, logits = tokens_of(outs[req.request_id]), torch.stack(sched.backend.logits[req.request_id][:6])
        assert len(tokens) == 6
        ref = reference_logits(dense_model, req.prompt_token_ids, tokens)
        low_err += ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
        rounded = reference_logits(bf16_model, req.prompt_token_ids, tokens).float()
        bf16_err += ((rounded - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
        assert not torch.equal(logits, ref)
    assert max(low_err) < 0.25 and np.mean(low_err) < 1.5 * np.mean(bf16_err), (low_err, bf16_err)


def test_quantization_resolves_per_model_and_device(tiny_llama, tmp_path):
    from engine_proc.lowbit_model import quantize_model, resolve_quantization
    from shared.config import EngineConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    gguf_file = tmp_path / "m.gguf"
    assert resolve_quantization("auto", cpu, gguf_file, True) == "gguf"
    assert resolve_quantization("auto", cpu, None, True) == "none"  # safetensors: as they are
    assert resolve_quantization("auto", cuda, gguf_file, True) == "none"
    assert resolve_quantization("int4", cpu, None, False) == "none"  # no lean runner for it
    assert resolve_quantization("int8", cpu, None, True) == "int8"
    assert any("unknown quantization 'int3'" in p for p in EngineConfig(quantization="int3").problems())
    int4 = quantize_model(tiny_llama, "int4")
    n_proj = 7 * TINY_LLAMA["num_hidden_layers"]
    assert int4.types == {"Q4_1": n_proj, "Q8_0": 1} and int4.kind == "int4"
    assert quantize_model(tiny_llama, "int8").types == {"Q8_0": n_proj + 1}


def test_two_engines_starting_at_once_pack_the_weights_once(tiny_gguf, tmp_path, monkeypatch):
    """The second waits on the entry's lock and loads the first's file (both used to pack)."""
    import threading
    import time as _time

    from engine_proc import lowbit_model

    model, path = tiny_gguf
    entry = tmp_path / "entry"
    entry.mkdir()
    real, calls = lowbit_model.read_gguf, []

    def slow_read(*args):
        calls.append(1)
        _time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(lowbit_model, "read_gguf", slow_read)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(lowbit_model.gguf_weights(entry, path, model.config)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2 and len(calls) == 1
    assert results[0].summary == results[1].summary == "Q4_0×8 Q4_1×6 Q8_0×1"
    assert (entry / lowbit_model.CACHE_FILE).exists()


def test_a_changed_kernel_has_its_crossover_measured_again(tiny_gguf, tiny_model_dir, tmp_path, monkeypatch):
    """The host's cached crossover is keyed on qmatmul.c's source digest: an engine with
    the same kernel reads the answer, one whose kernel changed measures it again."""
    from engine_proc import gguf_weights, kernels, lowbit_model
    from engine_proc.backends import linear

    monkeypatch.setenv("TICKSERVE_CACHE_DIR", str(tmp_path))
    model, path = tiny_gguf
    weights = gguf_weights.read(path, model.config)
    packed_model = lowbit_model.model_from_packed(tiny_model_dir, weights, torch.float32)
    setattr(packed_model, lowbit_model.LOW_BIT_ATTR, weights)
    measured = []
    monkeypatch.setattr(linear, "measure_crossover", lambda layer, dtype: measured.append(1) or 8 * len(measured))
    plans = []
    threads = torch.get_num_threads()  # part of the key too: a built backend may leave another count
    try:
        for digest in ("aaaa", "aaaa", "bbbb"):
            torch.set_num_threads(threads)
            monkeypatch.setattr(kernels, "source_digest", lambda d=digest: d)
            backend = make_scheduler(packed_model).backend
            assert backend.qmatmul.source_digest == digest
            plans.append(backend.runner.plan.quantized_below)
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 2 and plans == [8, 8, 16]
