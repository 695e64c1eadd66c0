"""The edge process: server-mode chunk counting."""

import pytest

from benchmarks.edge_proc import Edge


def test_server_chunks_are_rounds_and_counts_add_up():
    e = Edge()  # no tokenizer: equal split
    c = e._server_counts([(0.0, ""), (0.1, ""), (0.3, ""), (0.4, "")], n=7, mode="sd")
    assert c["rounds"] == 3 and sum(n for _, n in c["arrivals"]) == pytest.approx(7)
    ar = e._server_counts([(0.0, "a"), (0.1, "b"), (0.2, "c")], n=3, mode="ar")
    assert ar["rounds"] == 2 and [n for _, n in ar["arrivals"]] == [1, 1.0, 1.0]


def test_a_429_is_retried_after_its_retry_after_and_another_error_raises():
    import asyncio

    import httpx

    from benchmarks.edge_proc import _sse_events

    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {"reason": "open_deadline"}})
        if len(calls) == 2:
            return httpx.Response(200, text='data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
        return httpx.Response(500, text="boom")

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as c:
            got = [d async for d in _sse_events(c, {"prompt": [1]})]
            with pytest.raises(RuntimeError, match="500"):
                [d async for d in _sse_events(c, {"prompt": [1]})]
            return got

    assert asyncio.run(main()) == [{"choices": [{"text": "a"}]}] and len(calls) == 3
