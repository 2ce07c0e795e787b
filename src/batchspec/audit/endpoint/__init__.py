"""Audit any OpenAI-compatible endpoint at several levels of concurrency, against the local batch-size-1 oracle of the
same model (``audit_endpoint(url, target, prompts)``) or against a reference server without holding any weights
(``audit_endpoint(url, prompts=prompts, reference="self" | URL)``); ``batchspec audit --endpoint URL``.

At each level ``c`` every prompt is sent with at most ``c`` requests under way at once (a new one starts as soon as
one ends, so requests keep joining a running batch), greedy (``temperature: 0``), and the generated token ids are read
back. How they are read decides how far the audit can be trusted, and the report says which was used per level
(``token_source``):

- ``token_ids``: the server returns them (``return_token_ids``, as vLLM and ``batchspec serve`` do): exact;
- ``retokenized text``: it returns only text, which is encoded again with the local tokenizer, and when its
  ``finish_reason`` is ``"stop"`` the EOS token that the text leaves out is put back at the end (the tokenizer's EOS
  if it is one of the stop ids, else the smallest stop id): a last resort, since decoding and encoding need not
  round-trip (a divergence may then be an artefact of the text, not of the server).

``api="completions"`` (default) sends the prompts as token ids, so the server sees exactly the reference's prompt
(text prompts are encoded locally when there is a tokenizer, and sent as text when there is none); ``api="chat"``
sends each prompt as one user message and lets the server apply its chat template (the local oracle applies the local
tokenizer's). ``stream=True`` reads the answers as Server-Sent Events.

The reference, one of:

- the local oracle (``reference=None`` with a ``target``): HF ``generate`` at batch size 1 on the same model, loaded
  locally; a divergence is attributed by the audit's margin rule (``batchspec.audit.attribution``);
- another server (``reference=URL``, e.g. the same model with speculation off) or the same server at concurrency 1
  (``reference="self"``, the default when no ``target`` is given): no model is loaded, only a tokenizer when one is
  given (``tokenizer=``, or ``target`` as a path or name). Its answers are read once, at concurrency 1, asking for the
  ``top_logprobs`` most likely tokens at each position as token ids (``logprobs``, ``return_tokens_as_token_ids``);
  a divergence is attributed from them (``logprob_divergence``), or is ``unattributed`` when they are missing. The
  server under test is sent exactly what a user sends (no logprobs). A reference answer that failed or has a problem
  of its own (below, or an overrun) leaves its prompt out of every level, which is then at best ``incomplete``.
  Without a tokenizer the stop tokens are the given ``stop_token_ids`` and the last token of each reference answer
  that ended with ``finish_reason`` ``"stop"``; with one, its EOS token as well.

What is compared: the whole output the server returns, with the reference's, which ends at the first stop token (the
target's EOS ids plus ``stop_token_ids``) or at ``max_tokens``. A divergence within that length is attributed;
tokens after the first stop token or beyond ``max_tokens`` are a divergence of class ``overrun`` at the first extra
token. Every answer is checked too:

- token ids (``token_ids``, ``prompt_token_ids``) must be JSON integers in ``0..vocab-1`` (``>= 0`` without a local
  model); anything else (``504.7``, ``"5"``, ``true``, ``-1``) is a *protocol error*, never converted, and that
  answer is not compared;
- ``prompt_token_ids``, when returned, must equal the ids sent (with ``api="chat"`` and a tokenizer: the local
  template's; prompts sent as text: the reference's ``prompt_token_ids``), else it is a *prompt mismatch*;
- ``finish_reason`` must agree with the tokens: ``"stop"`` with a stop token at the end, ``"length"`` with
  ``max_tokens`` tokens (either for ``max_tokens`` tokens ending with a stop token); anything else (none,
  ``"abort"``) disagrees. Without token ids only the value is checked;
- a request that fails (an HTTP error, an answer that is not JSON or has no choice, a closed connection, no answer
  within ``timeout``, an error event, a stream that ends without ``[DONE]``) is *failed* and not compared.

Each level is one row of an ``AuditReport`` (``batch_size`` = concurrency, ``n`` = answers compared) whose
``signature`` is the first that applies: ``could not audit`` (every request failed, or no reference answer),
``stale or wrong reference``, ``prompt mismatch``, the audit's black-box signature of the synchronization and
unattributed divergences (``unattributed`` when they are all unattributed and match no bug class), ``overrun``,
``protocol error`` (a protocol error or a finish_reason that disagrees), ``incomplete`` (some requests failed or had
no reference answer, the rest are clean), ``clean``. Only ``clean`` is clean. For the black-box padding rule a prompt
counts as padded when a request under way at the same time was or grew longer than it (a server batches whatever it
has under way, in an order of its own), not by its place in a fixed batch (``black_box_records``).

Logprob rule (``logprob_divergence``). At the first divergent index ``j`` the reference's answer lists the
log-probabilities of its most likely tokens there, on the same prefix (the outputs agree before ``j``). The margin
is the reference token's log-probability minus the endpoint token's (the same difference as of their logits), and
the tolerance is ``relative_tolerance(dtype, tolerance)`` times ``max(1, largest |log-probability| listed at j)``,
that scale capped at ``MAX_LOGIT_SCALE``: the listed spread stands in for the logits' scale, which log-probabilities do
not carry. A listed number that is no log-probability (positive, infinite, NaN) makes the entry unusable:
``unattributed``. ``dtype`` is the servers'
(default float32: a server does not say what it computes in, and a coarser default would excuse real bugs as rounding;
give bfloat16 or float16 for a server that computes in them). Then
``attribution.classify`` decides: numerical, synchronization, or reference (the reference's own numbers prefer the
endpoint's token). An endpoint token that is not listed has at most the lowest listed log-probability: beyond the
tolerance that bound makes the divergence synchronization; otherwise, or with no log-probabilities for the
reference's token at ``j``, it is ``unattributed``.

The package: ``client`` sends the requests and reads the answers back (HTTP and Server-Sent Events through
``batchspec.serve.client``, shared with the load generator), ``answer`` checks each answer, ``judges`` compares a
level's answers with the reference's and classes their divergences, ``flows`` runs the audit against either reference
(``EndpointAudit``: its settings), ``markdown`` writes the verdict and the report. ``baseline`` records a server's
answers with its fingerprint and compares them with a later run of the same requests (``batchspec audit --save``,
``--against``), ``logprob_checks`` checks the log-probabilities a server returns, ``repro`` writes a replay script per
drift, ``junit`` the report for CI, ``features`` audits request features (``batchspec audit --features``: json
schema, tools, penalties, logit bias, stop strings, logprobs, n, seed) against a reference and by a rule of each.
"""

