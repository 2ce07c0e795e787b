"""Structured output under speculation: every output follows its grammar (JSON schema, regex, choice); greedy
output equals a batch-1 oracle that masks the target's logits with the same grammar one token at a time, at batch 1
and 8, without a drafter, with prompt lookup and with a draft model (drafts accepted); a dead end ends its row alone
with finish reason "grammar"; the server's ``response_format`` returns valid JSON and bad grammars give 400."""

from __future__ import annotations

import functools
import json
import re

import httpx
import llguidance
import pytest
import tiny
import torch

import batchspec
from batchspec import SamplingParams

N = 40
SCHEMA = {"type": "object", "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "string", "maxLength": 3}}}


@functools.lru_cache(maxsize=None)
def tokenizer():
    """A character-level tokenizer over the tiny vocabulary whose tokens spell JSON (id 0: end of sequence), byte-level
    as GPT-2's (a space is "Ġ"; llguidance's masks need the pre-tokenizer to read the tokens' bytes right)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list('{}[]":,.Ġ-_') + [str(i) for i in range(10)] + [chr(c) for c in range(97, 123)]
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    vocab.update({f"<x{i}>": i for i in range(len(vocab), tiny.VOCAB)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _ids(text: str) -> list[int]:
    return tokenizer().encode(text)


# prompts holding JSON text, so prompt lookup finds drafts the grammar allows
PROMPTS = [_ids('{"a":12,"b":"xy"}{"a":') + p[:6] for p in tiny.prompts(8, seed=5)]


def _llm(drafter, batch_size: int, **kw):
    draft = tiny.draft() if drafter == "draft" else tiny.eagle() if drafter == "eagle" else drafter
    return tiny.fixed_llm(tiny.target(), draft=draft, num_draft_tokens=4, batch_size=batch_size, tokenizer=tokenizer(),
                          check_invariants=True, prefix_cache=0, **kw)


def _oracle(prompt: list[int], grammar: str, max_tokens: int = N) -> list[int]:
    """Greedy decoding with the target alone, one token at a time, its logits masked by an llguidance matcher of
    ``grammar``; ends where the grammar is complete."""
    import llguidance.hf  # noqa: F401 (llguidance.hf.from_tokenizer)
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    model, out = tiny.target(), []
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer(), n_vocab=tiny.VOCAB), grammar)
    bits = allocate_token_bitmask(1, tiny.VOCAB)
    while len(out) < max_tokens and not m.is_stopped():
        logits = model(torch.tensor([prompt + out])).logits[0, -1]
        fill_next_token_bitmask(m, bits)
        legal = ((bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: tiny.VOCAB].bool()
        out.append(int(logits.masked_fill(~legal, float("-inf")).argmax()))
        assert m.consume_token(out[-1])
    return out


def _valid(text: str) -> bool:
    """``text`` is JSON that ``SCHEMA`` accepts (a structural check of its two fields)."""
    value = json.loads(text)
    a, b = value.get("a"), value.get("b")
    return set(value) == {"a", "b"} and isinstance(a, int) and 0 <= a <= 99 and isinstance(b, str) and len(b) <= 3


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "draft"])
def test_greedy_json_schema_equals_the_masked_oracle(drafter, batch_size):
    params = SamplingParams(max_tokens=N, json_schema=SCHEMA)
    want = [_oracle(p, params.structured()) for p in PROMPTS]
    llm = _llm(drafter, batch_size)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "stop" and _valid(o.text) for o in outs)
    free = _llm(None, 8).generate(PROMPTS, SamplingParams(max_tokens=N))
    assert not any(o.text.startswith("{") for o in free)  # the grammar is what makes it JSON
    if drafter is not None:
        assert llm.stats.accepted > 0  # drafts verified and accepted under the grammar


def test_regex_and_choice_beside_unconstrained_rows():
    """A regex row, a choice row and rows without grammars in one running batch: each as it is alone."""
    regex = SamplingParams(max_tokens=N, regex=r"[a-c]{2,5}-[0-9]{3}")
    choice = SamplingParams(max_tokens=N, choice=["yes", "no", "maybe"])
    free = SamplingParams(max_tokens=12)
    params = [regex, choice, free, regex, choice, free, free, regex]
    alone = [_llm(None, 1).generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    outs = _llm("draft", 3, scheduler="continuous").generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    for o, sp in zip(outs, params):
        if sp is regex:
            assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", o.text)
        elif sp is choice:
            assert o.text in ("yes", "no", "maybe")
        else:
            assert o.token_ids == tiny.oracle(tiny.target(), o.prompt_token_ids, 12)


def test_a_dead_end_ends_its_row_alone():
    """A grammar whose continuation no token can spell ends with finish reason "grammar" after the part it could
    follow; the rows beside it are untouched."""
    stuck = SamplingParams(max_tokens=N, grammar='start: "ab" "\u00e9"')
    free = SamplingParams(max_tokens=12)
    outs = _llm("prompt-lookup", 4).generate(PROMPTS[:4], [stuck, free, stuck, free])
    assert [o.finish_reason for o in outs] == ["grammar", "length", "grammar", "length"]
    assert outs[0].text == outs[2].text == "ab"
    assert [o.token_ids for o in outs[1::2]] == [tiny.oracle(tiny.target(), p, 12) for p in PROMPTS[1:4:2]]


def test_bad_structured_fields_name_the_field():
    with pytest.raises(ValueError) as e:
        SamplingParams(regex="a(b")
    assert e.value.param == "regex"
    with pytest.raises(ValueError) as e:
        SamplingParams(json_schema={"type": "nonsense"})
    assert e.value.param == "json_schema"
    with pytest.raises(ValueError) as e:
        SamplingParams(regex="a", choice=["b"])
    assert e.value.param == "regex"
    with pytest.raises(ValueError) as e:  # valid, but this vocabulary cannot spell its first character
        _llm(None, 1).generate([PROMPTS[0]], SamplingParams(grammar='start: "\u00e9"'))
    assert e.value.param == "grammar"


def test_server_response_format_json_schema_and_400s():
    from batchspec.serve.app import create_app
    from batchspec.serve.server import ServerThread

    llm = batchspec.LLM(tiny.target(), draft=tiny.draft(), scheduler="continuous", num_draft_tokens=3, batch_size=4,
                        tokenizer=tokenizer())
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    with ServerThread(create_app(llm, model_name="tiny")) as server:
        def post(**body):
            return httpx.post(server.url + "/v1/completions", json=dict(prompt=PROMPTS[0], max_tokens=N, **body),
                              timeout=60)

        r = post(temperature=0, response_format=fmt)
        assert r.status_code == 200 and _valid(r.json()["choices"][0]["text"])
        metrics = httpx.get(server.url + "/metrics").text  # the schema's keys were forced drafts, all accepted
        counts = dict(re.findall(r"^batchspec_forced_(\w+)_tokens_total (\S+)$", metrics, re.M))
        assert float(counts["drafted"]) == float(counts["accepted"]) > 0
        r = post(temperature=0.8, seed=3, response_format={"type": "json_object"})
        assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["text"]), dict)
        bad = [(dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
                "response_format"),
               (dict(response_format={"type": "xml"}), "response_format"),
               (dict(structured_outputs={"regex": "a(b"}), "structured_outputs.regex"),
               (dict(structured_outputs={"grammar": 'start: "\u00e9"'}), "structured_outputs.grammar")]
        for body, param in bad:
            r = post(**body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


# keys spelled one character a token, each the only one its mask allows: forced; the values are the model's choice
FORCED_SCHEMA = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
                 "properties": {"name": {"type": "string", "maxLength": 4},
                                "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def _legal(m, vocab: int = tiny.VOCAB) -> list[int]:
    """The tokens ``m``'s mask allows now."""
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    bits = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(m, bits)
    return ((bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].nonzero()[:, 0].tolist()


def test_forced_tokens_are_the_only_legal_ones():
    """``grammar.forced`` keeps a fast-forward token only while the mask allows it alone: in JSON's fixed layout
    (``params.JSON_LAYOUT``) the brace, each key with its quotes, the separators and a string value's opening quote;
    never a value nor the end-of-sequence token of a complete grammar; the row's own matcher stays where it was."""
    from types import SimpleNamespace

    from batchspec.batch.grammar import forced

    grammars = _llm(None, 1).parts.grammars
    m = grammars.matcher(SamplingParams(json_schema=FORCED_SCHEMA).structured())
    seqs = SimpleNamespace(matchers=[None, m], grammar_rows=[1], length=torch.zeros(2, dtype=torch.long))
    tokens, counts = forced(seqs, 16, tiny.VOCAB)
    assert counts == [0, 10] and tokens[1, :10].tolist() == _ids('{"name": "') and _legal(m) == _ids("{")
    assert forced(seqs, 2, tiny.VOCAB)[1] == [0, 2]  # at most the room
    for t in _ids('{"name": "'):
        assert m.consume_token(t)
    assert len(_legal(m)) > 1 and forced(seqs, 16, tiny.VOCAB) is None  # a value: the model's choice
    for t in _ids('ab"'):
        assert m.consume_token(t)
    tokens, counts = forced(seqs, 16, tiny.VOCAB)
    assert tokens[1, : counts[1]].tolist() == _ids(', "age": ')
    for t in _ids(', "age": 12}'):
        assert m.consume_token(t)
    assert _legal(m) == [0] and forced(seqs, 16, tiny.VOCAB) is None  # complete: only the end, never drafted


def test_a_schema_may_leave_whitespace_free():
    """A schema's own ``"x-guidance"`` layout wins over ``JSON_LAYOUT``: with whitespace free the quote a key opens
    with is the model's choice (whitespace may come first), the key's characters and closing quote are forced."""
    from types import SimpleNamespace

    from batchspec.batch.grammar import forced

    free = {**FORCED_SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    m = _llm(None, 1).parts.grammars.matcher(SamplingParams(json_schema=free).structured())
    seqs = SimpleNamespace(matchers=[m], grammar_rows=[0], length=torch.zeros(1, dtype=torch.long))
    tokens, counts = forced(seqs, 16, tiny.VOCAB)
    assert counts == [1] and tokens[0, :1].tolist() == _ids("{")
    assert m.consume_token(_ids("{")[0]) and set(_ids(' "')) <= set(_legal(m))
    assert forced(seqs, 16, tiny.VOCAB) is None
    assert m.consume_token(_ids('"')[0])
    tokens, counts = forced(seqs, 16, tiny.VOCAB)
    assert tokens[0, : counts[0]].tolist() == _ids('name"')


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "draft", "eagle"])
def test_forced_keys_are_drafted_and_accepted(drafter, batch_size):
    """Jump-forward as speculation: a schema's forced keys are drafted first (without a drafter too, in a wider
    block), every one is accepted under greedy decoding with the mask, and the output is the batch-1 oracle's."""
    params = SamplingParams(max_tokens=N, json_schema=FORCED_SCHEMA)
    want = [_oracle(p, params.structured()) for p in PROMPTS]
    llm = _llm(drafter, batch_size)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "stop" and set(json.loads(o.text)) == {"name", "age"} for o in outs)
    s = llm.stats
    assert s.forced_rounds > 0 and s.forced_drafted >= len(PROMPTS)  # every row's opening brace, at least
    assert s.forced_accepted == s.forced_drafted and s.accepted >= s.forced_accepted
    assert s.rounds < sum(map(len, want))  # rounds emitted several tokens a row
    assert max(s.lengths) + 1 <= llm.memory.block  # the KV memory bound holds the widest block
    if drafter is None:
        assert s.lengths.keys() - {0}  # plain decoding, yet rounds verified drafts: the forced ones


