"""bfloat16 against float32 on the embedded SmolLM2-135M (issue 14): teacher-forced top-1 agreement on a few hundred
positions of readable chat text, judged against transformers' own bfloat16 forward of the same text on this machine
(tests/runtime/model/agreement.py states the rules), never against a constant tuned on one CPU.

Our bfloat16 may flip float32's argmax only at near-ties (rule 1: where float32's top-2 gap is below the largest
top-2 shift transformers' bfloat16 shows on this text) and no more often than transformers' bfloat16 plus chance
(rule 2). bfloat16 cannot reach float32's argmax everywhere: only keeping every matmul in float32 would, which gives
up what bfloat16 is for (the README's accuracy paragraph has the figures).

Both runners read the same text, so each position's argmax is compared on the same context (teacher forcing: no
divergence carries over). Two paths are measured, as the server runs them: prefill (every position of each whole
conversation in one forward, KV written to bfloat16 blocks) and decode (the assistant replies fed one token per step
to all conversations at once, so attention reads the blocks the earlier steps wrote). The figures are printed and
attached to the test report (record_property: junit XML and `-rA`).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.chat.workload import BACKGROUND, QUESTIONS, SYSTEM_BRIEF
from radix.blocks import cdiv
from runtime.config import ServerArgs
from runtime.model.models import AttentionMetadata
from runtime.model.runner import ModelRunner
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.sampling_params import SamplingParams
from tests.runtime.model.agreement import (
    Agreement,
    assert_flip_count,
    assert_flips_at_near_ties,
    compare,
    describe,
    transformers_logits,
)
from tests.runtime.model.step_logits import step_logits

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)

# (system brief lines, background line, question, the assistant's answer): the answers follow the brief.
CONVERSATIONS = [
    (
        slice(0, 4),
        0,
        0,
        "On Saturday the library opens at ten in the morning and closes at five in the afternoon. "
        "It is closed on Sunday, so Saturday is the day to come if you cannot make it in the week.",
    ),
    (
        slice(4, 6),
        2,
        1,
        "Yes, you can renew each item twice online, for three weeks each time. If the website "
        "asks you to sign in again, a librarian at the front desk can renew the books for you.",
    ),
    (
        slice(5, 9),
        10,
        2,
        "Late films cost fifty cents a day, so three days late comes to one dollar and fifty "
        "cents. The fine stops growing at five dollars per item.",
    ),
    (
        slice(6, 10),
        4,
        3,
        "The reading room on the second floor is a quiet zone and is open all afternoon. You can "
        "also book a study room for two hours a day through the website.",
    ),
    (
        slice(9, 12),
        12,
        6,
        "Printing in colour costs fifty cents a page, so ten pages cost five dollars. Black and "
        "white pages are cheaper, at fifteen cents each.",
    ),
    (
        slice(11, 16),
        16,
        7,
        "A lost card is replaced for two dollars at the front desk. Please bring a photo "
        "identity document with you, and we will print the new card while you wait.",
    ),
]


def _token_ids(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids up to the assistant's turn, whole conversation ids) of each conversation (SmolLM2 template)."""
    out = []
    for brief, background, question, answer in CONVERSATIONS:
        messages = [
            {"role": "system", "content": " ".join(SYSTEM_BRIEF[brief])},
            {"role": "user", "content": f"{BACKGROUND[background]} {QUESTIONS[question]}"},
        ]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        whole = list(tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}])["input_ids"])
        assert whole[: len(prompt)] == prompt
        out.append((prompt, whole))
    return out


