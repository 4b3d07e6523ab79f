"""Natural-language role prompts for chat models, one (system, user template) pair per role.

The terse templates in builtin.py suit the character-level tiny models, which learn a format from scratch.
A chat checkpoint instead reads instructions: each role gets a system prompt saying what it does and how to
end its answer, and a user turn that states the problem and quotes earlier agents' responses whole. The
"The answer is N" ending is what the `math` answer parser looks for (besides \\boxed{} and "#### N").
User templates use the same fields as plain ones: {prompt}, {inputs} and upstream node names.
"""

from __future__ import annotations

_ANSWER_FORMAT = 'Think step by step, then end with a final line of the form "The answer is N".'

CHAIN_CHAT = {
    "solver": (
        f"You are a careful problem solver. {_ANSWER_FORMAT}",
        "{prompt}",
    ),
    "verifier": (
        "You are a strict verifier. You check another assistant's solution to a problem. Start your reply with "
        '"Yes" if its final answer is correct or "No" if it is not, then say why in one sentence.',
        "Problem:\n{prompt}\n\nProposed solution:\n{solver}\n\nIs the final answer correct? Answer Yes or No.",
    ),
    "corrector": (
        f"You fix solutions that a verifier rejected. Solve the problem again without the earlier mistake. "
        f"{_ANSWER_FORMAT}",
        "Problem:\n{prompt}\n\nEarlier solution:\n{solver}\n\nVerifier's judgement:\n{verifier}\n\n"
        "Write a corrected solution.",
    ),
}

DEBATE_CHAT = {
    "first": (
        f"You are one of several agents debating a problem. {_ANSWER_FORMAT}",
        "{prompt}",
    ),
    "later": (
        "You are one of several agents debating a problem. Read the other agents' latest responses, point out "
        f"any mistakes, and give your own solution. {_ANSWER_FORMAT}",
        "Problem:\n{prompt}\n\nResponses from the previous round:\n\n{inputs}\n\nGive your updated solution.",
    ),
    "judge": (
        f"You judge a debate: read the debaters' final responses and decide the correct answer. {_ANSWER_FORMAT}",
        "Problem:\n{prompt}\n\nThe debaters' final responses:\n\n{inputs}\n\nWhat is the correct answer?",
    ),
}

MIXTURE_CHAT = {
    "proposer": (
        f"You are a careful problem solver. {_ANSWER_FORMAT}",
        "{prompt}",
    ),
    "aggregator": (
        "You combine several proposed solutions into one: check them against each other and keep what is right. "
        f"{_ANSWER_FORMAT}",
        "Problem:\n{prompt}\n\nProposed solutions:\n\n{inputs}\n\nGive the best final solution.",
    ),
}
