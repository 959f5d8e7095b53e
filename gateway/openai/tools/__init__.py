"""Tool calling: the tool definitions a request brings, how they reach the model (its chat
template, or the generic format's system message), the grammar that keeps forced calls valid,
and the parsers that read calls back out of the generated text.

Pure translation on the gateway side: grammars are built here as text and compiled only by the
engine; nothing in this package imports the engine or llguidance, or talks to a service.
"""
