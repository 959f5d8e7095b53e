"""The served model's tokenizer in the gateway process, for the token path: each sequence's
incremental detokenizer (common/detokenizer.py: never half a UTF-8 character, text that may
start a stop string held back) and each token's own text, as logprobs show it.

The tokenizer comes from the tokenizer service once (GetTokenizerJson, see
gateway/pipeline/generation.py) and decodes here, where the engine's tokens arrive: an engine step
costs no round trip to another process. It never tokenizes text nor applies a chat template
(the tokenizer service does), and never talks to a service itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from common.detokenizer import IncrementalDetokenizer, bad_token_id
from common.tokenizer import Tokenizer
from gateway.messages import Logprob
from gateway.pipeline.text import TextRequest, TokenLogprob


class ModelText:
    """Token ids to text for one model: one detokenizer per sequence, and each token's own text
    (special tokens kept), kept once decoded (bounded by the vocabulary)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}

    def detokenizer(self, request: TextRequest) -> IncrementalDetokenizer:
        """A new sequence of `request`: its stop strings and special-token setting."""
        return IncrementalDetokenizer(
            self._tokenizer,
            skip_special_tokens=request.skip_special_tokens,
            stop=request.stop,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )

    def bad_token_id(self, token_ids: Sequence[int]) -> str | None:
        """Why these ids have no text (one outside the vocabulary), or None."""
        return bad_token_id(token_ids, self._tokenizer)

    def _text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            # Special tokens keep their text here: a logprob for "<|im_end|>" must say so.
            text = self._token_texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    def logprobs(
        self, records: Sequence[Logprob], first_prompt_token: int | None = None
    ) -> list[TokenLogprob]:
        """The records with token texts; a prompt's first token, when given, leads them with no
        logprob (the engine sends none for it). ValueError names an id outside the
        vocabulary."""
        ids = list(_logprob_ids(records))
        if first_prompt_token is not None:
            ids.append(first_prompt_token)
        if (bad := self.bad_token_id(ids)) is not None:
            raise ValueError(f"logprobs: {bad}")
        text = self._text
        first = (
            []
            if first_prompt_token is None
            else [TokenLogprob(first_prompt_token, text(first_prompt_token), None, [])]
        )
        return first + [
            TokenLogprob(
                lp.token_id,
                text(lp.token_id),
                lp.logprob,
                [(token_id, text(token_id), logprob) for token_id, logprob in lp.top],
            )
            for lp in records
        ]


def _logprob_ids(records: Sequence[Logprob]) -> Iterable[int]:
    for lp in records:
        yield lp.token_id
        for token_id, _ in lp.top:
            yield token_id