def _tables(convs: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    """Contiguous block tables (from block 1) holding each whole conversation."""
    tables: list[list[int]] = []
    first = 1
    for _, whole in convs:
        n = cdiv(len(whole), BLOCK_SIZE)
        tables.append(list(range(first, first + n)))
        first += n
    return tables


@torch.inference_mode()
def _prefill_every_position(runner: ModelRunner, ids: list[int], table: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one whole-sequence prefill (logits_indices None: every row)."""
    n = len(ids)
    positions = torch.arange(n)
    blocks = torch.tensor(table, dtype=torch.int64)
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
        block_tables=torch.tensor([table], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
    )
    return runner.model(torch.tensor(ids), meta, runner.k_cache, runner.v_cache).float()


def _teacher_forced_decode(runner: ModelRunner, convs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """float32 logits [sum of reply lengths, vocab]: each prompt prefilled (the logits of its last token), then the
    reply's tokens fed one per step to every conversation at once, in conversation order within each step."""
    tables = _tables(convs)
    first = step_logits(
        runner,
        ForwardBatch(0, [ScheduledSeq(i, p, 0, tables[i], True, GREEDY, len(p)) for i, (p, _) in enumerate(convs)]),
    )
    rows: list[list[torch.Tensor]] = [[first.logits[i].float()] for i in range(len(convs))]
    step = 1
    while True:
        live = [i for i, (p, w) in enumerate(convs) if len(p) + step < len(w)]
        if not live:
            break
        seqs = [
            ScheduledSeq(i, [convs[i][1][len(convs[i][0]) + step - 1]], len(convs[i][0]) + step - 1, [], True)
            for i in live
        ]
        out = step_logits(runner, ForwardBatch(step, seqs))
        for j, i in enumerate(live):
            rows[i].append(out.logits[j].float())
        step += 1
    runner.execute(ForwardBatch(step, [], drop_seq_ids=list(range(len(convs)))))
    return torch.stack([r for per_conv in rows for r in per_conv])


def _reply_rows(convs: list[tuple[list[int], list[int]]]) -> list[int]:
    """Rows of the prefill path's logits that the decode path computes too (each reply's positions, in order)."""
    rows: list[int] = []
    offset = 0
    for prompt, whole in convs:
        rows.extend(range(offset + len(prompt) - 1, offset + len(whole) - 1))
        offset += len(whole)
    return rows


@pytest.fixture(scope="module")
def measured(smollm2_tokenizer) -> dict[str, Agreement]:
    """ "prefill" / "decode": our bfloat16 against float32 on that path; "hf prefill" / "hf decode": transformers'
    bfloat16 against our float32 on the same rows; "float32 decode vs prefill": the float32 decode path against the
    float32 prefill path's rows of the same positions (the guard of the teacher forcing)."""
    convs = _token_ids(smollm2_tokenizer)
    tables = _tables(convs)
    logits: dict[str, dict[str, torch.Tensor]] = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(
            ServerArgs(
                model="smollm2",
                dtype=dtype,
                quantization="none",
                block_size=BLOCK_SIZE,
                num_blocks=1 + sum(len(t) for t in tables),
            )
        )
        assert runner.k_cache.dtype == getattr(torch, dtype)
        prefill = [_prefill_every_position(runner, w, t) for (_, w), t in zip(convs, tables, strict=True)]
        logits[dtype] = {"prefill": torch.cat(prefill), "decode": _teacher_forced_decode(runner, convs)}
        del runner
    ref = logits["float32"]
    low = logits["bfloat16"]
    hf = torch.cat(transformers_logits([w for _, w in convs], torch.bfloat16))
    return {
        "prefill": compare(ref["prefill"], low["prefill"]),
        "decode": compare(ref["decode"], low["decode"]),
        "hf prefill": compare(ref["prefill"], hf),
        "hf decode": compare(ref["decode"], hf[_reply_rows(convs)]),
        "float32 decode vs prefill": compare(ref["prefill"][_reply_rows(convs)], ref["decode"]),
    }


def _report(path: str, c: Agreement, record_property) -> None:
    """Prints the comparison of one path and attaches it to the test report."""
    record_property(f"bf16_{path}_positions", c.positions)
    record_property(f"bf16_{path}_top1_agreement", round(c.agreement, 4))
    record_property(f"bf16_{path}_max_abs_logit_diff", round(c.max_abs_diff, 4))
    record_property(f"bf16_{path}_max_top2_shift", round(c.max_pair_shift, 4))
    record_property(f"bf16_{path}_fp32_top2_gaps_where_argmax_differ", [round(g, 3) for g in c.flip_gaps])
    print(describe(f"bf16 vs fp32 {path}", c))


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_bf16_top1_agrees_with_float32(measured, path, record_property):
    c = measured[path]
    _report(path, c, record_property)
    hf = measured[f"hf {path}"]
    _report(f"hf_{path}", hf, record_property)
    assert c.positions >= (800 if path == "prefill" else 200)
    assert_flip_count(c, hf)


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_bf16_flips_only_float32_near_ties(measured, path):
    assert_flips_at_near_ties(measured[path], measured[f"hf {path}"])


def test_decode_rows_are_the_prefill_rows_of_the_replies_in_float32(measured):
    # Guards the teacher forcing: row j of the decode path is the prefill path's row of the same position, so in
    # float32 the two paths give the same argmax there, and logits equal to kernel rounding.
    c = measured["float32 decode vs prefill"]
    assert (c.positions, c.flips) == (measured["decode"].positions, 0)
    assert c.max_abs_diff <= 1e-3
