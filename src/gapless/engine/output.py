"""A choice's output as the client sees it: its tokens rendered as text, stop strings cut.

Owned by the engine's output path. Whether a request ends with a token, stop strings aside,
is Request.finish_reason's to say: a pure function of the request and the token.
"""

from __future__ import annotations

from gapless.engine.events import TokenLogprob
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.stopping import StopStringFilter
from gapless.model.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stop_filter = (
            StopStringFilter(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None
        )

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self.stop_filter.matched if self.stop_filter else None

    def render(
        self, token: int | None, info: TokenLogprob | None, last: bool
    ) -> tuple[str, list[TokenLogprob], bool]:
        """The text and logprobs a new token releases, and whether a stop string ended the
        output with it. token None: the token shows no text (a stop token). last: nothing
        follows, so everything held back comes out with this token."""
        text = "" if token is None else self.detokenizer.add([token])
        if last:
            text += self.detokenizer.flush()
        logprobs = [info] if info else []
        if self.stop_filter is None:
            return text, logprobs, False
        # Logprobs then travel with their tokens' text: none for text the stop cut off.
        text, logprobs = self.stop_filter.feed(text, info)
        if self.stop_filter.stopped:
            return text, logprobs, True
        if last:
            rest, held = self.stop_filter.flush()
            text, logprobs = text + rest, logprobs + held
        return text, logprobs, False
