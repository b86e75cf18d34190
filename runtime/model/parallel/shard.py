"""ShardPlan: which slice of each checkpoint tensor one tensor-parallel rank holds, and load_shard, which reads only
those slices from the safetensors files (safe_open(...).get_slice), never a whole tensor a rank does not keep whole.

Megatron-LM's split of a decoder layer (Shoeybi et al. 2019, "Megatron-LM", section 3, figure 3): the q/k/v and the
gate/up projections are column-parallel (each rank keeps the output rows of its heads / its part of the intermediate
size), o_proj and down_proj are row-parallel (the matching input columns; their partial outputs are summed across
ranks), so a layer needs two all-reduces. The embedding and the head are vocab-parallel (each rank keeps cdiv(V, N)
rows, the last one padded with zero rows). KV heads are split like q heads; where N exceeds their count each KV head
is replicated on N / num_kv_heads consecutive ranks (vLLM's rule), and each rank keeps the q heads that read it.
Norms (and q/k norms, per head_dim) are replicated.

Mixture-of-experts layers (Qwen3-MoE, Mixtral) are split as vLLM does by default: every rank holds all experts, each
expert's gate/up rows and down columns of its part of the expert width (the dense MLP's split, per expert), the
router replicated; the block's partial outputs are summed by one all-reduce per layer (layers.py), not one per expert.
Per-expert tensors (experts.E.gate_proj / w1 ...) and the fused 3-D ones (experts.gate_up_proj [E, 2 * width,
hidden], experts.down_proj [E, hidden, width]) are both sliced as they are read.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import NamedTuple

import torch

from radix.blocks import cdiv
from runtime.model.errors import CorruptModelError, UnsupportedModelError
from runtime.model.hf_config import ModelConfig
from runtime.model.loader import safetensors_files

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
_LAYER = r"model\.layers\.\d+\."


_EXPERT_COLUMN = r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$"
_EXPERT_ROW = r"\.experts\.\d+\.(down_proj|w2)\.weight$"


class Piece(NamedTuple):
    """Indices [start, stop) along dimension dim of a tensor (rows 0, columns 1, or 2 for the fused 3-D experts);
    a rank's slice is one piece or several, concatenated along dim (a fused q/k/v or gate/up tensor)."""

    dim: int
    start: int
    stop: int


