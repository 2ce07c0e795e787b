"""Shared pieces of the serving tests: a tiny tokenizer, tiny LLMs for a server, an OpenAI client, waiting."""

import time

import openai
import tiny

import batchspec


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary ("w0".."w95", "w0" doubling as the unknown token, so every id
    has one spelling and decoding is deterministic), with a minimal chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(tiny.VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")
    fast.chat_template = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                          "{% if add_generation_prompt %}w3{% endif %}")
    return fast


def llm(**kw):
    """The tiny target with its draft (ragged acceptance), continuous batching, 4 rows by default."""
    kw.setdefault("num_draft_tokens", 3)
    kw.setdefault("batch_size", 4)
    kw.setdefault("tokenizer", tokenizer())
    return batchspec.LLM(tiny.target(), draft=tiny.draft(), scheduler="continuous", **kw)


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def slow(worker, seconds):
    """Make every engine step take at least ``seconds`` longer (so a test can act while requests run)."""
    step = worker.engine._step

    def slowed():
        time.sleep(seconds)
        return step()

    worker.engine._step = slowed


def wait(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.01)
    return True
