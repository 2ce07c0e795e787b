"""The client side shared by the endpoint audit and the load generator: one streamed answer folded from its
Server-Sent Events (``StreamedAnswer``), and the endpoint audit's settings checked before anything is sent."""

import json

import pytest

from batchspec.audit.endpoint import SELF, EndpointAudit, audit_endpoint
from batchspec.serve.client import AnswerError, StreamedAnswer, StreamError, api_base, prompt_field


def event(msg) -> str:
    return "data: " + json.dumps(msg)


def test_a_stream_folds_into_its_tokens_text_and_first_output():
    answer = StreamedAnswer()
    assert not answer.feed(": a comment") and not answer.feed("")
    assert not answer.feed(event({"choices": [{"delta": {"role": "assistant"}, "prompt_token_ids": [1, 2]}]}))
    assert answer.first is None  # a chunk without output is not the first token
    assert not answer.feed(event({"choices": [{"delta": {"content": "ab"}, "token_ids": [7, 8],
                                               "logprobs": {"tokens": ["token_id:7", "token_id:8"]}}]}))
    first = answer.first
    assert first is not None
    assert not answer.feed(event({"choices": [{"text": "c", "token_ids": [9], "finish_reason": "stop"}]}))
    assert not answer.feed(event({"choices": [], "usage": {"completion_tokens": 3}}))
    assert answer.feed("data: [DONE]") and answer.done
    assert answer.first == first
    assert answer.token_chunks == [[7, 8], [9]] and answer.logprob_chunks[1] is None
    assert "".join(answer.texts) == "abc" and answer.text_chunks == 2
    assert answer.prompt_ids == [1, 2] and answer.finish_reason == "stop" and answer.usage == {"completion_tokens": 3}


def test_strict_streams_need_choices_and_error_events_raise():
    with pytest.raises(AnswerError, match="no choice in the answer"):
        StreamedAnswer().feed(event({"usage": {"completion_tokens": 1}}))
    lenient = StreamedAnswer(strict=False)
    assert not lenient.feed(event({"usage": {"completion_tokens": 1}})) and lenient.usage == {"completion_tokens": 1}
    for strict in (True, False):
        with pytest.raises(StreamError) as e:
            StreamedAnswer(strict=strict).feed(event({"error": {"message": "out  of\nmemory"}}))
        assert e.value.error == {"message": "out  of\nmemory"}
        assert str(e.value) == 'error event: {"message": "out of\\nmemory"}'


def test_request_parts():
    assert api_base("http://h:1/") == api_base("http://h:1/v1") == "http://h:1/v1"
    assert prompt_field("chat", "hi") == {"messages": [{"role": "user", "content": "hi"}]}
    assert prompt_field("completions", (1, 2)) == {"prompt": [1, 2]}


def test_endpoint_audit_settings_are_checked_before_anything_is_sent():
    """The default reference is the server itself; bad settings fail before a request (the URL answers nothing)."""
    audit = EndpointAudit("http://127.0.0.1:9", prompts=tuple("abcd"), concurrency=("1", 4)).checked()
    assert audit.reference == SELF and audit.concurrency == [1, 4] and audit.prompts == list("abcd")
    one = EndpointAudit("http://127.0.0.1:9", prompts=("a",), concurrency=("1", 4)).checked()
    assert one.concurrency == [1] and list(one.capped) == [4]  # no more requests under way than there are prompts
    assert EndpointAudit("http://127.0.0.1:9", target="t", prompts=["a"]).checked().reference is None
    for bad, match in (({"concurrency": [0]}, "concurrency"), ({"prompts": []}, "no prompts"),
                       ({"api": "edit"}, "api"), ({"max_tokens": 0}, "max_tokens"), ({"reference": " "}, "reference"),
                       ({"top_logprobs": True}, "top_logprobs"), ({"timeout": 0}, "timeout")):
        with pytest.raises(ValueError, match=match):
            audit_endpoint("http://127.0.0.1:9", **{"prompts": ["a"], **bad})
    with pytest.raises(TypeError):
        audit_endpoint("http://127.0.0.1:9", prompts=["a"], concurrency_levels=[1])


def test_a_streamed_answer_times_its_first_output_and_its_longest_gap(monkeypatch):
    """``first``: when the first output came (the role-only chunk before it does not count); ``gap``: the longest
    wait between two outputs after it (what a stream held back by other requests' prefill shows)."""
    from batchspec.serve import client

    clock = iter([1.0, 1.5, 4.0, 4.25])
    monkeypatch.setattr(client.time, "perf_counter", lambda: next(clock))
    a = StreamedAnswer()
    event = lambda delta: "data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]})  # noqa: E731
    a.feed(event({"role": "assistant", "content": ""}))
    for text in ("a", "b", "c", "d"):
        a.feed(event({"content": text}))
    assert a.first == 1.0 and a.gap == 2.5
    assert a.feed("data: [DONE]") and a.done
