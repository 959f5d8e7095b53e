"""Structured output over HTTP: OpenAI's `response_format`, vLLM's `structured_outputs` and its
older `guided_json` / `guided_regex` / `guided_choice` fields become the engine's
StructuredOutput, labelled with the field it came in (its `source`), so that the engine's
refusal of a bad schema, regex or grammar is a 400 naming that field.

Translation and shape checks only: whether a grammar compiles is the engine's to say (it
compiles each one once); this module never imports the engine or llguidance.
"""

from __future__ import annotations

import json
from typing import Any

from common.sampling_params import StructuredOutput
from gateway.openai import protocol as api

# vLLM's older fields and the kind each one sets.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}


def structured_output(body: api.SamplingFields) -> StructuredOutput | None:
    """The request's constraint, labelled with its field, if it sets one; InvalidParameter
    naming the field when it sets two or one of the wrong shape."""
    found: list[StructuredOutput] = []
    if body.response_format is not None and body.response_format.type != "text":
        found.append(_from_response_format(body.response_format))
    if body.structured_outputs is not None:
        fields = body.structured_outputs
        found.append(
            StructuredOutput(
                json=_schema_text(fields.json_schema),
                regex=fields.regex,
                choice=None if fields.choice is None else tuple(fields.choice),
                grammar=fields.grammar,
                json_object=bool(fields.json_object),
                source="structured_outputs",
            )
        )
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            found.append(StructuredOutput(**{kind: value}, source=name))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(c.label for c in found)
        raise api.InvalidParameter(
            f"{names} both constrain the output: set only one", found[1].label
        )
    constraint = found[0]
    try:
        constraint.validate()
    except ValueError as exc:
        raise api.InvalidParameter(str(exc), constraint.label) from None
    return constraint


def _from_response_format(response_format: api.ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput(json_object=True, source="response_format")
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise api.InvalidParameter(
            "response_format of type json_schema needs json_schema.schema", "response_format"
        )
    # strict is implied: the grammar admits only what the schema does.
    return StructuredOutput(json=_schema_text(spec.json_schema), source="response_format")


def _schema_text(schema: dict[str, Any] | str | None) -> str | None:
    return json.dumps(schema) if isinstance(schema, dict) else schema
