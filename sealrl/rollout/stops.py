"""Stop strings: a response stops at the token whose text completes a stop string.

The matching is done on the decoded response text (special tokens skipped, no clean-up), so a
stop string spanning several tokens is found, and the token that completes it stays in the
response: it was sampled, so it is an action the policy is trained on.
"""
from __future__ import annotations


class StopChecker:
    """Binds a tokenizer to the stop strings of one sampling contract."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)

    def hit(self, tokens: list[int]) -> bool:
        """True when the decoded response contains a stop string.

        The whole response is decoded each time: byte-level tokens can change the text of
        earlier tokens (a split UTF-8 character), so an incremental suffix is not safe.
        """
        if not self.stop:
            return False
        text = self.tokenizer.decode(tokens, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
        return any(s in text for s in self.stop)