def test_the_head_drafts_forced_tokens_first_and_drafts_on_from_them(monkeypatch):
    """The default drafter (a head with copies) takes a grammar's forced tokens: in rounds that run the head they are
    a row's first drafts (in place of its copies) and the head drafts on after them; in rounds the head would not
    run (copies, or none planned) they are verified alone and the head's features wait. Output: the oracle's."""
    from batchspec.drafters import EagleDrafter

    seen, propose = [], EagleDrafter.propose

    def spy(self, seqs, state, plan):
        proposal = propose(self, seqs, state, plan)
        if plan.forced is not None:
            seen.append((plan.kind, plan.forced.tolist(), plan.n_forced.tolist(), proposal.drafts.tolist(),
                         proposal.n_drafts.tolist(), proposal.kind))
        return proposal

    from test_policy import Scripted

    monkeypatch.setattr(EagleDrafter, "propose", spy)
    params = SamplingParams(max_tokens=N, json_schema=FORCED_SCHEMA)
    llm = _llm("eagle", 4, speculation=Scripted((0, 3, 0, 4, 2)))  # rounds that plan no drafts among them
    outs = llm.generate(PROMPTS[:4], params)
    assert [o.token_ids for o in outs] == [_oracle(p, params.structured()) for p in PROMPTS[:4]]
    kinds = {kind for kind, *_ in seen}
    assert "head" in kinds and kinds & {"copy", "forced"}, kinds
    for kind, forced, counts, drafts, n, proposed in seen:
        assert proposed == (None if kind == "head" and proposed is None else kind)
        for f, c, d, m in zip(forced, counts, drafts, n):
            assert d[:c] == f[:c] and m >= c  # the forced tokens first, every one verified


