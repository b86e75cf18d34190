"""Frequency, presence and repetition penalties: exact logits against a plain reference, greedy tokens against
transformers' generate, the worker's token state across steps and preemption, and requests without penalties
unchanged."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from runtime.engine import Engine
from runtime.model.penalties import PenaltyState
from runtime.model.sampler import Sampler, SampleRequest
from runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import record_batches

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out

CPU = torch.device("cpu")
# logits, counts and penalties that float32 holds exactly, so the reference below is exact too
LOGITS = [[2.0, -1.5, 0.0, 3.25, -0.5, 1.0], [-2.0, 4.0, 0.5, -3.0, 0.0, 1.25]]


def _reference(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    frequency: float = 0.0,
    presence: float = 0.0,
    repetition: float = 1.0,
) -> list[float]:
    """The penalties written out token by token (vLLM's order: repetition, then frequency and presence)."""
    counts = Counter(output)
    out = []
    for v, x in enumerate(logits):
        if v in counts or v in prompt:
            x = x / repetition if x > 0 else x * repetition
        out.append(x - frequency * counts[v] - presence * (counts[v] > 0))
    return out


def _penalised(rows: list[tuple[int, SamplingParams, list[int], list[int]]], logits: list[list[float]]):
    """PenaltyState with (seq_id, params, prompt, output) per row, applied to logits [len(rows), 6]."""
    state = PenaltyState(6, CPU)
    for seq_id, params, prompt, output in rows:
        state.add(seq_id, params, prompt, output)
    penalties = state.rows([seq_id for seq_id, *_ in rows])
    assert penalties is not None
    return penalties.apply(torch.tensor(logits)).tolist()


def test_frequency_and_presence_subtract_exactly_the_reference_on_a_known_count_vector():
    output = [3, 0, 3, 5, 3, 0]  # counts: token 0 twice, 3 three times, 5 once
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=-1.25)
    got = _penalised([(7, params, [1, 2], output), (8, SamplingParams(frequency_penalty=-2.0), [], [1, 1])], LOGITS)
    assert got[0] == _reference(LOGITS[0], [1, 2], output, frequency=0.5, presence=-1.25)
    assert got[0] == [2.0 - 1.0 + 1.25, -1.5, 0.0, 3.25 - 1.5 + 1.25, -0.5, 1.0 - 0.5 + 1.25]
    assert got[1] == [-2.0, 4.0 + 4.0, 0.5, -3.0, 0.0, 1.25]  # the prompt plays no part in these two


def test_repetition_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    params = SamplingParams(repetition_penalty=2.0)
    got = _penalised([(1, params, [0, 1, 2], [4, 4]), (2, SamplingParams(repetition_penalty=0.5), [3], [1])], LOGITS)
    assert got[0] == [1.0, -3.0, 0.0, 3.25, -1.0, 1.0]  # 0, 1, 2 from the prompt, 4 from the output
    assert got[1] == [-2.0, 8.0, 0.5, -1.5, 0.0, 1.25]
    assert got == [
        _reference(LOGITS[0], [0, 1, 2], [4, 4], repetition=2.0),
        _reference(LOGITS[1], [3], [1], repetition=0.5),
    ]
    combined = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    assert _penalised([(3, combined, [0], [3, 3, 4])], LOGITS[:1])[0] == _reference(
        LOGITS[0], [0], [3, 3, 4], frequency=0.25, presence=0.5, repetition=2.0
    )


def test_rows_without_state_are_untouched_and_a_step_without_penalties_does_nothing():
    state = PenaltyState(6, CPU)
    assert state.rows([1, 2, 3]) is None and state.counts.shape == (0, 6)  # nothing allocated, nothing to apply
    state.add(2, SamplingParams(frequency_penalty=1.0), [], [0])
    logits = torch.tensor(LOGITS + LOGITS)
    penalised = state.rows([1, 2, 3, 4]).apply(logits)
    assert torch.equal(penalised[[0, 2, 3]], logits[[0, 2, 3]])
    assert penalised[1].tolist() == [-3.0, 4.0, 0.5, -3.0, 0.0, 1.25]
    assert logits.tolist() == LOGITS + LOGITS  # the raw logits are not changed (logprobs read them)


