"""/metrics carries speculative decoding's counters in vLLM's names, from ServerStats' spec_decode_* fields."""

from __future__ import annotations

from runtime.protocol import ServerStats
from runtime.serve.http.metrics import HttpMetrics


def _samples(text: str, name: str) -> dict[str, float]:
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith(name + "{")}


def test_spec_decode_counters_and_accepted_per_position():
    stats = ServerStats(
        spec_decode_num_drafts=5,
        spec_decode_num_draft_tokens=17,
        spec_decode_num_accepted_tokens=9,
        spec_decode_num_accepted_tokens_per_pos=[4, 3, 2, 0],
    )
    text = HttpMetrics("m").render(stats).decode()
    label = '{model_name="m"}'
    assert _samples(text, "radixserve:spec_decode_num_drafts_total") == {
        "radixserve:spec_decode_num_drafts_total" + label: 5.0
    }
    assert _samples(text, "radixserve:spec_decode_num_draft_tokens_total") == {
        "radixserve:spec_decode_num_draft_tokens_total" + label: 17.0
    }
    assert _samples(text, "radixserve:spec_decode_num_accepted_tokens_total") == {
        "radixserve:spec_decode_num_accepted_tokens_total" + label: 9.0
    }
    per_pos = _samples(text, "radixserve:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == {
        f'radixserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}}': float(v)
        for i, v in enumerate([4, 3, 2, 0])
    }
    off = HttpMetrics("m").render(ServerStats()).decode()
    assert _samples(off, "radixserve:spec_decode_num_accepted_tokens_per_pos_total") == {}
    assert "radixserve:spec_decode_num_drafts_total" + label + " 0.0" in off
