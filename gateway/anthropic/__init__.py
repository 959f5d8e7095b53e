"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), stateless: its shapes
(protocol.py), the request mapped onto the chat path and the answer back (translate.py), the
whole Message or its event stream (events.py); and its Message Batches (/v1/messages/batches,
batches.py), run as batch jobs.
"""
