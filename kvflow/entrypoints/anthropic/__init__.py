"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the engine's
chat path: a request becomes the chat template's conversation and the tool-call format's constraint,
the output text becomes content blocks. See docs/api/anthropic.md."""
