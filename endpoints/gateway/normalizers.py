"""How a model's tokenizer lengthens text before it splits it, as the gateway's prompt bound counts it.

The estimate (`endpoints.gateway.estimate`) bounds a prompt's tokens by its UTF-8 bytes after normalization, and
models NFC, NFKC and lowercasing for every model. Some tokenizers do more, and an agent reports what its model's
tokenizer.json says (`protocol.TokenizerNormalizer`, kept in `ModelFacts.tokenizer_normalizer`); this module turns that
into what the estimate adds, once per endpoint as the gateway loads it (`directory`), never per request:

- NFD or NFKD ("decompose"): text already composed is lengthened too ("가", 3 bytes, is 9 as jamo), so every non-ASCII
  text counts its decomposition, not only one that is not in NFC or NFKC.
- `Replace` of a literal pattern: what each occurrence adds (its content, decomposed and lowercased if that is longer,
  less the pattern), counted per occurrence in the text as sent, or decomposed and lowercased when a normalization or
  lowercasing runs before it (which can make occurrences: NFKD of U+FDFA holds three spaces).
- `Prepend`: its content per text, and per piece the tokenizer splits the text into at its added tokens.
- a `Metaspace` pre-tokenizer (Mistral's, XLM-R's, T5's): the agent reports it as the `Replace(" ", "▁")` and
  `Prepend("▁")` it makes, after the normalizer's steps.
- BERT's spaces either side of a CJK ideograph: two bytes per non-ASCII character.

NOTE: a step whose growth cannot be bounded this way reserves the context (`unbounded`): an unknown normalizer type,
a regular expression replaced by content (one matching nothing lengthens every position), or a replacement whose
pattern an earlier step can make (its characters in an earlier replacement's or prepend's content, a multi-character
pattern after a step that deletes, a non-ASCII pattern after a normalization). A model whose agent reported nothing
(`None`) is counted as before; so is one whose normalizer adds nothing (NFC, NFKC, lowercase, strip).

NOTE: a SentencePiece `Precompiled` character map (T5's, XLM-R's) is known only as one of sentencepiece's own (nmt_nfkc,
nmt_nfkc_cf, identity, by the hash of its bytes, in the agent): NFKC, lowercased for _cf, whose whitespace and a few
format characters become spaces ("spaces", as BERT's clean-up makes them); a tenant's own map, which could send a
character to anything, is unknown.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from gpu_agent.protocol import MAX_DIFFERING_TOKENIZERS, TokenizerNormalizer

# The most characters one code point decomposes to (U+FDFA's NFKD, 18), and the most ideographs (U+337F's NFKD,
# "株式会社"): a text past the request's allowance is counted this much a character, unread.
MAX_DECOMPOSED_CHARACTERS = 18
MAX_DECOMPOSED_IDEOGRAPHS = 4
CJK_SPACE_BYTES = 2  # " " either side
# Special tokens counted for each completions prompt and embedding input (BOS/EOS) for every model; a tokenizer whose
# post-processor adds more is counted for its own (`PromptNormalizer.tokens_per_prompt`).
TOKENS_PER_PROMPT = 8
MAX_COUNTED_SEGMENT_STARTS = 8  # added tokens' first characters a prepend's pieces are counted by
# A regular expression read as one character repeated at least n times (XLM-R's `" {2,}"` by " "): the one kind whose
# replacement is bounded, by its shortest match. NOTE: never compiled: a tenant's pattern is only matched as text here.
_REPETITION = re.compile(r"^(\\?[^\\()\[\]{}|.*+?^$])(?:\{(\d{1,4}),\d{0,4}\}|(\+))$")


@dataclass(slots=True, frozen=True)
class PromptNormalizer:
    """What a model's tokenizer adds to a text's bytes beyond what the estimate counts for every model."""

    decomposes: bool = False  # every non-ASCII text counts its decomposition
    # Literal replacements that lengthen: (pattern, bytes each occurrence adds, whether a normalization runs before it,
    # whether lowercasing does). After a normalization, occurrences are counted in the decomposed text (a non-ASCII
    # one's, by `rewritten_added_bytes`); after lowercasing, in the text as it is and lowercased, both.
    replacements: tuple[tuple[str, int, bool, bool], ...] = ()
    prepend_bytes: int = 0  # per text, and per piece after an added token
    segment_starts: str = ""  # the first characters of the added tokens that start a piece
    bytes_per_non_ascii: int = 0  # added per non-ASCII character (BERT's spaces around ideographs)
    # Added per character: a pre-tokenizer's prepend after a split, which may make a piece of every character.
    bytes_per_character: int = 0
    tokens_per_prompt: int = TOKENS_PER_PROMPT  # the special tokens a sequence gets, at least TOKENS_PER_PROMPT
    unbounded: str = ""  # why nothing but the context bounds a prompt; "" when the above does
    # Of a copy whose replicas read tokenizers that differ (`endpoints.models.differing_tokenizers`): each one's (None:
    # one that adds nothing), the above unused; each prompt is bounded by the largest of theirs (`estimate.worst_case`).
    alternatives: tuple[PromptNormalizer | None, ...] = ()

    @property
    def rewrites_ascii(self) -> bool:
        return bool(self.replacements or self.prepend_bytes or self.bytes_per_character)

    @property
    def counts_decomposed(self) -> bool:
        return any(normalized for _, _, normalized, _ in self.replacements)

    def added_bytes(self, text: str, *, decomposed_apart: bool = False) -> int:
        """What the replacements and prepends add to `text`; `decomposed_apart`: leave out the replacements after a
        normalization (`rewritten_added_bytes` counts them in the text's decomposition)."""
        return self.prepend_bytes + self.added_within(text, decomposed_apart=decomposed_apart)

    def added_within(self, text: str, *, decomposed_apart: bool = False) -> int:
        """`added_bytes` but the prepend of `text`'s own first piece: the replacements, and the prepends of the
        pieces that start inside it (a part of a larger text: a JSON string inside a rendered tool list)."""
        added = 0
        if self.bytes_per_character:
            # NOTE: a non-ASCII character may become up to 18 before the pre-tokenizer splits (a normalization)
            num_characters = len(text)
            if not text.isascii():
                num_characters += (MAX_DECOMPOSED_CHARACTERS - 1) * (
                    len(text) - len(text.encode("ascii", "ignore"))
                )
            added += self.bytes_per_character * num_characters
        for pattern, growth, normalized, lowercased in self.replacements:
            if not (decomposed_apart and normalized):
                added += growth * text.count(pattern)
                if lowercased:
                    added += growth * text.lower().count(pattern)
        if self.prepend_bytes:
            for start in self.segment_starts:
                added += self.prepend_bytes * text.count(start)
        return added

    def added_to_part(self, text: str) -> int:
        """`added_within` of a part of a larger text, with one more occurrence of each pattern longer than a
        character, which may straddle the part's start."""
        straddling = sum(
            growth * (2 if lowercased else 1)
            for pattern, growth, _, lowercased in self.replacements
            if len(pattern) > 1
        )
        return self.added_within(text) + straddling

    @property
    def num_ascii_scans(self) -> int:
        """The passes `added_bytes` makes over an ASCII text (each replacement, lowercased too; each segment start)."""
        return sum(2 if lowercased else 1 for *_, lowercased in self.replacements) + (
            len(self.segment_starts) if self.prepend_bytes else 0
        )

    def added_per_ascii_character(self) -> int:
        """The most bytes one ASCII character can gain (a text past the request's scans, unread)."""
        return (
            sum(growth * (2 if lowercased else 1) for _, growth, _, lowercased in self.replacements)
            + (self.prepend_bytes if self.segment_starts else 0)
            + self.bytes_per_character
        )

    def rewritten_added_bytes(self, decomposed: str) -> int:
        """What the replacements after a normalization add to a piece of a text's decomposition (one more occurrence
        of a pattern longer than a character, at each of the piece's ends: one may straddle it)."""
        added = 0
        for pattern, growth, normalized, lowercased in self.replacements:
            if normalized:
                count = decomposed.count(pattern) + (decomposed.lower().count(pattern) if lowercased else 0)
                added += growth * (count + 2 * (len(pattern) > 1))
        return added

    def added_per_character(self) -> int:
        """The most bytes one character can gain besides its decomposition (a text past the allowance, unread)."""
        per_occurrence = sum(growth for _, growth, _, _ in self.replacements)
        return (
            2
            * MAX_DECOMPOSED_CHARACTERS
            * (per_occurrence + (self.prepend_bytes if self.segment_starts else 0) + self.bytes_per_character)
            + self.bytes_per_non_ascii
        )


def prompt_normalizer(description: dict | None) -> PromptNormalizer | None:
    """What the estimate adds for a model whose agent described its tokenizer's normalizer (`description`:
    `protocol.TokenizerNormalizer.to_dict()`); None when nothing (no description, or a normalizer that adds nothing
    the estimate does not already count)."""
    if description is None:
        return None
    alternatives = description.get("alternatives") if isinstance(description, dict) else None
    if isinstance(alternatives, list) and 1 < len(alternatives) <= MAX_DIFFERING_TOKENIZERS:
        each = tuple(prompt_normalizer(one) if isinstance(one, dict) and "alternatives" not in one else
                     PromptNormalizer(unbounded="an unreadable description") for one in alternatives)
        if not any(one is not None and one.unbounded for one in each):
            return PromptNormalizer(alternatives=each)
    # NOTE: else (and to a gateway that reads no `alternatives`) the description says the tokenizers differ: unknown.
    try:
        normalizer = TokenizerNormalizer.from_dict(description)
    except (ValueError, TypeError):
        return PromptNormalizer(unbounded="an unreadable description")
    if normalizer.unknown:
        return PromptNormalizer(unbounded=normalizer.unknown)
    decomposes = deletes = False
    normalized = lowercased = False  # a normalization ran before; lowercasing did
    made = set()  # characters an earlier step may insert
    # Characters an earlier step may turn into a space (BERT's clean-up, sentencepiece's nmt maps).
    spaced: set[str] = set()
    replacements: list[tuple[str, int, bool, bool]] = []
    prepend_bytes = bytes_per_non_ascii = bytes_per_character = 0
    for step in normalizer.steps:
        if step.kind in ("compose", "decompose"):
            decomposes |= step.kind == "decompose"
            normalized = True
        elif step.kind == "lowercase":
            lowercased = True
        elif step.kind == "shortens":
            deletes = True
        elif step.kind == "spaces":
            spaced.update(step.pattern)
        elif step.kind == "cjk_spaces":
            bytes_per_non_ascii += CJK_SPACE_BYTES * (MAX_DECOMPOSED_IDEOGRAPHS if normalized else 1)
            made.add(" ")
        elif step.kind == "prepend":
            prepend_bytes += _longest_bytes(step.content)
            made.update(step.content)
        elif step.kind == "prepend_each":
            bytes_per_character += _longest_bytes(step.content)
            made.update(step.content)
        elif step.kind == "replace_regex":
            repeated = _repeated_character(step.pattern)
            if step.content and (repeated is None or _regex_growth(repeated, step.content) > 0):
                return PromptNormalizer(unbounded=f"a regular expression replaced by {step.content[:20]!r}")
            deletes = True
            if set(step.content) - {repeated[0] if repeated else ""}:
                made.update(step.content)  # NOTE: a run made shorter of the same character makes none of it
        elif step.kind == "replace":
            pattern = step.pattern
            if not pattern:
                return PromptNormalizer(unbounded="an empty pattern replaced")
            if (
                made.intersection(pattern)
                or (deletes and len(pattern) > 1)
                or ((normalized or lowercased) and not pattern.isascii())
            ):
                return PromptNormalizer(
                    unbounded=f"a replacement of {pattern[:20]!r} an earlier step can make"
                )
            if spaced and " " in pattern and pattern != " ":
                return PromptNormalizer(
                    unbounded=f"a replacement of {pattern[:20]!r} an earlier step can make"
                )
            # NOTE: a space an earlier step made of another character is replaced too: each such character counts
            # as an occurrence of its own ("\n" by BERT's clean-up, then " " by "▁": 1 byte to 3).
            for source in [pattern] + (sorted(spaced) if pattern == " " else []):
                growth = _longest_bytes(step.content) - len(source.encode("utf-8", "surrogatepass"))
                if growth > 0:
                    replacements.append((source, growth, normalized, lowercased))
            if len(step.content) < len(pattern):
                deletes = True
            made.update(step.content)
    if prepend_bytes and len(normalizer.segment_starts) > MAX_COUNTED_SEGMENT_STARTS:
        # NOTE: each is a pass over every ASCII text (64 of them held the event loop 0.18 s for an 8 MiB body)
        return PromptNormalizer(
            unbounded=f"added tokens with more than {MAX_COUNTED_SEGMENT_STARTS} first characters to count pieces by"
        )
    tokens_per_prompt = max(TOKENS_PER_PROMPT, normalizer.num_special_tokens)
    if not (
        decomposes
        or replacements
        or prepend_bytes
        or bytes_per_non_ascii
        or bytes_per_character
        or tokens_per_prompt > TOKENS_PER_PROMPT
    ):
        return None
    return PromptNormalizer(
        decomposes=decomposes,
        replacements=tuple(replacements),
        prepend_bytes=prepend_bytes,
        segment_starts=normalizer.segment_starts if prepend_bytes else "",
        bytes_per_non_ascii=bytes_per_non_ascii,
        bytes_per_character=bytes_per_character,
        tokens_per_prompt=tokens_per_prompt,
    )


def _repeated_character(pattern: str) -> tuple[str, int] | None:
    """(the character, the fewest times) of a regular expression that matches one character repeated; None for any
    other (a class such as \\s or \\d is not a character)."""
    match = _REPETITION.match(pattern)
    if match is None or (match[1].startswith("\\") and match[1][-1].isalnum()):
        return None
    return match[1][-1], 1 if match[3] else int(match[2])


def _regex_growth(repeated: tuple[str, int], content: str) -> int:
    """The most bytes replacing one match of a character repeated by `content` adds (its shortest match: fewest)."""
    character, fewest = repeated
    return _longest_bytes(content) - fewest * len(character.encode("utf-8", "surrogatepass"))


def _longest_bytes(text: str) -> int:
    """The UTF-8 bytes of `text` as it may end up after any later step: as written, decomposed, lowercased."""
    forms = [text] + [unicodedata.normalize(form, text) for form in ("NFD", "NFKD")]
    forms += [form.lower() for form in forms]
    forms += [unicodedata.normalize("NFKD", form) for form in forms]
    return max(len(form.encode("utf-8", "surrogatepass")) for form in forms)
