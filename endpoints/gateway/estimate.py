"""The most tokens, and so the most money, one `/v1` request can cost: what the gateway reserves.

`worst_case(payload, kind, max_model_len)` is the one place this is computed; spend caps and
prepaid credit reserve its `max_cost`, and token rate limits may read its token counts.

Prompt tokens are bounded without the tokenizer. A byte-level BPE tokenizer (the tiny model's, and
Llama 3's, Qwen's, GPT-2's…) never makes more tokens than the UTF-8 bytes of its text, and a
SentencePiece one with byte fallback at most one more per text, each counted after the Unicode normalization
the tokenizer may apply (NFC, NFKC: one character can become eleven), and, for a model whose agent reported a
tokenizer that decomposes, replaces or prepends, what that adds (`endpoints.gateway.normalizers`, by `_rewritten_bytes`;
an unknown one counts as the context). So a prompt is bounded by the bytes
of every text the chat template can render (contents, roles, names, tool definitions, tool calls,
`response_format` schemas; structured values as indented JSON with escapes, which is longer than
what templates render) plus a fixed allowance per message and per prompt for the template's own
text and special tokens. Whatever the text, the engine refuses a prompt longer than its context,
so each prompt counts at most `max_model_len`; a part that is not text (an image) counts as that, and
so does a chat whose `chat_template_kwargs` and `reasoning_effort`, merged as vLLM merges them, are not exactly a dict its
engine measured (the template may render them in every message, or switch on a long block with a flag). Normalizing is
work on the event loop: a request decomposes at most one context of characters, and past that a text counts
`MAX_GROWTH` bytes a character, unread.

Outputs are bounded by what vLLM honours (`vllm.entrypoints.serve.utils.api_utils.get_max_tokens`):
chat takes `max_completion_tokens`, else `max_tokens`, else all the context left; a Responses call
(`/v1/responses`, rendered by the same chat template: `instructions` a system message, each `input` item a
message) `max_output_tokens`, else all the context left; completions take
`max_tokens` only (default 16; `max_completion_tokens` is ignored), and a prompt plus its output
never pass the context. Each prompt is generated `n` times (`best_of` above `n` is refused by
`endpoints.gateway.fields`: vLLM ignores it); its prompt tokens are counted once, as vLLM's usage counts them.

Why not ask the engine: vLLM's `/tokenize` (which applies the chat template, tools included) gives
the exact count but costs a round trip to a READY replica, ~7 ms p50 against the tiny model on this
2-core machine (its `/health` 2.8 ms), where this estimate takes ~10 µs and needs no replica (a cold
start has none). The price is a loose prompt bound: English text runs ~3–4 bytes a token, so the
prompt part of a reservation is ~3× the real one until the context caps it. It is a hold, not a bill.

The allowances are at least what the model's own template was measured to add: a READY engine
counts conversations of empty messages (`gpu_agent.runtime.probes.EngineProbe.chat_template_tokens`,
kept in `ModelFacts`), so a template with a long default system prompt (some add hundreds of tokens
to every conversation) is reserved, and billed, for it; until one was measured, the defaults below.

NOTE: the bound holds for any request the engine accepts (`tests/gateway/test_reservation_vllm.py`
checks it against a real engine); a request the engine refuses costs nothing. The gateway never
bills more than it reserved (`billing.quota.counters.SETTLE_LUA` caps it), so a template that rendered more than
this allows would cost the platform, never the customer's cap.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import unicodedata
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal, InvalidOperation

from endpoints.gateway import content_parts
from endpoints.gateway.normalizers import TOKENS_PER_PROMPT, PromptNormalizer
from gpu_agent.protocol import REASONING_EFFORTS, TEMPLATE_KWARG_VARIANTS

# Template text and special tokens around each message (role markers, separators, BOS/EOS), around
# the whole conversation (a default system preamble, the generation prompt), for the instructions a
# template adds when tools are offered, and added to each completions prompt (BOS/EOS). Common
# templates use less: Llama 3.1 ~25 tokens of preamble and ~5 per message, its tool preamble ~200.
TOKENS_PER_MESSAGE = 16
TOKENS_PER_CONVERSATION = 64
TOKENS_FOR_TOOLS = 512
# Between and around the text parts of one message's content: vLLM joins the parts of a "string" content-format
# template with "\n" (one token each, which a message of 800 one-letter parts made 45 % of its prompt, unreserved
# and so unbilled), and a template that walks the parts may add a little of its own.
TOKENS_PER_PART = 2
# vLLM's default `max_tokens` for /v1/completions (OpenAI's too).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Structured values (tools, schemas, tool calls) are counted as JSON indented this deep per level.
JSON_INDENT = 4
# No request reserves more than this many dollars (keeps Redis's integers exact).
MAX_RESERVATION = Decimal(1_000_000)
_PER_MILLION = Decimal("0.000001")


@dataclass(slots=True, frozen=True)
class WorstCase:
    """Upper bounds for one request: per prompt, its prompt tokens; how many sequences each prompt
    generates; the output tokens one sequence may have before the context ends it."""

    prompt_bounds: tuple[int, ...]  # each at most max_model_len
    num_sequences: int  # per prompt: n
    max_output_tokens: int  # per sequence, before the context limit
    max_model_len: int
    # Each prompt's bound before its endpoint's learned factor (`scaled`); None: no factor applied.
    unscaled_prompt_bounds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_sequences < 1 or self.max_output_tokens < 0 or self.max_model_len < 1:
            raise ValueError("a worst case needs a sequence, a non-negative output and a context")
        if self.prompt_bounds and not (0 <= min(self.prompt_bounds) and max(self.prompt_bounds) <= self.max_model_len):
            raise ValueError("a prompt bound lies within the context")

    @property
    def num_prompt_tokens(self) -> int:
        """The most prompt tokens the request can be billed for."""
        return sum(self.prompt_bounds)

    def scaled(self, factor: Decimal) -> WorstCase:
        """The same with each prompt's bound multiplied by `factor` (rounded up, at most the context): an endpoint whose
        prompts ran past their bounds (`endpoints.models.PromptFactor`) is reserved for as much from then on.

        NOTE: every kind's prompt bounds (chat, completions, responses, embeddings, batch lines) come through
        `InferenceRequest.worst_case`, which calls this for an endpoint with a factor: one place."""
        limit = self.max_model_len
        numerator, denominator = factor.as_integer_ratio()
        bounds = tuple(min(limit, -(-bound * numerator // denominator)) for bound in self.prompt_bounds)
        return WorstCase(bounds, self.num_sequences, self.max_output_tokens, limit, self.prompt_bounds)

    @property
    def num_output_tokens(self) -> int:
        """The most output tokens it can produce (every prompt empty, every sequence at its limit)."""
        return len(self.prompt_bounds) * self.num_sequences * min(self.max_output_tokens, self.max_model_len)

    @property
    def num_tokens(self) -> int:
        """The most prompt and output tokens together."""
        return sum(self._most(bound, 1, 1) for bound in self.prompt_bounds)

    def max_cost(self, endpoint, *, fraction: Decimal | None = None) -> Decimal:
        """The most the request can cost at `endpoint`'s prices (every prompt token at the dearer of the
        input and cached rates) times `fraction` (a batch line's `Endpoint.batch_price_fraction`, as `ledger.cost_of`
        bills it; None: the full price), rounded up to the nano-dollar and at most MAX_RESERVATION.

        NOTE: a batch line was reserved at the full price, twice what it could cost: one whose worst case at the batch
        price fit the cap or credit left was refused 402, and failed for good."""
        price_in = max(endpoint.price_input_per_million, endpoint.price_cached_input_per_million) * _PER_MILLION
        price_out = endpoint.price_output_per_million * _PER_MILLION
        total = sum((self._most(bound, price_in, price_out) for bound in self.prompt_bounds), Decimal(0))
        if fraction is not None:  # NOTE: an identity test: a plain call pays no Decimal comparison (~0.2 µs)
            total *= fraction
        return min(total, MAX_RESERVATION).quantize(Decimal("1e-9"), rounding=ROUND_CEILING)

    def _most(self, bound: int, price_in, price_out):
        """max over a prompt of p tokens, 0 ≤ p ≤ bound, of p·price_in + n·min(M, L − p)·price_out.

        NOTE: a concave piecewise-linear function of p: its maximum is at an end or at the kink p = L − M.
        """
        limit, n, output = self.max_model_len, self.num_sequences, self.max_output_tokens
        kink = min(bound, max(0, limit - output))
        # NOTE: written out, not a generator over a set of the three: every request computes it twice (its tokens,
        # its cost), and the generator and set were most of the time.
        return max(n * min(output, limit) * price_out,
                   bound * price_in + n * min(output, limit - bound) * price_out,
                   kink * price_in + n * min(output, limit - kink) * price_out)


def worst_case(payload: dict, kind: str, max_model_len: int, template_tokens: tuple[int, int] = (0, 0),
               template_flag_tokens: tuple[int, int] | None = None,
               normalizer: PromptNormalizer | None = None) -> WorstCase:
    """The worst case of a `/v1/chat/completions` (`kind` "chat"), `/v1/completions` or
    `/v1/embeddings` ("embedding": its inputs' tokens, no output) request body.

    Never raises on odd input: what cannot be read is counted at its largest (the engine refuses
    what it cannot read, and a refused request costs nothing). `template_tokens`: what the model's chat
    template was measured to add, per conversation and per message (`ModelFacts`); the allowances are
    at least that. `template_flag_tokens`: the same with any flag a request may set
    (`protocol.TEMPLATE_KWARG_VARIANTS`); None until measured, and a request that sets one is bounded by the context alone.

    NOTE: it runs on the gateway's event loop before admission, for any key: a prompt is counted only until it
    reaches the context (where its bound is capped anyway), so no body, however large, costs more than one
    context's worth of per-character work, and the request shares one allowance of characters to normalize (the
    context: 2,048 prompts of U+FDFA, each under its own budget, took 0.4 s): past it, a text counts `MAX_GROWTH`
    bytes a character, unread.

    `normalizer`: what the model's tokenizer adds to a text beyond what every model's count allows
    (`normalizers.PromptNormalizer`); None for a model whose agent said nothing, or whose tokenizer adds nothing.
    """
    if normalizer is not None:
        if normalizer.alternatives:
            return _largest_worst_case(payload, kind, max_model_len, template_tokens, template_flag_tokens,
                                       normalizer.alternatives)
        return _rewritten_worst_case(payload, kind, max_model_len, template_tokens, template_flag_tokens, normalizer)
    _DECOMPOSE_ALLOWANCE.num_characters = max(1, int(max_model_len))
    return _counted_worst_case(payload, kind, max_model_len, template_tokens, template_flag_tokens)


def _counted_worst_case(payload: dict, kind: str, max_model_len: int, template_tokens: tuple[int, int],
                        template_flag_tokens: tuple[int, int] | None) -> WorstCase:
    """`worst_case` within the allowances its caller set (`_DECOMPOSE_ALLOWANCE`)."""
    limit = max(1, int(max_model_len))
    if kind in ("chat", "responses"):
        allowances = (max(TOKENS_PER_CONVERSATION, template_tokens[0]), max(TOKENS_PER_MESSAGE, template_tokens[1]))
        # NOTE: most bodies set neither; skipping the check is most of an ASCII request's estimate (issue #20).
        if "chat_template_kwargs" in payload or "reasoning_effort" in payload or "reasoning" in payload:
            reasoning = payload.get("reasoning")  # a Responses call's effort is `reasoning.effort`
            effort = payload.get("reasoning_effort") if kind == "chat" else (
                reasoning.get("effort") if isinstance(reasoning, dict) else None)
            allowances = _template_allowances(payload.get("chat_template_kwargs"), effort, allowances,
                                              template_flag_tokens)
    if kind == "chat":
        prompts = [UNBOUNDED if allowances is None else _chat_prompt_bound(payload, limit, *allowances)]
        if payload.get("add_special_tokens") not in (None, False):
            # NOTE: vLLM then adds the post-processor's special tokens to the rendered conversation too (a tenant's
            # 500 made a 204-token bound 543 tokens); any value but false, as the engine's model coerces it.
            prompts[0] += _tokens_per_prompt()
        requested = _first_int(payload.get("max_completion_tokens"), payload.get("max_tokens"))
    elif kind == "responses":
        prompts = [UNBOUNDED if allowances is None else _responses_prompt_bound(payload, limit, *allowances)]
        requested = _first_int(payload.get("max_output_tokens"))
    elif kind == "embedding":  # `input` reads as a completions prompt does; an embedding has no output
        return WorstCase(prompt_bounds=tuple(min(bound, limit) for bound in _completion_prompt_bounds(payload.get("input"), limit)),
                         num_sequences=1, max_output_tokens=0, max_model_len=limit)
    else:
        prompts = _completion_prompt_bounds(payload.get("prompt"), limit)
        suffix = payload.get("suffix")
        if isinstance(suffix, str) and suffix:
            # NOTE: a fill-in-the-middle renderer prefills the suffix with every prompt of the list (vLLM's DeepSeek V4).
            suffix_bytes = _utf8_bytes(suffix, limit)
            prompts = [bound + suffix_bytes + _tokens_per_prompt() for bound in prompts]
        requested = _first_int(payload.get("max_tokens"), COMPLETIONS_DEFAULT_MAX_TOKENS)
    # NOTE: at least one token: vLLM generates one for `max_tokens: 0` with `echo`.
    max_output = limit if requested is None else max(1, min(requested, limit))
    num_sequences = max(1, _as_int(payload.get("n")) or 1)
    return WorstCase(prompt_bounds=tuple(min(bound, limit) for bound in prompts), num_sequences=num_sequences,
                     max_output_tokens=max_output, max_model_len=limit)


def _largest_worst_case(payload: dict, kind: str, max_model_len: int, template_tokens: tuple[int, int],
                        template_flag_tokens: tuple[int, int] | None,
                        alternatives: tuple[PromptNormalizer | None, ...]) -> WorstCase:
    """`worst_case` of a copy whose replicas read tokenizers that differ (`normalizers.PromptNormalizer.alternatives`):
    each prompt's bound the largest of its bounds by each tokenizer, since the engine that serves it reads one of them
    (the rest of the case does not depend on the tokenizer).

    NOTE: the tokenizers share the request's one allowance of work: each normalizes its share of the context's
    characters and of `ASCII_SCAN_ALLOWANCE` (past it a text counts unread, looser), and the others run only when the
    texts the first read, times the others, are at most one context; past that each prompt counts as the context. Before,
    each had a whole allowance and read every text: a 9 MB body to a copy of four held the event loop 4 times one's."""
    limit = max(1, int(max_model_len))
    # NOTE: one that adds nothing is counted as an empty description, whose counts are the plain ones
    each = list(dict.fromkeys(normalizer or PromptNormalizer() for normalizer in alternatives))
    share = (limit // len(each), ASCII_SCAN_ALLOWANCE // len(each))
    cases = [_rewritten_worst_case(payload, kind, limit, template_tokens, template_flag_tokens, each[0], share)]
    if _DECOMPOSE_ALLOWANCE.num_texts * (len(each) - 1) > limit:
        return dataclasses.replace(cases[0], prompt_bounds=(limit,) * len(cases[0].prompt_bounds))
    cases += [_rewritten_worst_case(payload, kind, limit, template_tokens, template_flag_tokens, normalizer, share)
              for normalizer in each[1:]]
    if len({len(case.prompt_bounds) for case in cases}) != 1:  # NOTE: never seen; the context then bounds each
        most = max(len(case.prompt_bounds) for case in cases)
        return dataclasses.replace(cases[0], prompt_bounds=(cases[0].max_model_len,) * most)
    return dataclasses.replace(cases[0], prompt_bounds=tuple(map(max, *(case.prompt_bounds for case in cases))))


def _rewritten_worst_case(payload: dict, kind: str, max_model_len: int, template_tokens: tuple[int, int],
                          template_flag_tokens: tuple[int, int] | None, normalizer: PromptNormalizer,
                          allowance: tuple[int, int] | None = None) -> WorstCase:
    """`worst_case` of a model whose tokenizer's normalizer lengthens text (`normalizers`): every text is counted by
    `_rewritten_bytes`; a normalizer nothing bounds reserves each prompt as the context, as an unmeasured template
    flag does. `allowance`: the characters to normalize and ASCII scans it may spend (the context and
    `ASCII_SCAN_ALLOWANCE` when None)."""
    global _NUM_REWRITING
    with _REWRITING_LOCK:
        _NUM_REWRITING += 1
    if normalizer.bytes_per_character:
        # NOTE: the template's own text gets a pre-tokenizer's prepend before every character too: its allowances
        # are taken as characters, each with the prepend (a Digits-then-Metaspace chat was 7 tokens past its bound).
        scale = 1 + normalizer.bytes_per_character
        template_tokens = (max(TOKENS_PER_CONVERSATION, template_tokens[0]) * scale,
                           max(TOKENS_PER_MESSAGE, template_tokens[1]) * scale)
        if template_flag_tokens is not None:
            template_flag_tokens = (template_flag_tokens[0] * scale, template_flag_tokens[1] * scale)
    _DECOMPOSE_ALLOWANCE.rewrites = normalizer
    _DECOMPOSE_ALLOWANCE.num_characters, _DECOMPOSE_ALLOWANCE.num_ascii_scans = allowance or (
        max(1, int(max_model_len)), ASCII_SCAN_ALLOWANCE)
    _DECOMPOSE_ALLOWANCE.num_texts = 0
    try:
        case = _counted_worst_case(payload, kind, max_model_len, template_tokens, template_flag_tokens)
    finally:
        _DECOMPOSE_ALLOWANCE.rewrites = None
        _DECOMPOSE_ALLOWANCE.num_ascii_scans = 0
        with _REWRITING_LOCK:
            _NUM_REWRITING -= 1
    if normalizer.unbounded:
        return dataclasses.replace(case, prompt_bounds=(case.max_model_len,) * len(case.prompt_bounds))
    return case


# --- prompts -------------------------------------------------------------------------------------
# Every counter takes `budget`, what is left of the context: its count is exact below it, and at least the budget
# once the text reaches it (the caller then stops: the bound is the context).

UNBOUNDED = 1 << 62  # a part we cannot bound (an image, audio): the context bounds it


def _chat_prompt_bound(payload: dict, limit: int, per_conversation: int = TOKENS_PER_CONVERSATION,
                       per_message: int = TOKENS_PER_MESSAGE) -> int:
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return UNBOUNDED
    total = per_conversation
    for message in messages:
        if total >= limit:
            return total
        total += per_message + _message_bytes(message, limit - total)
    for name in ("tools", "functions", "response_format", "tool_choice", "chat_template_kwargs", "documents"):
        if payload.get(name) is not None and total < limit:
            total += _json_bytes(payload[name], limit - total)
    if payload.get("tools") or payload.get("functions"):
        total += TOKENS_FOR_TOOLS
    return total


def _template_allowances(kwargs, effort, allowances: tuple[int, int],
                         template_flag_tokens: tuple[int, int] | None) -> tuple[int, int] | None:
    """The template's own tokens (per conversation, per message) that bound a prompt with these `chat_template_kwargs`
    and reasoning effort, given the `allowances` without them; None when nothing but the context does.

    NOTE: vLLM hands the template every kwarg it names, and a kwarg replaces what the template had under that name: a
    template renders `eos_token` or `bos_token` in every message, so 90 bytes of `eos_token` prompted a conversation of
    20 empty messages with ~2,000 tokens against a bound of ~580 (the rest unbilled). A text, a number or a list can be
    rendered in any loop of the template, and a flag can switch on a block of any length (Granite's `thinking: true`:
    970 tokens against a bound of 366). vLLM merges the kwargs with the effort (`build_chat_params`: `reasoning_effort`
    and, unless the kwargs name it, `enable_thinking`), and a template may branch on any combination, so the merged
    dict is bounded only when it is one the engine measured (`protocol.TEMPLATE_KWARG_VARIANTS`): `thinking` with a
    "high" effort, or two flags of different values, were bounded by measures of neither."""
    if not isinstance(kwargs, dict):
        kwargs = {}  # none, or not an object: the engine refuses it
    if not kwargs and effort is None:
        return allowances
    if template_flag_tokens is None or (effort is not None and effort not in REASONING_EFFORTS):
        return None
    merged = dict(kwargs)
    if effort is not None:
        merged["reasoning_effort"] = effort
        merged.setdefault("enable_thinking", effort != "none")
    # NOTE: by type as well as value: `{"thinking": 1}` equals `{"thinking": True}`, and a template may render the 1.
    if not any(merged == variant and all(type(merged[key]) is type(value) for key, value in variant.items())
               for variant in TEMPLATE_KWARG_VARIANTS):
        return None
    return max(allowances[0], template_flag_tokens[0]), max(allowances[1], template_flag_tokens[1])


# A Responses content part's text, by the part's type; any other part (an image) is unbounded.
_RESPONSES_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"})
# The Responses item fields vLLM renders as a message's content parts: a message's `content`, and a function (or
# custom) tool call's `output`, its tool message's content (`vllm/entrypoints/openai/responses/utils.py`).
RESPONSES_PART_FIELDS = ("content", "output")


def _responses_prompt_bound(payload: dict, limit: int, per_conversation: int = TOKENS_PER_CONVERSATION,
                            per_message: int = TOKENS_PER_MESSAGE) -> int:
    """A Responses call's prompt: `instructions` and each `input` item as a message of the chat template, tools,
    the `text` format's schema and the template's own arguments as JSON."""
    items = payload.get("input")
    if not isinstance(items, str | list):
        return UNBOUNDED
    total = per_conversation
    instructions = payload.get("instructions")
    if instructions is not None:
        total += per_message + (_utf8_bytes(instructions, limit - total) if isinstance(instructions, str)
                                else _json_bytes(instructions, limit - total))
    if isinstance(items, str):
        total += per_message + _utf8_bytes(items, max(0, limit - total))
    else:
        for item in items:
            if total >= limit:
                return total
            total += per_message + _responses_item_bytes(item, limit - total)
    for name in ("tools", "tool_choice", "text", "reasoning", "chat_template_kwargs"):
        if payload.get(name) is not None and total < limit:
            total += _json_bytes(payload[name], limit - total)
    if payload.get("tools"):
        total += TOKENS_FOR_TOOLS
    return total


def _responses_item_bytes(item, budget: int) -> int:
    """An input item as the template may render it: a message's text parts as text, a function call's `arguments`
    also parsed (as `_tool_calls_bytes`), anything else as JSON."""
    if not isinstance(item, dict):
        return _json_bytes(item, budget)
    total = 0
    for key, value in item.items():
        if total >= budget:
            return total
        if key in RESPONSES_PART_FIELDS and isinstance(value, list):
            total += _content_bytes(value, budget - total, _responses_part_text)
        elif key == "arguments":
            total += _tool_calls_bytes([{"function": {"arguments": value}}], budget - total)
        elif isinstance(value, str):
            total += _utf8_bytes(value, budget - total)
        elif value is not None:
            total += _json_bytes(value, budget - total)
    return total


def _message_bytes(message, budget: int) -> int:
    if not isinstance(message, dict):
        return _json_bytes(message, budget)
    total = 0
    for key, value in message.items():
        if total >= budget:
            return total
        if key == "content" and isinstance(value, list):
            total += _content_bytes(value, budget - total, _chat_part_text)
        elif key == "tool_calls":
            total += _tool_calls_bytes(value, budget - total)
        elif isinstance(value, str):
            total += _utf8_bytes(value, budget - total)
        elif value is not None:
            total += _json_bytes(value, budget - total)
    return total


def _tool_calls_bytes(tool_calls, budget: int) -> int:
    """A message's tool calls as the template may render them: with each call's `arguments` as sent (a string) or
    as vLLM hands them to templates, parsed, which `tojson` renders with a space after every `,` and `:` (a compact
    list of 600 zeros took ~30 % more tokens rendered than its string counted).

    NOTE: parsed only when the calls as sent are shorter than the budget: arguments past it are at the context
    already, and parsing them would be work past it."""
    as_sent = _json_bytes(tool_calls, budget)
    if not isinstance(tool_calls, list) or as_sent >= budget:
        return as_sent
    parsed, any_parsed = [], False
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
                # NOTE: a JSON string literal too: ASCII "\\ufdfa" escapes parse to text a template renders raw.
                any_parsed = True
            except (ValueError, RecursionError):
                arguments = function["arguments"]
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return max(as_sent, _json_bytes(parsed, budget)) if any_parsed else as_sent


_NOT_TEXT = object()  # a content part that is not text (an image): unbounded


def _chat_part_text(part):
    # NOTE: its kind as the engine reads it, not its `type`: a 'text' part with a `uuid` and an image is an image
    if content_parts.kind_of(part) != "text":
        return _NOT_TEXT
    return part if isinstance(part, str) else part.get("text")


def _responses_part_text(part):
    if isinstance(part, dict) and part.get("type") in _RESPONSES_TEXT_PARTS:
        return part.get("text")
    return _NOT_TEXT


def _content_bytes(parts: list, budget: int, text_of) -> int:
    """A content list: its text parts (`text_of` a part: its text, or `_NOT_TEXT`) as one text joined by "\\n", as vLLM
    joins them, counted in one pass (480,000 parts of "e\\u0301", each normalized apart, took 0.8 s), a part whose
    text is not a string as JSON, any other part as the context, and `TOKENS_PER_PART` each.

    NOTE: the joined count is the parts' own together plus a byte a "\\n": "\\n" neither composes, nor reorders, nor
    decomposes under any normalization, so no part's count changes beside it."""
    total, texts, num_characters = 0, [], 0
    for part in parts:
        if total + num_characters >= budget:
            return total + num_characters
        text = text_of(part)
        if isinstance(text, str):
            texts.append(text)
            num_characters += len(text)
        elif text is _NOT_TEXT:
            total += UNBOUNDED
        else:
            total += _json_bytes(text, budget - total - num_characters)
        total += TOKENS_PER_PART
    return total + _utf8_bytes("\n".join(texts), budget - total) if texts else total


def _tokens_per_prompt() -> int:
    """The special tokens a completions prompt or embedding input gets: `TOKENS_PER_PROMPT`, or the model's own
    post-processor's when it adds more (a tenant's 500 a prompt were counted as 8)."""
    rewrites = _DECOMPOSE_ALLOWANCE.rewrites if _NUM_REWRITING else None
    return TOKENS_PER_PROMPT if rewrites is None else rewrites.tokens_per_prompt


def _completion_prompt_bounds(prompt, limit: int) -> list[int]:
    """One bound per prompt: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [_utf8_bytes(prompt, limit) + _tokens_per_prompt()]
    if not isinstance(prompt, list) or not prompt:
        return [UNBOUNDED]
    if all(_is_token(item) for item in prompt):
        return [len(prompt)]
    bounds = []
    for item in prompt:
        if isinstance(item, str):
            bounds.append(_utf8_bytes(item, limit) + _tokens_per_prompt())
        elif isinstance(item, list) and all(_is_token(token) for token in item):
            bounds.append(len(item))
        else:
            bounds.append(UNBOUNDED)
    return bounds


# The rewrites tokenizers apply before they split (tokenizer.json's `normalizer`): NFC (Qwen's), NFKC (SentencePiece's
# nmt_nfkc, XLM-R's and its embedding models'), and `Lowercase`, alone or after either (CLIP's, served as an embedding
# model). Each can lengthen a text: U+1D160 (4 bytes) is 12 bytes in NFC, U+FDFA (3 bytes) 33 in NFKC, U+0130 (2) 3
# lowercased. A composition is bounded by the decomposition (NFD, NFKD), which composing only shortens, lowercased or
# not (no character a composition yields lowercases longer than its lowercased decomposition), and the decomposition
# of a text is that of its characters, one by one (reordering moves them only); lowercasing is per character too.
TOKENIZER_NORMALIZATIONS = (("NFC", "NFD"), ("NFKC", "NFKD"))
# What is left of the request's allowance of non-ASCII characters to read and decompose (`worst_case` sets it to the
# context; each character read and each one a decomposition yields counts); None outside a request (no limit).
# NOTE: per thread, not a ContextVar (whose set and reset added ~0.35 µs to every request): `worst_case` never awaits,
# so one thread runs one estimate at a time.


class _Allowance(threading.local):
    num_characters: int | None = None
    # What is left of the request's passes over ASCII text to count a rewriting tokenizer's replacements and pieces
    # (characters times `PromptNormalizer.num_ascii_scans`; `_rewritten_worst_case` sets it).
    num_ascii_scans: int = 0
    # What the model's tokenizer adds (`_rewritten_worst_case` sets it for the request); None for most models.
    rewrites: PromptNormalizer | None = None
    num_texts: int = 0  # the texts `_rewritten_bytes` counted for the request so far


_DECOMPOSE_ALLOWANCE = _Allowance()
# A request's passes over ASCII characters to count a rewriting tokenizer's replacements and pieces (~1 ns each): 8 MiB
# of completions prompts to a tokenizer of 14 lowercased replacements and 64 segment starts held the event loop
# 0.13-0.19 s. Past it an ASCII text counts `PromptNormalizer.added_per_ascii_character` a character, unread.
ASCII_SCAN_ALLOWANCE = 16 * 1024 * 1024
# Threads estimating a request whose tokenizer rewrites text now. NOTE: read before the thread's own `rewrites`, so an
# estimate of any other model pays one read of a module's integer, not of a thread's attribute, per text (issue #20).
_NUM_REWRITING = 0
_REWRITING_LOCK = threading.Lock()
# The characters lowercasing lengthens, with the UTF-8 bytes it adds to each (a test recomputes them over every code
# point; scanning them here took the first non-ASCII request of a process 255 ms).
LOWERCASE_GROWTH = (("\u0130", 1), ("\u023a", 1), ("\u023e", 1))
# The most UTF-8 bytes one code point becomes under any of these normalizations, lowercased or not (U+FDFA's NFKD is
# 18 characters, 33 bytes; a test recomputes it): a text past the request's decomposition allowance counts this much a
# character, unread.
MAX_GROWTH = 33
# Characters decomposed at a time: a decomposition is at most 18 characters a character (U+FDFA), so a text past its
# budget is found past it at most one chunk's work later.
_DECOMPOSE_CHARACTERS = 4096


def _utf8_bytes(text: str, budget: int) -> int:
    """At least the UTF-8 bytes of `text` as a tokenizer sees it: as sent, or as a normalizer rewrites it; at least
    `budget` when that is past it.

    NOTE: 150 × U+1D160 (600 bytes) are 1,801 tokens to a byte-level BPE behind NFC, as Qwen's tokenizers are; the
    bound counted 608, and the bill stops at the reservation. ASCII text costs one check (`isascii` reads a flag); text
    already in a form (Unicode's quick check, which stops at the first character not in it) adds only what
    lowercasing adds; other text counts its decomposition, a chunk at a time, until that reaches the budget. A text of
    `budget` characters or more is past the budget unread (each character is a byte at least): 8 MiB of U+FDFA took
    7 s to normalize whole. Every character read and decomposed is taken from the request's allowance
    (`_DECOMPOSE_ALLOWANCE`); a text it cannot pay for counts `MAX_GROWTH` bytes a character, unread."""
    if _NUM_REWRITING and _DECOMPOSE_ALLOWANCE.rewrites is not None:
        return _rewritten_bytes(text, budget, _DECOMPOSE_ALLOWANCE.rewrites)
    if text.isascii():
        return len(text)
    if len(text) >= budget:
        return len(text)
    unread = min(budget, MAX_GROWTH * len(text))
    allowance = _DECOMPOSE_ALLOWANCE
    if allowance.num_characters is not None:
        if allowance.num_characters < len(text):
            return unread
        allowance.num_characters -= len(text)
    size = len(text.encode("utf-8", "surrogatepass"))  # NOTE: JSON may carry lone surrogates
    longest = size + _lowercase_adds(text)
    for form, decomposed in TOKENIZER_NORMALIZATIONS:
        if not unicodedata.is_normalized(form, text):
            counted = _decomposed_bytes(text, decomposed, budget)
            if counted is None:
                return unread
            longest = max(longest, counted)
    return longest


def _rewritten_bytes(text: str, budget: int, rewrites: PromptNormalizer) -> int:
    """`_utf8_bytes` of a text to a model whose tokenizer rewrites it (`normalizers.PromptNormalizer`): its bytes, or
    its decomposition's (always, for a tokenizer that decomposes; else as `_utf8_bytes` counts them), plus what the
    replacements, prepends and spaces add. ASCII text decomposes to itself: only what replacements and prepends add."""
    _DECOMPOSE_ALLOWANCE.num_texts += 1
    if len(text) >= budget:
        return len(text)
    if text.isascii():
        if not rewrites.rewrites_ascii:
            return len(text)
        allowance = _DECOMPOSE_ALLOWANCE
        allowance.num_ascii_scans -= len(text) * rewrites.num_ascii_scans
        if allowance.num_ascii_scans < 0:
            return min(budget, len(text) * (1 + rewrites.added_per_ascii_character()) + rewrites.prepend_bytes)
        return len(text) + rewrites.added_bytes(text)
    unread = min(budget, (MAX_GROWTH + rewrites.added_per_character()) * len(text) + rewrites.prepend_bytes)
    allowance = _DECOMPOSE_ALLOWANCE
    if allowance.num_characters is not None:
        if allowance.num_characters < len(text):
            return unread
        allowance.num_characters -= len(text)
    longest = len(text.encode("utf-8", "surrogatepass")) + _lowercase_adds(text)
    counts_decomposed = rewrites.counts_decomposed
    for form, decomposed in TOKENIZER_NORMALIZATIONS:
        if rewrites.decomposes or counts_decomposed or not unicodedata.is_normalized(form, text):
            counted = _decomposed_bytes(text, decomposed, budget, rewrites if counts_decomposed else None)
            if counted is None:
                return unread
            longest = max(longest, counted)
    added = rewrites.added_bytes(text, decomposed_apart=counts_decomposed)
    if rewrites.bytes_per_non_ascii:
        added += rewrites.bytes_per_non_ascii * (len(text) - len(text.encode("ascii", "ignore")))
    return longest + added


def _decomposed_bytes(text: str, form: str, budget: int, rewrites: PromptNormalizer | None = None) -> int | None:
    """The UTF-8 bytes of `text` decomposed, and lowercased (which only lengthens), counted until they reach `budget`;
    None when the characters a decomposition yields exhaust the request's allowance. With `rewrites`, plus what its
    replacements that run after a normalization add to the decomposition."""
    allowance = _DECOMPOSE_ALLOWANCE
    total = 0
    for start in range(0, len(text), _DECOMPOSE_CHARACTERS):
        if total >= budget:
            break
        decomposition = unicodedata.normalize(form, text[start:start + _DECOMPOSE_CHARACTERS])
        total += len(decomposition.encode("utf-8", "surrogatepass")) + _lowercase_adds(decomposition)
        if rewrites is not None:
            total += rewrites.rewritten_added_bytes(decomposition)
        if allowance.num_characters is not None:
            allowance.num_characters -= len(decomposition)
            if allowance.num_characters < 0:
                return None
    return total


def _lowercase_adds(text: str) -> int:
    return sum(text.count(character) * added for character, added in LOWERCASE_GROWTH)


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_bytes(value, budget: int) -> int:
    """Bytes of `value` as indented JSON, each string ASCII-escaped or as a tokenizer sees it unescaped
    (`_utf8_bytes`), whichever is longer: at least what a template's `tojson` renders (Jinja's escapes, Hugging Face's
    does not). Walked, never dumped whole, and only until it reaches `budget`.

    To a model whose tokenizer rewrites ASCII (`normalizers`), what its replacements and pieces add is counted per
    string and per separator the walk writes (the JSON's own first piece prepended once): before, as if every byte of
    it began an occurrence, 8 small tools reserved a Llama-2-style model's whole 32k context."""
    rewrites = _DECOMPOSE_ALLOWANCE.rewrites if _NUM_REWRITING else None
    if rewrites is not None and not rewrites.rewrites_ascii:
        rewrites = None
    try:
        counted = _json_walk(value, budget, 0, rewrites)
    except (TypeError, ValueError, RecursionError):
        return UNBOUNDED
    return counted + (rewrites.prepend_bytes if rewrites is not None else 0)


def _json_walk(value, budget: int, depth: int, rewrites: PromptNormalizer | None) -> int:
    if isinstance(value, str):
        return _json_string_bytes(value, budget, rewrites)
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = value
    elif value is None or isinstance(value, bool | int | float):
        literal = json.dumps(value)
        return len(literal) + (rewrites.added_to_part(literal) if rewrites is not None else 0)
    else:
        return _json_string_bytes(str(value), budget, rewrites)  # as `default=str`
    if not items:
        return 2 + (rewrites.added_to_part("[]{}") if rewrites is not None else 0)
    # "[" or "{", then each item on its own line indented one level deeper, "," between, the closing one level up
    total = 2 + JSON_INDENT * depth + 1
    # NOTE: what a rewriting tokenizer adds to the separators this walk writes, counted on them as written
    separator = "\n" + " " * (JSON_INDENT * (depth + 1)) + ","
    separator_added = rewrites.added_to_part(separator) if rewrites is not None else 0
    if rewrites is not None:
        total += rewrites.added_to_part("[{" + "\n" + " " * (JSON_INDENT * depth) + "]}")
    for item in items:
        if total >= budget:
            return total
        total += 1 + JSON_INDENT * (depth + 1) + 1 + separator_added  # newline, indent, "," (one too many: loose)
        if isinstance(value, dict):
            key, item = item
            if not isinstance(key, str):
                if key is not None and not isinstance(key, bool | int | float):
                    raise TypeError("keys must be str, int, float, bool or None")
                key = json.dumps(key)
            total += _json_string_bytes(key, budget - total, rewrites) + 2  # ": "
            if rewrites is not None:
                total += rewrites.added_to_part(": ")
        total += _json_walk(item, budget - total, depth + 1, rewrites)
    return total


def _json_string_bytes(text: str, budget: int, rewrites: PromptNormalizer | None = None) -> int:
    if len(text) >= budget:
        return len(text)
    escaped = json.dumps(text)
    if rewrites is not None:
        _DECOMPOSE_ALLOWANCE.num_ascii_scans -= len(escaped) * rewrites.num_ascii_scans
        escaped_bytes = len(escaped) + (
            rewrites.added_to_part(escaped)
            if _DECOMPOSE_ALLOWANCE.num_ascii_scans >= 0
            else len(escaped) * rewrites.added_per_ascii_character()
        )
    else:
        escaped_bytes = len(escaped)
    if text.isascii():
        return escaped_bytes
    return max(escaped_bytes, _utf8_bytes(json.dumps(text, ensure_ascii=False), budget))


# --- numbers as the engine reads them ------------------------------------------------------------

def _as_int(value) -> int | None:
    """An integer as pydantic's lax mode reads one (3, 3.0, "3"), else None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float | str):
        try:
            number = Decimal(value.strip() if isinstance(value, str) else value)
        except (InvalidOperation, ValueError):
            return None
        if number.is_finite() and number == number.to_integral_value():
            return int(number)
    return None


def _first_int(*values) -> int | None:
    """The first value present, as an integer; None when none is present (or it is unreadable)."""
    for value in values:
        if value is not None:
            return _as_int(value)
    return None