from __future__ import annotations

from ...serve.client import api_base
from .answer import PROMPT_MISMATCH, PROTOCOL_ERROR, RETOKENIZED, TOKEN_IDS, Answer, logprob_entries
from .client import ConcurrentRun, EndpointClient, model_name, served_models
from .flows import (SELF, TOP_LOGPROBS, EndpointAudit, audit_endpoint, check_levels, check_request, prompt_items,
                    reference_tokenizer)
from .judges import (COULD_NOT_AUDIT, ENDPOINT_SIGNATURES, INCOMPLETE, MAX_LOGIT_SCALE, UNATTRIBUTED,
                     LogprobDivergence, black_box_records, logprob_divergence)
from .markdown import endpoint_markdown, endpoint_verdict

__all__ = ["audit_endpoint", "EndpointAudit", "endpoint_markdown", "endpoint_verdict", "EndpointClient",
           "ConcurrentRun", "Answer", "LogprobDivergence", "logprob_divergence", "logprob_entries",
           "black_box_records", "api_base", "served_models", "model_name", "check_levels", "check_request",
           "prompt_items", "reference_tokenizer", "TOKEN_IDS", "RETOKENIZED", "SELF", "TOP_LOGPROBS", "COULD_NOT_AUDIT",
           "MAX_LOGIT_SCALE", "PROMPT_MISMATCH", "PROTOCOL_ERROR", "INCOMPLETE", "UNATTRIBUTED", "ENDPOINT_SIGNATURES"]
