"""runtime.model.cpu_features: the dtype `--dtype auto` picks from given CPU flag sets, also end to end through the
Engine with the flags replaced by $RADIXSERVE_CPU_FLAGS (so both decisions run on any host), and the facts a
benchmark records (issue 14)."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.config import ServerArgs
from runtime.engine import Engine
from runtime.model.cpu_features import (
    CPU_FLAGS_ENV,
    cpu_flags,
    has_native_bf16,
    machine_facts,
    resolve_dtype,
    usable_cores,
)
from runtime.sampling_params import SamplingParams

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}  # AVX-512 without its bfloat16 extension
AVX512_BF16 = AVX512 | {"avx512_bf16"}  # e.g. AMD Zen 4, Intel Cooper Lake
AMX_BF16 = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}  # e.g. Intel Sapphire Rapids (as a VM may report it)


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        (frozenset(), False),
        (AVX2_ONLY, False),
        (AVX512, False),
        (AVX512_BF16, True),
        (AMX_BF16, True),
        (AVX2_ONLY | {"amx_tile", "amx_int8"}, False),  # AMX without its bfloat16 unit
    ],
)
def test_has_native_bf16_reads_the_bf16_flags(flags, native):
    assert has_native_bf16(flags) is native


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (AVX2_ONLY, torch.float32),
        (AVX512, torch.float32),
        (frozenset(), torch.float32),
        (AVX512_BF16, torch.bfloat16),
        (AMX_BF16, torch.bfloat16),
    ],
)
def test_auto_on_cpu_is_bfloat16_only_with_native_bf16(flags, expected):
    assert resolve_dtype("auto", "cpu", flags) is expected
    assert resolve_dtype("auto", torch.device("cpu"), flags) is expected


@pytest.mark.parametrize("flags", [AVX2_ONLY, AVX512_BF16, frozenset()])
def test_auto_on_cuda_is_bfloat16_whatever_the_cpu(flags):
    assert resolve_dtype("auto", "cuda", flags) is torch.bfloat16
    assert resolve_dtype("auto", "cuda:1", flags) is torch.bfloat16


@pytest.mark.parametrize(
    ("name", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
@pytest.mark.parametrize("flags", [AVX2_ONLY, AMX_BF16])
def test_an_explicit_name_is_kept_on_every_cpu_and_device(name, expected, flags):
    assert resolve_dtype(name, "cpu", flags) is expected
    assert resolve_dtype(name, "cuda", flags) is expected


def test_an_unknown_name_raises_key_error():
    with pytest.raises(KeyError):
        resolve_dtype("int8", "cpu", AMX_BF16)


def test_server_args_default_to_auto_and_this_machine_follows_its_own_flags():
    assert ServerArgs().dtype == "auto"
    assert has_native_bf16() is has_native_bf16(cpu_flags())
    assert resolve_dtype("auto", "cpu") is (torch.bfloat16 if has_native_bf16(cpu_flags()) else torch.float32)


def _proc_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo's first processor, read here (empty where the file is missing)."""
    if not os.path.exists("/proc/cpuinfo"):
        return frozenset()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        lines = [line for line in f if line.startswith("flags")]
    return frozenset(lines[0].split(":", 1)[1].split()) if lines else frozenset()


def test_the_flags_env_replaces_the_cpus_flags_while_set(monkeypatch):
    monkeypatch.delenv(CPU_FLAGS_ENV, raising=False)
    assert cpu_flags() == _proc_flags()
    monkeypatch.setenv(CPU_FLAGS_ENV, " avx2  fma\tf16c ")
    assert cpu_flags() == {"avx2", "fma", "f16c"} and not has_native_bf16()
    assert resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setenv(CPU_FLAGS_ENV, " ".join(sorted(AVX512_BF16)))
    assert cpu_flags() == AVX512_BF16 and has_native_bf16()
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    assert machine_facts()["native_bf16"] is True
    monkeypatch.setenv(CPU_FLAGS_ENV, "")  # set but empty: a CPU without flags
    assert cpu_flags() == frozenset() and resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.delenv(CPU_FLAGS_ENV)
    assert cpu_flags() == _proc_flags()


@pytest.mark.parametrize(("flags", "dtype"), [(AVX2_ONLY, torch.float32), (AVX512_BF16, torch.bfloat16)])
def test_the_engine_resolves_auto_from_the_cpu_flags_end_to_end(tiny_llama_dir, monkeypatch, flags, dtype):
    # The Engine with --dtype auto on a CPU reporting `flags` runs the model, its KV and its host tier in `dtype`,
    # and generates what an Engine given that dtype by name generates.
    monkeypatch.setenv(CPU_FLAGS_ENV, " ".join(sorted(flags)))
    kw = {"num_blocks": 32, "block_size": 4, "num_host_blocks": 2}
    auto = Engine(model=str(tiny_llama_dir), dtype="auto", **kw)
    assert auto.args.dtype == "auto" and auto.runner.dtype is dtype
    runner = auto.runner
    assert runner.model.embed_weight.dtype is runner.k_cache.dtype is runner.host_v_cache.dtype is dtype
    named = Engine(model=str(tiny_llama_dir), dtype=str(dtype).removeprefix("torch."), **kw)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11, 3], [6, 1, 12]]
    got = [out.token_ids for out in auto.generate(input_ids=prompts, sampling_params=params)]
    want = [out.token_ids for out in named.generate(input_ids=prompts, sampling_params=params)]
    assert got == want and all(len(ids) == 8 for ids in got)


def test_machine_facts_name_what_a_benchmark_records():
    facts = machine_facts()
    assert set(facts) == {
        "cpu_model",
        "cpu_capability",
        "flags",
        "native_bf16",
        "cores",
        "load_average",
        "torch_threads",
        "torch",
    }
    assert facts["cores"] == usable_cores() >= 1
    if hasattr(os, "sched_getaffinity"):
        assert usable_cores() == len(os.sched_getaffinity(0))
    assert facts["native_bf16"] is has_native_bf16()
    assert set(facts["flags"]) <= cpu_flags()
    assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["torch"] == torch.__version__ and facts["torch_threads"] == torch.get_num_threads()
