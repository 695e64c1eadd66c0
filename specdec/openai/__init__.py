"""The OpenAI wire format both OpenAI servers speak (router, edge): :mod:`.request` parses, :mod:`.response` shapes the
answer, :mod:`.vllm` answers /tokenize, /detokenize, /version. Pure; used as ``from specdec import openai as oai``."""

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