def test_forced_drafts_under_sampling_keep_plain_sampling(monkeypatch):
    """Sampled rows draft forced tokens too (one-hot: probability 1 under the mask, always accepted): without a
    drafter the tokens are those of plain sampled decoding at batch 1, where the forced tokens are not drafted; with
    a draft model or the head (their own drafts sampled on from them) every forced draft is accepted."""
    from batchspec.drafters.none import NoDrafter

    params = [SamplingParams(max_tokens=N, json_schema=FORCED_SCHEMA, temperature=0.8, seed=i) for i in range(4)]
    llm = _llm(None, 4)
    outs = llm.generate(PROMPTS[:4], params)
    assert llm.stats.forced_accepted == llm.stats.forced_drafted > 0
    with monkeypatch.context() as m:
        m.setattr(NoDrafter, "takes_forced", False)
        plain = _llm(None, 1)
        alone = [plain.generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
        assert plain.stats.forced_drafted == 0 and plain.stats.lengths.keys() == {0}
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    for drafter in ("draft", "eagle"):
        llm = _llm(drafter, 4)
        outs = llm.generate(PROMPTS[:4], params)
        assert llm.stats.forced_accepted == llm.stats.forced_drafted > 0
        assert all(set(json.loads(o.text)) == {"name", "age"} for o in outs)


def test_forced_drafts_come_first_and_teach_the_copies_nothing():
    """Prompt lookup with a row's forced tokens: they are its first drafts, its own candidates after them only where
    they agree (else cut); what the planner learns of copies' acceptance comes from the rows without forced ones."""
    from types import SimpleNamespace

    from batchspec.drafters.lookup import PromptLookup
    from batchspec.speculation.budget import DraftBudget
    from batchspec.speculation.plan import Planner, with_forced

    rows = [[1, 2, 3, 4, 30, 31, 32, 1, 2, 3, 4]] * 3  # each copies 30 31 32 1 2 next
    hist = torch.zeros((3, 24), dtype=torch.long)
    hist[:, :11] = torch.tensor(rows)
    seqs = SimpleNamespace(history=hist, length=torch.full((3,), 11), sampling=False)
    drafter, planner = PromptLookup(), Planner()
    plan = planner.plan(drafter.offer(seqs, None, 4), DraftBudget(4))
    forced = torch.tensor([[30, 31, 0], [40, 0, 0], [0, 0, 0]])  # agrees with row 0's copies, not row 1's
    plan = with_forced(plan, forced, [2, 1, 0], "fixed")
    proposal = drafter.propose(seqs, None, plan)
    assert proposal.n_drafts.tolist() == [4, 1, 4]
    assert proposal.drafts[0].tolist() == [30, 31, 32, 1] and proposal.drafts[1, :1].tolist() == [40]
    planner.learn(plan, proposal, torch.tensor([4, 1, 2]), None)
    assert planner.copies.offered.sum() == 3 and planner.copies.hits.sum() == 2  # row 2's: 2 accepted, the 3rd not


def test_masks_list_only_the_constrained_positions():
    """``grammar.masks`` on a batch mixing constrained and unconstrained rows with drafts: each constrained row's
    drafts are cut before the first one its grammar forbids, and ``Legal`` masks exactly its positions up to there
    (each with the tokens its matcher allows after the drafts before it); every other position keeps its logits.
    Its greedy tokens are the masked logits' argmax, kept from the unmasked argmax wherever the mask allows it."""
    from types import SimpleNamespace

    from batchspec.batch.grammar import masks
    from batchspec.sampling import greedy

    grammars = _llm(None, 1).parts.grammars
    matchers = [grammars.matcher(SamplingParams(json_schema=FORCED_SCHEMA).structured()) for _ in range(3)]
    for t in _ids('{"name": "a'):
        assert matchers[2].consume_token(t)
    seqs = SimpleNamespace(matchers=[matchers[0], None, matchers[1], matchers[2]], grammar_rows=[0, 2, 3])
    rows = [_ids('{"nam'), _ids("abcde"), _ids('{"x"}'), _ids('bc",x')]
    legal, n, dead = masks(seqs, torch.tensor(rows), torch.tensor([5, 3, 5, 2]), tiny.VOCAB)
    assert n.tolist() == [5, 3, 2, 2] and dead == {}
    blocked = torch.zeros(4, 6, tiny.VOCAB, dtype=torch.bool)
    for i, m in enumerate(seqs.matchers):
        if m is None:
            continue
        m = m.deep_copy()
        for j in range(n[i] + 1):
            blocked[i, j] = True
            blocked[i, j, _legal(m)] = False
            if j < n[i]:
                assert m.consume_token(rows[i][j])
    assert sorted(legal.positions.tolist()) == [0, 1, 2, 3, 4, 5, 12, 13, 14, 18, 19, 20]  # rows 0, 2, 3 of 6
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(4, 6, tiny.VOCAB).to(dtype)
        logits[0, 0, _ids("{")] = 9.0  # its argmax is legal there: kept without masking
        want = logits.masked_fill(blocked, float("-inf"))
        assert torch.equal(legal.masked(logits), want)
        assert torch.equal(legal.greedy(greedy(logits), lambda: logits), greedy(want))
        assert torch.equal(legal.greedy(greedy(want), None), greedy(want))  # every argmax legal: no logits read
        kept = (greedy(want) == greedy(logits)).view(-1)[legal.positions]
        assert kept.any() and not kept.all()  # some argmaxes kept, some taken again under the masks


def test_processors_and_sampling_beside_grammars_as_alone():
    """Grammar rows with logits processors or sampling beside unconstrained ones (greedy and sampled) under a draft
    model: each row's tokens are those it gets alone at batch 1."""
    schema = FORCED_SCHEMA
    params = [SamplingParams(max_tokens=N, json_schema=schema, repetition_penalty=1.3),
              SamplingParams(max_tokens=12, presence_penalty=0.5),
              SamplingParams(max_tokens=N, json_schema=schema, temperature=0.8, seed=1),
              SamplingParams(max_tokens=12, temperature=0.8, seed=2),
              SamplingParams(max_tokens=N, regex=r"[a-c]{2,5}-[0-9]{3}", logit_bias={_ids("b")[0]: 3.0})]
    alone = [_llm("draft", 1).generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    outs = _llm("draft", 5).generate(PROMPTS[:5], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert set(json.loads(outs[0].text)) == set(json.loads(outs[2].text)) == {"name", "age"}