def test_state_counts_each_recorded_token_reuses_rows_and_grows():
    state = PenaltyState(6, CPU)
    params = SamplingParams(presence_penalty=1.0)
    for seq_id in range(10):  # past the first 8 rows: the tensors double, rows keep their counts
        state.add(seq_id, params, [], [seq_id % 6])
    state.record([3, 99, 9], [5, 1, 0])  # seq 99 has no state: skipped
    assert state.counts.shape == (16, 6) and len(state) == 10
    assert state.counts[state._rows[3]].tolist() == [0, 0, 0, 1, 0, 1]
    assert state.counts[state._rows[9]].tolist() == [1, 0, 0, 1, 0, 0]
    state.remove(3)
    state.add(42, SamplingParams(repetition_penalty=2.0), [4, 4], [])  # reuses seq 3's row, cleared
    assert 3 not in state and state.counts[state._rows[42]].tolist() == [0] * 6
    assert state.prompt_mask[state._rows[42]].tolist() == [False] * 4 + [True, False]


def test_greedy_takes_the_penalised_argmax_and_logprobs_stay_those_of_the_raw_logits():
    logits = torch.tensor(LOGITS)
    state = PenaltyState(6, CPU)
    state.add(1, SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=2), [3], [])
    rows = [SampleRequest(SamplingParams(temperature=0.0, logprobs=2), 0, 0), SampleRequest(SamplingParams(), 0, 0)]
    out = Sampler(0)(logits, rows, state.rows([1, 2]))
    assert out.token_ids[0] == 0  # 3.25 / 4 < 2.0: token 3 loses to token 0
    raw = torch.log_softmax(logits[0], dim=-1)
    # the sampler's log-softmax runs over a batch of rows, this one over one row: equal to float32 rounding
    assert out.logprobs[0].logprob == pytest.approx(float(raw[0]), rel=1e-6)
    assert out.logprobs[0].top_token_ids == [3, 0]
    assert out.logprobs[0].top_logprobs == pytest.approx(raw[[3, 0]].tolist(), rel=1e-6)


# ---------------------------------------------------------------------------------------------- the real model
class _FrequencyPresence(LogitsProcessor):
    """Reference frequency / presence penalties for transformers' generate, counted from its input_ids."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len = prompt_len
        self.frequency = frequency
        self.presence = presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for token, count in Counter(input_ids[0, self.prompt_len :].tolist()).items():
            scores[0, token] -= self.frequency * count + self.presence
        return scores


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir, chat_prompt_ids):
    """An Engine on the tiny Llama (float32; prompts prefilled in chunks of 16) and the greedy completions of the
    first 3 chat prompts without penalties."""
    engine = Engine(model=str(tiny_llama_dir), num_blocks=64, block_size=8, chunked_prefill_size=16, dtype="float32")
    plain = engine.generate(
        input_ids=chat_prompt_ids[:3], sampling_params=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    return engine, [o.token_ids for o in plain]


def _hf_generate(hf, prompt: list[int], new_tokens: int, **kw) -> tuple[list[int], torch.Tensor]:
    """One unpadded prompt (a pad token would count as seen): the new ids and the processed scores per step."""
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        min_new_tokens=0,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kw,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.scores, dim=1)[0].float()


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.5},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"repetition_penalty": 0.7, "frequency_penalty": 2.0, "presence_penalty": -2.0},
    ],
)
def test_greedy_tokens_match_transformers_generate(tiny_engine, tiny_hf, chat_prompt_ids, hf_greedy, penalties):
    """repetition_penalty against transformers' own processor; frequency / presence against _FrequencyPresence
    (transformers runs it after its repetition processor: vLLM's order)."""
    _, assert_same = hf_greedy
    engine, plain = tiny_engine
    prompts = chat_prompt_ids[:3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **penalties)
    mine = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert mine != plain  # the penalties change these completions
    for prompt, out in zip(prompts, mine, strict=True):
        kw = {"repetition_penalty": penalties.get("repetition_penalty", 1.0)}
        if "frequency_penalty" in penalties:
            kw["logits_processor"] = LogitsProcessorList(
                [_FrequencyPresence(len(prompt), penalties["frequency_penalty"], penalties["presence_penalty"])]
            )
        ref, scores = _hf_generate(tiny_hf, prompt, 24, **kw)
        assert_same(out, ref, scores)


# ---------------------------------------------------------------------------------------------- the worker's state
PROMPTS = [[3000 + 11 * i for i in range(24)] + [100 + 13 * k + j for j in range(3 + k)] for k in range(4)]


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=12, ignore_eos=True, **kw)