class ShardPlan:
    """Rank `rank` of `size`'s share of a model of config cfg (see the module docstring).

    Public: local_config (cfg with this rank's q heads, KV heads, intermediate size and experts' width: the model
    and the KV pool are built from it), vocab_start / vocab_stop (this rank's embedding rows, before padding),
    vocab_rows (cdiv(V, size): every rank's padded row count), q_heads (this rank's first q head and count),
    kv_head (its first KV head).

    Raises UnsupportedModelError (heads, the dense intermediate size or the experts' width not divisible by size;
    KV heads that neither divide size nor are divided by it).
    """

    def __init__(self, cfg: ModelConfig, rank: int, size: int) -> None:
        hq = cfg.num_attention_heads
        hk = cfg.num_key_value_heads
        problems = []
        if hq % size:
            problems.append(f"num_attention_heads {hq}")
        if hk % size and size % hk:
            problems.append(f"num_key_value_heads {hk} (neither divides the other)")
        moe = cfg.moe
        dense_layers = moe is None or not all(moe.is_sparse(i) for i in range(cfg.num_hidden_layers))
        if dense_layers and cfg.intermediate_size % size:
            problems.append(f"intermediate_size {cfg.intermediate_size}")
        if moe is not None and moe.expert_intermediate_size % size:
            problems.append(f"the experts' intermediate size {moe.expert_intermediate_size}")
        if problems:
            raise UnsupportedModelError(f"tensor_parallel_size {size} does not divide {', '.join(problems)}")
        self.rank = rank
        self.size = size
        self.cfg = cfg
        self.num_q_heads = hq // size
        self.q_head = rank * self.num_q_heads
        self.num_kv_heads = max(1, hk // size)
        self.kv_head = rank * self.num_kv_heads if hk >= size else rank // (size // hk)
        self.inter = cfg.intermediate_size // size if dense_layers else cfg.intermediate_size
        self.expert_inter = moe.expert_intermediate_size // size if moe is not None else 0
        self.vocab_rows = cdiv(cfg.vocab_size, size)
        self.vocab_start = rank * self.vocab_rows
        self.vocab_stop = min(cfg.vocab_size, self.vocab_start + self.vocab_rows)
        self.local_config = dataclasses.replace(
            cfg,
            num_attention_heads=self.num_q_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.inter,
            moe=dataclasses.replace(moe, expert_intermediate_size=self.expert_inter) if moe is not None else None,
        )

    def pieces(self, name: str) -> list[Piece] | None:
        """This rank's pieces of tensor `name` (Hugging Face names), None when it is replicated whole."""
        d = self.cfg.head_dim
        q = Piece(0, self.q_head * d, (self.q_head + self.num_q_heads) * d)
        kv = Piece(0, self.kv_head * d, (self.kv_head + self.num_kv_heads) * d)
        inter = Piece(0, self.rank * self.inter, (self.rank + 1) * self.inter)
        if name in VOCAB_TENSORS:
            return [Piece(0, self.vocab_start, self.vocab_stop)]
        if not re.match(_LAYER, name):
            return None
        if re.search(r"\.self_attn\.q_proj\.(weight|bias)$", name):
            return [q]
        if re.search(r"\.self_attn\.[kv]_proj\.(weight|bias)$", name):
            return [kv]
        if name.endswith(".self_attn.qkv_proj.weight") or name.endswith(".self_attn.qkv_proj.bias"):
            k_at = self.cfg.num_attention_heads * d
            v_at = k_at + self.cfg.num_key_value_heads * d
            return [
                q,
                kv._replace(start=kv.start + k_at, stop=kv.stop + k_at),
                kv._replace(start=kv.start + v_at, stop=kv.stop + v_at),
            ]
        if name.endswith(".self_attn.o_proj.weight"):
            return [q._replace(dim=1)]
        if re.search(r"\.mlp\.(gate|up)_proj\.weight$", name):
            return [inter]
        if name.endswith(".mlp.gate_up_proj.weight"):
            size = self.cfg.intermediate_size
            return [inter, inter._replace(start=inter.start + size, stop=inter.stop + size)]
        if name.endswith(".mlp.down_proj.weight"):
            return [inter._replace(dim=1)]
        expert = self._expert_pieces(name)
        if expert is not None:
            return expert
        if re.search(r"\.(o_proj|down_proj)\.bias$", name):
            raise UnsupportedModelError(f"{name}: a row-parallel projection with a bias is not sharded")
        return None

    def _expert_pieces(self, name: str) -> list[Piece] | None:
        """This rank's pieces of an expert tensor (per-expert or fused 3-D), None for any other tensor."""
        width = self.expert_inter
        cols = Piece(0, self.rank * width, (self.rank + 1) * width)
        if re.search(_EXPERT_COLUMN, name):
            return [cols]
        if re.search(_EXPERT_ROW, name):
            return [cols._replace(dim=1)]
        if self.cfg.moe is not None and name.endswith(".experts.gate_up_proj"):
            full = self.cfg.moe.expert_intermediate_size
            return [cols._replace(dim=1), Piece(1, cols.start + full, cols.stop + full)]
        if name.endswith(".experts.down_proj"):
            return [cols._replace(dim=2)]
        return None

    def take(self, name: str, sl) -> torch.Tensor:
        """This rank's slice of tensor `name` read from sl (a safetensors PySafeSlice: only the slice is read), the
        vocabulary tensors padded with zero rows to vocab_rows."""
        pieces = self.pieces(name)
        if pieces is None:
            return sl[:]
        parts = [sl[(slice(None),) * p.dim + (slice(p.start, p.stop),)] for p in pieces]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0].dim)
        if name in VOCAB_TENSORS and t.shape[0] < self.vocab_rows:
            t = torch.cat([t, t.new_zeros(self.vocab_rows - t.shape[0], *t.shape[1:])])
        return t


def load_shard(
    folder: Path, plan: ShardPlan, dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """This rank's tensors of the folder's safetensors files (ShardPlan.take of each), cast to dtype, on device,
    keyed by their Hugging Face names. Peak memory: the rank's share, plus one slice twice (its copy, and the file
    pages it was read from, mapped until the file is closed after each tensor).

    Raises ModelNotFoundError (no weight file), CorruptModelError (a file cannot be read as safetensors).
    """
    from safetensors import SafetensorError, safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
            for name in names:
                # opened per tensor: the file's pages a slice touched leave the process with the mapping
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    weights[name] = plan.take(name, f.get_slice(name)).to(device=device, dtype=dtype)
        except (SafetensorError, OSError, ValueError) as e:
            raise CorruptModelError(f"{path} cannot be read as safetensors: {e}") from e
    return weights
