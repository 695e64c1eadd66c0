"""The OpenAI wire format both OpenAI servers speak (the cloud router's server-only modes, the
edge's local server): :mod:`.request` parses and validates a request, :mod:`.response` shapes the
answer (whole or SSE), :mod:`.vllm` answers vLLM's /tokenize, /detokenize, /version. Pure package.

Used as ``from specdec import openai as oai``: the names below are the public API.
"""

from specdec.openai.request import (IGNORED_FIELDS_HEADER, CompletionRequest, chat_message, chat_prompt, check_model,
                                    check_sampling, completion_prompt, ignored_warning, parse_completion)
from specdec.openai.response import (Round, TextDelta, TextStream, completion_response, find_stop, logprobs_object,
                                     model_card, model_list, sse, stop_prefix_len, stream_chunk, texts, usage,
                                     usage_chunk, whole_response)
from specdec.openai.vllm import detokenize, server_version, tokenize

__all__ = ["IGNORED_FIELDS_HEADER", "CompletionRequest", "Round", "TextDelta", "TextStream", "chat_message",
           "chat_prompt", "check_model", "check_sampling", "completion_prompt", "completion_response", "detokenize",
           "find_stop", "ignored_warning", "logprobs_object", "model_card", "model_list", "parse_completion",
           "server_version", "sse", "stop_prefix_len", "stream_chunk", "texts", "tokenize", "usage", "usage_chunk",
           "whole_response"]
