"""batchspec: batched speculative decoding whose greedy output equals batch-size-1 decoding, and an audit that checks it."""

from .api import LLM
from .audit import audit
from .batch import InvariantError
from .config import EngineConfig
from .params import RequestOutput, SamplingParams, Stats

__all__ = ["LLM", "EngineConfig", "audit", "SamplingParams", "RequestOutput", "Stats", "InvariantError"]
__version__ = "0.1.0"
