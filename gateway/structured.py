"""Structured output over HTTP: OpenAI's `response_format`, vLLM's `structured_outputs` and its
older `guided_json` / `guided_regex` / `guided_choice` fields become the engine's
StructuredOutput, checked here so that a bad schema, regex or grammar is a 400 naming the field
it came in.

Translation and validation only: grammars are compiled against the model's tokenizer by the
engine, never here.
"""

from __future__ import annotations

from common.sampling_params import StructuredOutput
from engine.grammar import check_grammar
from gateway import protocol as api

# vLLM's older fields and the kind each one sets.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}


def structured_output(body: api.SamplingFields) -> StructuredOutput | None:
    """The request's constraint, if it sets one; InvalidParameter naming the field otherwise."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.response_format is not None and body.response_format.type != "text":
        found.append(("response_format", _from_response_format(body.response_format)))
    if body.structured_outputs is not None:
        fields = body.structured_outputs
        found.append(
            (
                "structured_outputs",
                StructuredOutput(
                    json=fields.json_schema,
                    regex=fields.regex,
                    choice=fields.choice,
                    grammar=fields.grammar,
                    json_object=bool(fields.json_object),
                ),
            )
        )
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, StructuredOutput(**{kind: value})))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise api.InvalidParameter(f"{names} both constrain the output: set only one", found[1][0])
    name, constraint = found[0]
    try:
        check_grammar(constraint, name)
    except ValueError as exc:
        raise api.InvalidParameter(str(exc), name) from None
    return constraint


def _from_response_format(response_format: api.ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise api.InvalidParameter(
            "response_format of type json_schema needs json_schema.schema", "response_format"
        )
    # strict is implied: the grammar admits only what the schema does.
    return StructuredOutput(json=spec.json_schema)
