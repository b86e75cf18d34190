"""One text path: the Engine and the server (real processes) give identical text, token_ids, finish_reason and
logprobs for the same requests, streamed or not: EOS, a stop token id, a stop string that begins inside a token,
n > 1 and logprobs (runtime.text.completion_stream.CompletionStream's rule, on both sides).

The model is the tiny random Llama of tests/conftest.py with its EOS moved to an ordinary (not special) token that
greedy decoding of PROMPT produces, so the rule "an EOS id is kept in token_ids, never in the text" is visible (a
special EOS would vanish from the text anyway). Every run has its own cache_salt, so each is a cold prefill on both
sides and the logprobs of the four runs come from the same computation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.engine import Engine
from runtime.protocol import TokenText
from runtime.sampling_params import SamplingParams

PROMPT = [9000 + 17 * i for i in range(21)]
EOS_AT = 4  # the greedy token at this index becomes the EOS
# float32: the logprobs of separate runs (engine, server, the reference) are compared to 4 decimals
FLAGS = {
    "num_blocks": 1024,
    "block_size": 16,
    "max_prefill_tokens": 512,
    "chunked_prefill_size": 256,
    "dtype": "float32",
}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[int]:
    """Greedy completion tokens of PROMPT on the original tiny model (EOS ignored)."""
    engine = Engine(model=str(tiny_llama_dir), **FLAGS)
    out = engine.generate(
        input_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )[0]
    engine.shutdown()
    return out.token_ids


@pytest.fixture(scope="module")
def eos_id(reference, smollm2_tokenizer) -> int:
    tid = reference[EOS_AT]
    assert tid not in reference[:EOS_AT] and tid not in smollm2_tokenizer.all_special_ids
    assert smollm2_tokenizer.decode([tid]).strip()  # its text is visible, so hiding it is observable
    return tid


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path, eos_id: int, tmp_path_factory) -> Path:
    """The tiny Llama with eos_token_id = eos_id (config.json and generation_config.json)."""
    folder = tmp_path_factory.mktemp("tiny_llama_eos")
    for f in tiny_llama_dir.iterdir():
        if f.suffix == ".safetensors":
            (folder / f.name).symlink_to(f)
        else:
            shutil.copy(f, folder / f.name)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos_id
            path.write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    eng = Engine(model=str(model_dir), **FLAGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(model_dir: Path, server_factory, tmp_path_factory):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()] + ["--max-message-bytes", "65536"]
    srv = server_factory(str(model_dir), tmp_path_factory.mktemp("logs") / "text_path.log", *flags)
    yield srv
    srv.stop()


def _lp(logprobs):
    """Logprobs as comparable values: top ids exact, floats rounded (two processes may sum in another order)."""
    if logprobs is None:
        return None
    return [(lp.top_token_ids, round(lp.logprob, 4), [round(x, 4) for x in lp.top_logprobs]) for lp in logprobs]


def _fold(chunks, n: int) -> list[tuple]:
    """Streamed chunks folded per completion index: (text, token_ids, finish_reason, logprobs)."""
    out = []
    for i in range(n):
        mine = [c for c in chunks if c.index == i]
        lps = [lp for c in mine for lp in (c.logprobs or [])]
        has_lp = any(c.logprobs is not None for c in mine)
        finals = [c.finish_reason for c in mine if c.finish_reason is not None]
        assert len(finals) == 1 and mine[-1].finish_reason is not None  # exactly one last chunk per completion
        out.append(
            (
                "".join(c.text for c in mine),
                [t for c in mine for t in c.token_ids],
                finals[0],
                _lp(lps) if has_lp else None,
            )
        )
    return out


def _texts(chunks, n: int) -> list[list]:
    """The token_texts of streamed chunks, per completion index."""
    return [[t for c in chunks if c.index == i for t in (c.token_texts or [])] for i in range(n)]


def _named(token_ids: list[int], logprobs, tokenizer) -> list[TokenText]:
    """Each token's TokenText as the tokenizer names it alone: what the server must send beside logprobs."""
    return [
        TokenText(tokenizer.decode([t]), [tokenizer.decode([a]) for a in lp.top_token_ids])
        for t, lp in zip(token_ids, logprobs, strict=True)
    ]


def run_four(engine: Engine, server, case: str, **params) -> list[tuple]:
    """The request through Engine.generate, Engine.stream, Client.generate and Client.stream (each its own salt);
    asserts all four agree (the token texts of logprobs too) and returns the completions as (text, token_ids,
    finish_reason, logprobs)."""
    n = params.get("n", 1)
    sp = SamplingParams(**params)
    gen = engine.generate(input_ids=[PROMPT], sampling_params=sp, cache_salt=f"{case}-eg")[0]
    engine_gen = [(o.text, o.token_ids, o.finish_reason, _lp(o.logprobs)) for o in gen.outputs]
    engine_chunks = list(engine.stream(input_ids=[PROMPT], sampling_params=sp, cache_salt=f"{case}-es"))
    engine_stream = _fold(engine_chunks, n)
    with server.client(timeout=60) as c:
        r = c.generate(input_ids=PROMPT, cache_salt=f"{case}-sg", **params)
        server_gen = [(ch.text, ch.token_ids, ch.finish_reason, _lp(ch.logprobs)) for ch in r.choices]
        server_chunks = list(c.stream(input_ids=PROMPT, cache_salt=f"{case}-ss", **params))
        server_stream = _fold(server_chunks, n)
    assert engine_gen == server_gen
    assert engine_stream == engine_gen
    assert server_stream == server_gen
    texts = [o.token_texts for o in gen.outputs]
    assert texts == [ch.token_texts for ch in r.choices]
    if sp.logprobs is None:
        assert texts == [None] * n and _texts(engine_chunks, n) == _texts(server_chunks, n) == [[]] * n
    else:
        assert texts == _texts(engine_chunks, n) == _texts(server_chunks, n)
        assert texts == [_named(o.token_ids, o.logprobs, engine.tokenizer) for o in gen.outputs]
    assert gen.usage.completion_tokens == r.usage.completion_tokens == sum(len(o[1]) for o in engine_gen)
    return engine_gen


