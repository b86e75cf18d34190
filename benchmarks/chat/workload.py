"""The multi-turn chat workload: readable questions and background text, lengthened to drawn token counts.

All conversations share one system prompt (a customer-support brief for a fictional library, lengthened to
`system_tokens` tokens). Each user turn is background sentences followed by a question, cut to a size drawn
uniformly from [user_lo, user_hi] tokens. Everything is seeded; the same seed and tokenizer give the same text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SYSTEM_BRIEF = [
    "You are the help desk assistant of the Northgate Public Library.",
    "Answer questions from members politely, clearly and in a few sentences.",
    "The library opens at nine in the morning and closes at eight in the evening from Monday to Friday.",
    "On Saturday it opens at ten and closes at five; on Sunday it is closed.",
    "Members may borrow up to twelve items at once, for three weeks, and renew each item twice online.",
    "Late returns cost ten cents a day for books and fifty cents a day for films, capped at five dollars per item.",
    "The reading room on the second floor is a quiet zone; phone calls are taken in the lobby.",
    "Study rooms seat four people and can be booked for two hours a day through the website.",
    "The children's corner holds a story hour every Wednesday and Saturday at eleven.",
    "Printing costs fifteen cents a page in black and white and fifty cents in colour.",
    "Wireless internet is free; the network name is written on the card at the front desk.",
    "Lost cards are replaced for two dollars; a photo identity document is required.",
    "The local history archive can be visited by appointment on Tuesdays and Thursdays.",
    "Donations of books in good condition are accepted at the back entrance on weekday mornings.",
    "Never share the personal details of another member, and never promise a service the library does not offer.",
    "If you do not know an answer, say so and suggest asking a librarian at the front desk.",
]

BACKGROUND = [
    "I moved to the neighbourhood a few months ago and I am still learning how things work here.",
    "My daughter started school this year and she has become a keen reader of adventure stories.",
    "Last week I tried to use the website but the page kept asking me to sign in again.",
    "I usually come in after work, so I often arrive about an hour before closing time.",
    "A friend of mine told me that the library also lends board games and musical instruments.",
    "I am preparing for an exam in accounting and I need a quiet place to study for long hours.",
    "My grandfather grew up in this town and I would like to learn more about its history.",
    "I have a stack of novels at home that I no longer read and would like to give away.",
    "We are a small group of retired teachers who meet every month to talk about books.",
    "I work from home most days and sometimes the internet connection in my flat is unreliable.",
    "The last time I borrowed a film I forgot to return it on time and I am not sure what I owe.",
    "I am not very comfortable with computers, so I prefer to ask a person when I can.",
    "My son needs to print a school project with photographs and maps in it.",
    "I read mostly on my phone these days, but I still enjoy holding a printed book.",
    "Our family is planning a long trip by train this summer and we want things to read on the way.",
    "I run a small gardening club and we are looking for a room where we can meet.",
    "English is my second language and I am looking for easy books to practise reading.",
    "I have never had a library card before and I do not know what documents to bring.",
]

QUESTIONS = [
    "What are your opening hours on Saturday?",
    "Can I renew my books online, and how many times?",
    "How much is the fine for returning a film three days late?",
    "Is there a quiet place where I can study for the whole afternoon?",
    "How do I book a study room for my group?",
    "When is the story hour for young children?",
    "How much does it cost to print ten pages in colour?",
    "What should I do if I lose my library card?",
    "Can I visit the local history archive this week?",
    "Where can I drop off books that I want to donate?",
    "How many items can I borrow at the same time?",
    "Are you open on Sunday afternoons?",
    "Can I make a phone call in the reading room?",
    "How do I connect to the wireless internet?",
    "Is there a limit on how much a late fine can grow?",
    "Do I need an appointment to see old maps of the town?",
    "What documents do I need to get a new card?",
    "Can my group use a study room for four hours on one day?",
    "Could you recommend a way to find easy books for learners?",
    "What happens if I return a book one week late?",
    "Can I reserve a book that someone else has borrowed?",
    "Do you lend board games or musical instruments?",
    "Is the second floor suitable for a group discussion?",
    "How early can I come in on a weekday morning?",
    "Can I pay my fines at the front desk with a card?",
    "Who should I ask if the website does not let me sign in?",
    "Could you summarise the rules for borrowing films?",
    "Is printing in black and white cheaper than in colour?",
    "What time do you close on Friday evenings?",
    "Is there anything special for children on Wednesdays?",
    "Can I bring my own laptop and use your internet all day?",
    "What is the best day to visit if I want a quiet morning?",
]


@dataclass
class ChatWorkload:
    """system_prompt: the shared system message. user_turns[c][t]: the user message of conversation c, turn t.
    user_tokens[c][t]: its drawn size (tokens of the message text alone, before the chat template)."""

    system_prompt: str
    user_turns: list[list[str]]
    user_tokens: list[list[int]]

    def to_json(self) -> dict[str, Any]:
        """The workload as saved with the results."""
        return {"system_prompt": self.system_prompt, "user_turns": self.user_turns, "user_tokens": self.user_tokens}


def fit_text(tokenizer: Any, sentences: list[str], n_tokens: int, rng: random.Random | None, tail: str = "") -> str:
    """Readable text of about n_tokens tokens: sentences in a cycle (shuffled by rng each time round, in order when
    rng is None), cut at a token boundary so that with `tail` appended the text has n_tokens tokens
    (tokenizer.encode, no special tokens; re-encoding a cut may shift the count by a token or two)."""
    tail_ids = tokenizer.encode(" " + tail, add_special_tokens=False) if tail else []
    budget = max(0, n_tokens - len(tail_ids))
    words: list[str] = []
    pool: list[str] = []
    ids: list[int] = []
    while len(ids) < budget:
        if not pool:
            pool = rng.sample(sentences, len(sentences)) if rng is not None else list(sentences)
        words.append(pool.pop(0))
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    head = tokenizer.decode(ids[:budget]).strip() if budget else ""
    return f"{head} {tail}".strip() if tail else head


def build_workload(
    tokenizer: Any, conversations: int, turns: int, system_tokens: int, user_lo: int, user_hi: int, seed: int
) -> ChatWorkload:
    """The seeded workload: one system prompt of system_tokens tokens, conversations x turns user messages of
    uniform [user_lo, user_hi] tokens, each ending with a question (the question list is used in a shuffled cycle).

    Raises ValueError for sizes out of order or below 1."""
    if conversations < 1 or turns < 1 or system_tokens < 1 or not 1 <= user_lo <= user_hi:
        raise ValueError(
            f"bad workload sizes: conversations={conversations} turns={turns} "
            f"system_tokens={system_tokens} user_tokens={user_lo}:{user_hi}"
        )
    rng = random.Random(seed)
    system = fit_text(tokenizer, SYSTEM_BRIEF, system_tokens, None)
    questions: list[str] = []
    turns_text = []
    sizes = []
    for _ in range(conversations):
        row = []
        row_sizes = []
        for _ in range(turns):
            if not questions:
                questions = rng.sample(QUESTIONS, len(QUESTIONS))
            size = rng.randint(user_lo, user_hi)
            row.append(fit_text(tokenizer, BACKGROUND, size, rng, tail=questions.pop()))
            row_sizes.append(size)
        turns_text.append(row)
        sizes.append(row_sizes)
    return ChatWorkload(system, turns_text, sizes)
