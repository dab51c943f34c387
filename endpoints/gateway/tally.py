"""The tokens one request has used so far, from the engine's `usage`: what it is billed for.

A whole answer carries its totals. A stream carries usage on every chunk (the gateway asks for
`continuous_usage_stats`), but vLLM counts it per choice there: a chunk of choice `i` says the
prompt tokens of its prompt and the output tokens of choice `i` alone. With `n` choices per prompt
choice `i` belongs to prompt `i // n` (vLLM numbers the choices of a list of prompts that way).
The closing usage-only chunk carries the totals and replaces the running figures. A Responses stream carries
only totals, in its last event; until then its delta events count a floor of its output tokens, and a stream cut before
that event, once its engine wrote an event from its output, takes its prompt's count from its engine's rendering of it
(`endpoints.gateway.rendered_prompt`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_CHOICE_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)[,}]')


@dataclass(slots=True)
class UsageTally:
    num_choices_per_prompt: int = 1
    num_prompts: int = 1
    _prompt_by_prompt: dict[int, int] = field(default_factory=dict)
    _completion_by_choice: dict[int, int] = field(default_factory=dict)
    _cached: int = 0
    _totals: tuple[int, int, int] | None = None  # prompt, cached, completion from a whole usage
    # A Responses stream's `response.*.delta` events read (one an engine step): its output tokens' floor while its last
    # event, the only one with usage, has not come (a stream cut before it is billed that, and its prompt as its engine
    # renders it: `take_rendered_prompt`).
    num_output_events: int = 0
    # A Responses stream's engine wrote an event from its output (`sse.is_responses_output`): its prompt was prefilled
    # whole, so a stream cut before its last event is billed it, as its engine renders it.
    prompt_prefilled: bool = False

    def counts(self) -> tuple[int, int, int]:
        """Prompt, cached (never more than the prompt's) and output tokens counted so far, in one call.

        NOTE: a request's end reads all three four times over (its cost, its settlement, its usage row, its log line
        and metrics): one tuple each time, the whole usage's own when it came, where three properties were ~20 calls."""
        totals = self._totals
        if totals is not None:
            return totals
        prompt = sum(self._prompt_by_prompt.values())
        return (prompt, min(self._cached, prompt),
                max(sum(self._completion_by_choice.values()), self.num_output_events))

    @property
    def prompt_tokens(self) -> int:
        return self.counts()[0]

    @property
    def cached_tokens(self) -> int:
        return self.counts()[1]

    @property
    def completion_tokens(self) -> int:
        return self.counts()[2]

    @property
    def has_totals(self) -> bool:
        """A whole usage came (a whole answer's, a stream's closing chunk or a Responses stream's last event)."""
        return self._totals is not None

    @property
    def every_prompt_counted(self) -> bool:
        """Each prompt's tokens are counted: the engine prefilled them all (a stream's first event of each
        prompt says so), or a whole usage came."""
        return self._totals is not None or len(self._prompt_by_prompt) >= self.num_prompts

    def take_totals(self, usage: dict | None) -> None:
        """A whole answer's usage, or a stream's closing usage-only chunk."""
        if not usage:
            return
        prompt, cached, completion = _counts(usage)
        self._totals = (prompt, min(cached, prompt), completion)

    def take_rendered_prompt(self, num_tokens: int) -> None:
        """A Responses stream cut before its last event: its prompt's tokens as its engine renders them
        (`endpoints.gateway.rendered_prompt`), none of them known to be cached."""
        if self._totals is None and num_tokens > 0:
            self._prompt_by_prompt[0] = num_tokens

    def take_chunk(self, usage: dict | None, event: bytes) -> None:
        """The usage on a stream chunk of one choice (cumulative for that choice)."""
        if not usage or self._totals is not None:
            return
        choice = _choice_index(event)
        prompt, cached, completion = _counts(usage)
        prompt_index = choice // self.num_choices_per_prompt
        self._prompt_by_prompt[prompt_index] = max(prompt, self._prompt_by_prompt.get(prompt_index, 0))
        self._completion_by_choice[choice] = max(completion, self._completion_by_choice.get(choice, 0))
        self._cached = max(self._cached, cached)


def _counts(usage: dict) -> tuple[int, int, int]:
    """Prompt, cached and output tokens of a chat or completions `usage`, or of a Responses one (`input_tokens`,
    `input_tokens_details.cached_tokens`, `output_tokens`, reasoning included)."""
    if "input_tokens" in usage:
        prompt, details, completion = usage.get("input_tokens"), usage.get("input_tokens_details"), usage.get("output_tokens")
    else:
        prompt, details, completion = (usage.get("prompt_tokens"), usage.get("prompt_tokens_details"),
                                       usage.get("completion_tokens"))
    return (_count(prompt), _count(details.get("cached_tokens") if isinstance(details, dict) else 0), _count(completion))


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _choice_index(event: bytes) -> int:
    """The index of the (one) choice of a compact JSON chunk; parsed when the bytes say otherwise."""
    found = _CHOICE_INDEX.search(event)
    if found is not None:
        return int(found.group(1))
    try:
        choices = json.loads(event[6:]).get("choices") or [{}]
        return _count(choices[0].get("index"))
    except (ValueError, AttributeError, IndexError, TypeError):
        return 0
