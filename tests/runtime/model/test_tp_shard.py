"""Shard loading for tensor parallelism (runtime/model/parallel/shard.py): each rank's tensors are exactly the
matching slices of the full checkpoint (column-parallel q/k/v and gate/up, row-parallel o/down, vocab-parallel
embedding and head, KV heads replicated past their count, Phi-3's fused projections, every expert's part of its
width in both MoE checkpoint layouts), the refusals name their
cause, and a rank's peak memory is its share, not the whole file (measured in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radix.blocks import cdiv
from runtime.model.errors import UnsupportedModelError
from runtime.model.loader import load_config, load_weights
from runtime.model.parallel.shard import ShardPlan, load_shard
from tests.paths import ROOT
from tests.runtime.model.tiny_families import save_tiny_family
from tests.runtime.model.tiny_moe import MOE_FAMILIES, NUM_EXPERTS, save_tiny_moe, tiny_moe_config

ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3", "phi3"])
def folder(request, tiny_llama_dir, tmp_path_factory, smollm2_tokenizer) -> Path:
    if request.param == "llama":
        return tiny_llama_dir
    return save_tiny_family(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)


def _shards(folder: Path, size: int) -> tuple[list[ShardPlan], list[dict[str, torch.Tensor]]]:
    cfg = load_config(folder)
    plans = [ShardPlan(cfg, rank, size) for rank in range(size)]
    return plans, [load_shard(folder, plan, torch.float32, "cpu") for plan in plans]


def _joined(parts: list[torch.Tensor], name: str) -> torch.Tensor:
    return torch.cat(parts, dim=1 if name.endswith(ROW_PARALLEL) else 0)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_the_slices_of_the_full_weights(folder, size):
    full = load_weights(folder, torch.float32)
    cfg = load_config(folder)
    plans, shards = _shards(folder, size)
    hk = cfg.num_key_value_heads
    d = cfg.head_dim
    assert all(set(s) == set(full) for s in shards)
    for name, whole in full.items():
        parts = [s[name] for s in shards]
        if plans[0].pieces(name) is None:  # norms: replicated
            assert all(torch.equal(p, whole) for p in parts), name
        elif "embed_tokens" in name or name == "lm_head.weight":
            rows = cdiv(cfg.vocab_size, size)
            assert all(p.shape == (rows, cfg.hidden_size) for p in parts)
            assert torch.equal(torch.cat(parts)[: cfg.vocab_size], whole)
            assert not torch.cat(parts)[cfg.vocab_size :].any()  # the padding rows are zeros
        elif (".k_proj" in name or ".v_proj" in name) and size > hk:  # each KV head on size / hk ranks
            for rank, p in enumerate(parts):
                head = rank // (size // hk)
                assert torch.equal(p, whole[head * d : (head + 1) * d]), (name, rank)
        elif "qkv_proj" in name:
            _check_fused_qkv(cfg, parts, whole, size)
        elif "gate_up_proj" in name:
            inter = cfg.intermediate_size // size
            gates = [p[:inter] for p in parts]
            ups = [p[inter:] for p in parts]
            assert torch.equal(torch.cat(gates + ups), whole)
        else:
            assert torch.equal(_joined(parts, name), whole), name


def _check_fused_qkv(cfg, parts, whole, size) -> None:
    """Phi-3's qkv_proj: each rank's q, k and v rows are the slices of the full q, k and v rows."""
    d = cfg.head_dim
    heads = cfg.num_key_value_heads
    q_full, k_full, v_full = whole.split([cfg.num_attention_heads * d, heads * d, heads * d])
    kv_rows = max(1, heads // size) * d
    splits = [p.split([q_full.shape[0] // size, kv_rows, kv_rows]) for p in parts]
    assert torch.equal(torch.cat([s[0] for s in splits]), q_full)
    for i, rows in ((1, k_full), (2, v_full)):
        if size <= heads:
            assert torch.equal(torch.cat([s[i] for s in splits]), rows)
            continue
        for rank, s in enumerate(splits):
            head = rank // (size // heads)
            assert torch.equal(s[i], rows[head * d : (head + 1) * d])


def test_local_config_has_the_rank_share_of_heads_and_intermediate(tiny_llama_dir):
    cfg = load_config(tiny_llama_dir)  # 4 q heads, 2 KV heads, intermediate 128
    plans = [ShardPlan(cfg, rank, 4) for rank in range(4)]
    assert [(p.q_head, p.kv_head) for p in plans] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    local = plans[3].local_config
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (1, 1, 32)
    assert (local.head_dim, local.hidden_size, local.vocab_size) == (cfg.head_dim, cfg.hidden_size, cfg.vocab_size)


def test_refusals_name_their_cause(tiny_llama_dir, tmp_path):
    cfg = load_config(tiny_llama_dir)
    with pytest.raises(UnsupportedModelError, match=r"tensor_parallel_size 3 does not divide num_attention_heads 4"):
        ShardPlan(cfg, 0, 3)
    tiny_moe_config("qwen3_moe", moe_intermediate_size=33).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"size 2 does not divide the experts' intermediate size 33"):
        ShardPlan(load_config(tmp_path), 0, 2)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_rank_holds_its_part_of_every_expert_and_the_whole_router(family, tmp_path, smollm2_tokenizer):
    folder = save_tiny_moe(family, tmp_path, smollm2_tokenizer)  # the per-expert layout
    full = load_weights(folder, torch.float32)
    cfg = load_config(folder)
    assert cfg.moe is not None
    plans, shards = _shards(folder, 2)
    width = cfg.moe.expert_intermediate_size // 2
    assert [p.local_config.moe.expert_intermediate_size for p in plans] == [width, width]
    sparse = sum(cfg.moe.is_sparse(i) for i in range(cfg.num_hidden_layers))
    experts = [n for n in full if ".experts." in n]
    assert len(experts) == sparse * NUM_EXPERTS * 3
    for name in experts:
        dim = 1 if name.endswith(("down_proj.weight", "w2.weight")) else 0
        for rank, shard in enumerate(shards):
            assert torch.equal(shard[name], full[name].narrow(dim, rank * width, width)), (name, rank)
    routers = [n for n in full if n.endswith(".gate.weight")]
    assert len(routers) == sparse
    assert all(torch.equal(shard[n], full[n]) for shard in shards for n in routers)
    assert all(set(s) == set(full) for s in shards)


def test_fused_expert_tensors_are_sliced_per_expert(tmp_path, smollm2_tokenizer):
    """transformers 5.x's in-memory layout: experts.gate_up_proj [E, 2 * width, hidden] (gate rows first) and
    experts.down_proj [E, hidden, width]; each rank's are the per-expert slices, gate and up parts each split."""
    per_expert = save_tiny_moe("qwen3_moe", tmp_path / "per_expert", smollm2_tokenizer)
    full = load_weights(per_expert, torch.float32)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((per_expert / "config.json").read_text())
    fused = {n: t for n, t in full.items() if ".experts." not in n}
    for layer in (0, 2):  # the sparse layers (layer 1 is dense)
        base = f"model.layers.{layer}.mlp.experts"
        gate = torch.stack([full[f"{base}.{e}.gate_proj.weight"] for e in range(NUM_EXPERTS)])
        up = torch.stack([full[f"{base}.{e}.up_proj.weight"] for e in range(NUM_EXPERTS)])
        fused[f"{base}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"{base}.down_proj"] = torch.stack([full[f"{base}.{e}.down_proj.weight"] for e in range(NUM_EXPERTS)])
    save_file(fused, str(fused_dir / "model.safetensors"))
    _, shards = _shards(fused_dir, 2)
    width = 16  # moe_intermediate_size 32 over 2 ranks
    for layer in (0, 2):
        base = f"model.layers.{layer}.mlp.experts"
        whole = fused[f"{base}.gate_up_proj"]
        for rank, shard in enumerate(shards):
            cols = slice(rank * width, (rank + 1) * width)
            gate_up = shard[f"{base}.gate_up_proj"]
            assert gate_up.shape == (NUM_EXPERTS, 2 * width, 64)
            assert torch.equal(gate_up[:, :width], whole[:, :32][:, cols])
            assert torch.equal(gate_up[:, width:], whole[:, 32:][:, cols])
            assert torch.equal(shard[f"{base}.down_proj"], fused[f"{base}.down_proj"][:, :, cols])


_PEAK = """
import sys, torch
from pathlib import Path
from runtime.model.loader import load_config, load_weights
from runtime.model.parallel.shard import ShardPlan, load_shard

def status(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1])

folder = Path(sys.argv[1])
cfg = load_config(folder)
open("/proc/self/clear_refs", "w").write("5")  # Linux: VmHWM (the peak RSS) restarts from the current RSS
before = status("VmRSS")
if sys.argv[2] == "full":
    w = load_weights(folder, torch.float32)
else:
    w = load_shard(folder, ShardPlan(cfg, int(sys.argv[2]), 2), torch.float32, "cpu")
total = sum(float(t.sum()) for t in w.values())  # every tensor read, as building the model reads it
sizes = [t.numel() * t.element_size() // 1024 for t in w.values()]
print(status("VmHWM") - before, sum(sizes), max(sizes))
"""


def _peak_kib(folder: Path, which: str) -> list[int]:
    """[peak RSS growth while loading and reading the tensors, their total size, the largest one's], KiB."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(folder), which], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(x) for x in out.stdout.split()[-3:]]


def _wide_llama(folder: Path) -> Path:
    """A 1-layer Llama of hidden 512 whose 49152-row embedding and head are 96 MiB each in float32 (random weights
    written directly: the load is measured, not the numbers)."""
    hidden, inter, vocab = 512, 1024, 49152
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    p = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (hidden, hidden),
        p + "self_attn.k_proj.weight": (hidden // 2, hidden),
        p + "self_attn.v_proj.weight": (hidden // 2, hidden),
        p + "self_attn.o_proj.weight": (hidden, hidden),
        p + "mlp.gate_proj.weight": (inter, hidden),
        p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
    }
    save_file({n: torch.randn(s) for n, s in shapes.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.slow
def test_a_rank_peak_memory_is_its_share_not_the_whole_file(tmp_path):
    folder = _wide_llama(tmp_path)
    file_kib = (folder / "model.safetensors").stat().st_size // 1024
    full = _peak_kib(folder, "full")
    ranks = [_peak_kib(folder, str(rank)) for rank in range(2)]
    print(f"file {file_kib} KiB; peak RSS growth: full load {full[0]} KiB, ranks {[r[0] for r in ranks]} KiB")
    assert full[0] >= file_kib  # the whole checkpoint was resident at once
    for peak, share, largest in ranks:
        assert share < 0.51 * file_kib
        # its share, plus one slice twice (the copy and the file pages it came from), plus allocator slack
        assert peak < min(share + 2 * largest + 8192, file_kib)