PENALISED = [
    _params(temperature=0.0, repetition_penalty=0.5, frequency_penalty=-1.0),
    _params(temperature=0.8, top_p=0.9, seed=7, presence_penalty=-2.0),
    _params(temperature=1.0, seed=11, n=2, repetition_penalty=0.3, frequency_penalty=-2.0),
    _params(temperature=0.0),
]
# The tokens the code before penalties existed gave these prompts without penalties (the same on every engine below)
UNPENALISED = [
    _params(temperature=0.0),
    _params(temperature=0.8, top_p=0.9, seed=7),
    _params(temperature=1.0, top_k=20, seed=3),
    _params(temperature=0.0),
]
BEFORE = [
    [12175, 23679, 22720, 40570, 784, 4651, 2044, 27411, 42140, 8749, 22875, 2387],
    [19534, 24610, 38088, 13821, 10876, 6826, 3862, 46206, 47895, 12831, 38117, 35006],
    [45377, 44533, 35365, 37986, 35629, 13960, 38603, 39187, 44585, 11676, 34308, 22187],
    [30765, 26209, 38645, 14943, 7869, 10671, 4980, 16819, 41546, 5533, 45653, 319],
]


@pytest.fixture(scope="module")
def make_engine(tiny_llama_dir):
    def make(**kw) -> Engine:
        kw.setdefault("num_blocks", 128)
        # float32: the tokens are compared exactly (BEFORE, and with the unpressured run)
        return Engine(model=str(tiny_llama_dir), block_size=4, dtype="float32", **kw)

    return make


def _tokens(engine: Engine, params: list[SamplingParams]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)]


@pytest.fixture(scope="module")
def unpressured(make_engine):
    return _tokens(make_engine(enable_prefix_caching=False), PENALISED)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_penalties_survive_preemption(make_engine, unpressured, mode):
    engine = make_engine(num_blocks=18, preemption_mode=mode, num_host_blocks=64 if mode == "swap" else 0)
    assert _tokens(engine, PENALISED) == unpressured
    stats = engine.stats()
    assert stats.num_preemptions >= 2 and (mode == "recompute" or stats.num_swaps >= 2)
    engine.step()  # delivers the drop of the last sequence to finish
    assert engine.runner.seqs == {} and len(engine.runner.penalties) == 0  # each state left with its sequence


def test_penalised_tokens_differ_from_unpenalised(make_engine, unpressured):
    plain = _tokens(
        make_engine(), [_params(temperature=p.temperature, top_p=p.top_p, seed=p.seed, n=p.n) for p in PENALISED]
    )
    assert [a != b for a, b in zip(unpressured, plain, strict=True)] == [True, True, True, False]


def test_requests_without_penalties_get_the_tokens_they_got_before(make_engine):
    engine = make_engine()
    assert _tokens(engine, UNPENALISED) == [[t] for t in BEFORE]
    assert engine.runner.penalties.counts.shape[0] == 0  # no penalty state was ever allocated
    mixed = _tokens(engine, [UNPENALISED[0], PENALISED[1], UNPENALISED[2], PENALISED[0]])
    assert (mixed[0], mixed[2]) == ([BEFORE[0]], [BEFORE[2]])  # penalised neighbours change nothing for them


def test_penalty_tokens_are_sent_once_per_registration(make_engine):
    # one token a step (num_scheduler_steps 1): the preemptions it counts come at every token's allocation
    engine = make_engine(num_blocks=18, preemption_mode="recompute", num_scheduler_steps=1)
    batches = record_batches(engine)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PENALISED)
    sent = [s for b in batches for s in b.seqs if s.penalty_token_ids is not None]
    registrations = [s for b in batches for s in b.seqs if s.sampling_params is not None]
    assert sent == [s for s in registrations if s.sampling_params.has_penalties]
    assert engine.stats().num_preemptions >= 2
    completions = [c.token_ids for o in outs for c in o.outputs]
    resumed = 0
    for s in sent:  # prompt + output so far with repetition_penalty on, else the output so far
        ids = s.penalty_token_ids
        params = s.sampling_params
        assert ids is not None and params is not None
        if params.repetition_penalty != 1.0:
            assert ids[: s.prompt_len] == next(p for p in PROMPTS if len(p) == s.prompt_len)
            ids = ids[s.prompt_len :]
        assert any(c[: len(ids)] == ids for c in completions)
        resumed += bool(ids)
    assert resumed >= 2  # the preempted sequences came back with their output so far
