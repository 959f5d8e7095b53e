"""OpenAI's Responses API (/v1/responses), stateless: its request shapes mapped onto the chat
path (protocol.py, translate.py) and the answer written as a Response object or as the
documented stream of events (events.py). Nothing is stored.
"""