def test_eos_is_kept_in_token_ids_and_hidden_from_text(engine, server, reference, eos_id, smollm2_tokenizer):
    [(text, ids, reason, _)] = run_four(engine, server, "eos", max_tokens=12, temperature=0.0)
    assert ids == reference[: EOS_AT + 1] and ids[-1] == eos_id and reason == "stop"
    assert text == smollm2_tokenizer.decode(reference[:EOS_AT], skip_special_tokens=True)


def test_stop_token_id_is_kept_in_token_ids_and_hidden_from_text(engine, server, reference, smollm2_tokenizer):
    j = next(i for i in range(EOS_AT + 2, len(reference)) if reference[i] not in reference[:i])
    [(text, ids, reason, _)] = run_four(
        engine, server, "stop-id", max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[reference[j]]
    )
    assert ids == reference[: j + 1] and reason == "stop"
    assert text == smollm2_tokenizer.decode(reference[:j], skip_special_tokens=True)


def _mid_token_stop(reference: list[int], tokenizer) -> tuple[str, int, int]:
    """A stop string that begins one character inside token i: (stop, i, its position in the text)."""
    full = tokenizer.decode(reference, skip_special_tokens=True)
    for i in range(2, len(reference) - 1):
        head = tokenizer.decode(reference[:i], skip_special_tokens=True)
        if not full.startswith(head):  # token i - 1 ends inside a character
            continue
        start = len(head)
        piece = tokenizer.decode(reference[: i + 1], skip_special_tokens=True)[start:]
        stop = full[start + 1 : start + 4]
        if len(piece) >= 3 and len(stop) == 3 and full.find(stop) == start + 1:
            return stop, i, start + 1
    raise AssertionError("no token of the reference can host a mid-token stop string")


def test_stop_string_that_begins_inside_a_token_with_logprobs(engine, server, reference, smollm2_tokenizer):
    stop, i, pos = _mid_token_stop(reference, smollm2_tokenizer)
    [(text, ids, reason, lps)] = run_four(
        engine, server, "stop-str", max_tokens=len(reference), temperature=0.0, ignore_eos=True, stop=[stop], logprobs=2
    )
    full = smollm2_tokenizer.decode(reference, skip_special_tokens=True)
    assert text == full[:pos] and reason == "stop"
    assert ids == reference[: i + 1]  # the token in which the stop string begins is kept, none after it
    assert len(lps) == len(ids) and [lp[0][0] for lp in lps] == ids  # greedy: the sampled token is the top one


def test_parallel_samples_with_logprobs(engine, server):
    outs = run_four(engine, server, "n3", max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True, logprobs=1)
    assert [len(o[1]) for o in outs] == [6, 6, 6] and {o[2] for o in outs} == {"length"}
    assert all(len(o[3]) == 6 for o in outs)
    assert len({tuple(o[1]) for o in outs}) > 1


def test_malformed_inputs_get_the_same_error_from_engine_and_server(engine, server):
    """One prompt path (input_problem, encode_prompt, check_prompt): the Engine raises RequestRejected with the very
    code and message the server answers, for malformed inputs and for prompts that can never run."""
    from runtime.client import ServerError
    from runtime.protocol import ERR_CONTEXT, ERR_INVALID
    from runtime.scheduler.request import RequestRejected

    vocab = engine.scheduler.vocab_size
    cases = {
        "empty prompt": ({"prompt": ""}, ERR_INVALID, "prompt is empty"),
        "empty messages": ({"messages": []}, ERR_INVALID, "messages is empty"),
        "empty input_ids": ({"input_ids": []}, ERR_INVALID, "input_ids is empty"),
        "out of vocabulary": (
            {"input_ids": [1, vocab]},
            ERR_INVALID,
            f"token ids outside the vocabulary [0, {vocab}): [{vocab}]",
        ),
        "too long": ({"input_ids": [5] * engine.scheduler.max_model_len}, ERR_CONTEXT, None),
        "too many characters": (
            {"prompt": "a" * (32 * engine.scheduler.max_model_len + 1)},
            ERR_INVALID,
            f"prompt too long: {32 * engine.scheduler.max_model_len + 1} characters, the limit "
            f"is {32 * engine.scheduler.max_model_len} (max_prompt_chars)",
        ),
    }
    for case, (inputs, code, message) in cases.items():
        with pytest.raises(RequestRejected) as engine_error:
            engine.add_request(**inputs)
        with server.client(timeout=60) as c, pytest.raises(ServerError) as server_error:
            c.generate(max_tokens=2, **inputs)
        assert engine_error.value.code == server_error.value.code == code, case
        assert str(engine_error.value) == server_error.value.message, case
        if message is not None:
            assert server_error.value.message == message, case
    assert not engine.scheduler.has_unfinished()
