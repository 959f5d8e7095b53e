"""A structured-output constraint as an llguidance grammar, and whether that grammar compiles.

Needs llguidance only (no tokenizer, no torch): the engine checks every constraint here when a
request arrives, so that a bad schema, regex or grammar is refused by name before it is
scheduled. Compiling against the model's tokenizer is engine/structured_output.py's job; this
module never touches a model.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import llguidance

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:  # declared in llguidance's type stubs only
    from llguidance._lib import JsonCompileOptions

# How JSON is written under a schema: compact, with json.dumps' separators, so a bounded schema
# bounds the number of tokens (free whitespace lets a sampled model pad forever). A schema's
# "x-guidance" key overrides these.
JSON_FORMAT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def llguidance_grammar(constraint: StructuredOutput) -> str:
    """The constraint (validated: exactly one kind set) as an llguidance grammar; ValueError
    if it cannot be built."""
    if constraint.json is not None:
        try:
            schema = json.loads(constraint.json)
        except ValueError as exc:
            raise ValueError(f"the schema is not valid JSON ({exc})") from None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
    if constraint.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_FORMAT
        )
    if constraint.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if constraint.choice is not None:
        # JSON string literals are Lark string literals.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert constraint.grammar is not None  # the one kind left
    return llguidance.grammar_from("grammar", constraint.grammar)


def check_grammar(constraint: StructuredOutput) -> None:
    """Raise InvalidRequestError, its message starting with the constraint's label and its
    param the constraint's source, unless the constraint is well formed and its grammar
    compiles: the error names the field the constraint came in."""
    constraint.validate()
    problem = _grammar_problem(constraint)
    if problem:
        raise InvalidRequestError(
            f"{constraint.label} has an invalid {constraint.DESCRIPTIONS[constraint.kind]}: "
            f"{problem}",
            constraint.source,
        )


@functools.lru_cache(maxsize=1024)
def _grammar_problem(constraint: StructuredOutput) -> str:
    """Why the constraint does not compile, or "" (cached: a constraint is often sent again)."""
    try:
        grammar = llguidance_grammar(constraint)
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0].strip() if is_error else ""


def validate_sampling_params(params: SamplingParams, vocab_size: int | None = None) -> None:
    """SamplingParams.validate, then the grammar of its constraint: ValueError naming the first
    bad parameter (an InvalidRequestError with its param for a labelled constraint)."""
    params.validate(vocab_size)
    if params.structured_output is not None:
        check_grammar(params.structured_output)
