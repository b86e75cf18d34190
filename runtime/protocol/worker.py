"""Scheduler <-> worker messages, in the delta format of docs/ARCHITECTURE.md.

A new sequence is sent once in full (its whole block table and SamplingParams); afterwards each step carries only that
step's input token ids, its start position and the block ids appended since the previous step, so a step's message
grows with the batch, not with the context length.
"""

from __future__ import annotations

import msgspec

from runtime.sampling_params import SamplingParams


class ScheduledSeq(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One sequence's work in one step.

    seq_id: scheduler-assigned id, unique while the sequence is live in the worker.
    token_ids: this step's input tokens (a prefill chunk, or the one token sampled last step).
    start_pos: position (tokens) of token_ids[0]; the tokens before it already have KV in the block table.
    new_block_ids: block ids appended to the sequence's block table since its previous step (a new sequence: its
        whole table, cached prefix included).
    sample: True when this step reaches the end of the known tokens, so the worker samples the next token.
    sampling_params: sent once, when the sequence is new to the worker (first step, or resumed after recompute).
    prompt_len: with sampling_params: the request's original prompt length (tokens), so the worker knows the
        completion-token index (start_pos + len(token_ids) - prompt_len) that seeds each draw.
    sample_index: with sampling_params: which of the request's n samples this sequence is (seeds differ per sample).
    penalty_token_ids: with sampling_params whose penalties are on (SamplingParams.has_penalties) or that have
        structured_outputs (the grammar matcher replays the output), else None: the tokens the penalties read, as the
        sequence stands when it (re)enters the worker: prompt + output so far (split at prompt_len) when
        repetition_penalty != 1, else the output so far alone. The worker then counts the
        tokens it samples itself, so they are sent once per registration (first step, resume after recompute or
        swap); a sequence without penalties adds one nil byte to the message.
    prompt_token_ids: with sampling_params whose prompt_logprobs is set, else None: the whole prompt, so the worker
        knows the next prompt token of every position it runs, across chunks (runtime/model/prompt_logprobs.py); sent
        once per registration, one nil byte for every other sequence.
    new_window_block_ids: with a sliding-window KV cache group (Ready.num_window_blocks > 0), that group's block ids
        appended since the previous step, aligned with new_block_ids (a new sequence: its whole window table, 0 before
        its window); None (one nil byte) with one group.
    num_draft_tokens: speculative decoding (runtime/scheduler/speculation.py): the last num_draft_tokens of token_ids
        are a draft (then sample is True) the worker verifies (runtime/model/spec_verify.py); 0: no draft.
    num_draft_slots: speculative decoding with a draft model: token_ids is the one token sampled last step and the
        block table holds num_draft_slots more slots after it, which the worker's draft model fills with its draft
        before the verify forward (runtime/model/draft_runner.py; sample is True); with num_scheduler_steps > 1
        the worker fills them with decode steps of its own instead (runtime/model/multi_step.py); 0: none.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    new_block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams | None = None
    prompt_len: int = 0
    sample_index: int = 0
    penalty_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    new_window_block_ids: list[int] | None = None
    num_draft_tokens: int = 0
    num_draft_slots: int = 0


class ForwardBatch(msgspec.Struct, tag="forward_batch", forbid_unknown_fields=True):
    """One step for the worker. Applied in this order: forks and fork_copies, drop, swap_out, swap_in, copies, then
    the forward.

    forks: (parent seq id, child seq id, shared blocks) per beam fork (runtime/scheduler/beam_search.py): the worker
    registers the child with the parent's sampling state and the first `shared` entries of the parent's block table as
    it stands before this step; the child's own ScheduledSeq then carries only the block ids appended after them (a
        fork is a delta, never a whole table). Applied first, so a parent dropped in the same step still lends it.
    fork_copies: (src, dst) copies of the forks' shared partial blocks into the children's own, applied with the
        forks, before anything of the step can free or overwrite a source (dst blocks came off the free queue, never
        from an eviction whose write-back this step still reads).

    drop_seq_ids: sequences the worker forgets (finished, aborted, preempted by recompute).
    swap_out: (device block, host block) pairs to copy device -> host (preemption by swapping, and the host tier's
        write-backs of evicted blocks: a device block listed here may be reused by this same step, so these copies
        come before anything else of the step writes a device block).
    swap_in: (host block, device block) pairs to copy host -> device (swapped sequences coming back, and the host
        tier's load-backs; the forward reads them, so they are done before it).
    copies: copy-on-write (src device block, dst device block) pairs.
    window_copies: copy-on-write pairs of the sliding-window group's blocks (with copies, before the forward).
    window_swap_out / window_swap_in: the sliding-window group's swap pairs (its own host swap pool), applied with
        swap_out / swap_in: outs before ins, both before the copies and the forward.
    """

    step_id: int
    seqs: list[ScheduledSeq]
    drop_seq_ids: list[int] = []
    swap_out: list[tuple[int, int]] = []
    swap_in: list[tuple[int, int]] = []
    copies: list[tuple[int, int]] = []
    forks: list[tuple[int, int, int]] = []
    fork_copies: list[tuple[int, int]] = []
    window_copies: list[tuple[int, int]] = []
    window_swap_out: list[tuple[int, int]] = []
    window_swap_in: list[tuple[int, int]] = []


class TokenLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Logprob (natural log) of the sampled token and the top alternatives, best first (for a beam search
    sequence: its beam candidates, SamplingParams.use_beam_search / runtime/model/sampler.py)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The logprobs of consecutive prompt tokens (SamplingParams.prompt_logprobs), vLLM's prompt_logprobs.

    start: the prompt position of token_ids[0]. token_ids: those prompt tokens. logprobs: aligned, each token's
    TokenLogprobs (its natural-log probability given the prompt before it, from the raw logits of the position
    before, and the top prompt_logprobs alternatives there, best first), None for position 0 (nothing precedes it).
    ranks: aligned, the token's rank among the vocabulary there (1: the most likely; 1 + the number of tokens with
    a strictly higher logprob), 0 for position 0.
    """

    start: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    ranks: list[int]


class ForwardResult(msgspec.Struct, tag="forward_result", forbid_unknown_fields=True):
    """The worker's answer to one ForwardBatch.

    seq_ids / token_ids: one sampled token per sequence that had sample=True, in batch order.
    logprobs: aligned with seq_ids when any of them asked for logprobs (else None).
    prompt_logprobs: seq_id -> the PromptLogprobs of the prompt positions its chunk ran this step, for the sequences
        that asked (SamplingParams.prompt_logprobs); None when none did, so other steps pay one nil byte.
    num_forward_tokens: tokens run through the model this step for the sequences that succeeded, each counted once
        (prompt tokens actually computed + decode tokens; re-runs while isolating a failure are not counted).
    failed_seq_ids / failed_errors: the sequences the worker could not run this step (an invalid delta, or a forward
        or draw that raised with them alone in the batch) and one "ExceptionType: message" each, aligned; the
        scheduler fails their requests, every other sequence of the step has its result above.
    accepted_token_ids: seq_id -> the draft tokens the verification accepted (maybe []), for each sequence of
        seq_ids that ran a draft: they come before its token_ids entry (runtime/model/spec_verify.py); None when no
        sequence of the step ran one.
    draft_token_ids: seq_id -> the draft the worker's draft model proposed, for each sequence of seq_ids that had
        num_draft_slots (accepted_token_ids lists its accepted prefix); None when none had.
    accepted_logprobs: seq_id -> the logprobs of its accepted draft tokens (aligned with accepted_token_ids), for
        each sequence that ran a draft and asked for logprobs; None when none did.
    error: set (and nothing sampled) when the step failed as a whole (its drops, swaps or copies could not be
        applied); the scheduler fails the batch's requests.
    """

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    num_forward_tokens: int = 0
    error: str | None = None
    failed_seq_ids: list[int] = []
    failed_errors: list[str] = []
    prompt_logprobs: dict[int, PromptLogprobs] | None = None
    accepted_token_ids: dict[int, list[int]] | None = None
    draft_token_ids: dict[int, list[int]] | None = None
    accepted_logprobs: dict[int, list[TokenLogprobs]] | None = None  # speculation with logprobs (issue 26)


class Ready(msgspec.Struct, tag="ready", forbid_unknown_fields=True):
    """Worker start-up handshake: the KV cache is allocated and the model loaded.

    num_blocks includes the reserved null block 0; block_size and max_model_len are in tokens. num_host_blocks: the
    swap pool; num_host_cache_blocks: the host tier of the prefix cache, held after the swap pool in the worker's
    host KV tensor (host ids num_host_blocks .. num_host_blocks + num_host_cache_blocks - 1). num_window_blocks and
    sliding_window: the sliding-window KV cache group's blocks (null block included) and its window in tokens (0, 0:
    one group).
    """

    num_blocks: int
    block_size: int
    max_model_len: int
    num_host_blocks: int
    vocab_size: int
    eos_token_ids: list[int]
    num_host_cache_blocks: int = 0
    num_window_blocks: int = 0
    sliding_window: int = 0


class WorkerProbe(msgspec.Struct, tag="worker_probe", forbid_unknown_fields=True):
    """Scheduler -> worker health probe. It queues behind the step in flight and the worker's own loop answers it
    between steps with WorkerProbeReply(probe_id), so a reply shows the worker serves (a frozen or stuck worker never
    answers)."""

    probe_id: int


class WorkerProbeReply(msgspec.Struct, tag="worker_probe_reply", forbid_unknown_fields=True):
    """The worker's answer to WorkerProbe(probe_id)."""

    probe_id: int


WorkerInput = ForwardBatch | WorkerProbe  # what the worker decodes on worker_in
WorkerOutput = ForwardResult | WorkerProbeReply  # what the scheduler decodes on worker_out once Ready has come
WorkerMessage = ForwardBatch | ForwardResult | Ready | WorkerProbe | WorkerProbeReply
