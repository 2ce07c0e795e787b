"""The audit's result: one row per (engine, batch size), written as JSON, Markdown, a rich table or a PNG."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .attribution import Divergence


@dataclass
class AuditRow:
    engine: str
    batch_size: int
    n: int  # prompts
    exact_match: float  # fraction of outputs equal to the oracle's
    partial_match: float  # mean common-prefix fraction
    rouge_l: float  # mean ROUGE-L F-measure
    repetition_rate: float  # fraction of outputs ending in a repetition loop
    divergences: list[Divergence]
    signature: str
    first_violated_invariant: dict | None
    tokens_per_second: float
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def synchronization(self) -> int:
        return sum(d.cls == "synchronization" for d in self.divergences)

    @property
    def numerical(self) -> int:
        return sum(d.cls == "numerical" for d in self.divergences)

    @property
    def reference(self) -> int:
        """Divergences where the target prefers the engine's token: the oracle output is stale or wrong."""
        return sum(d.cls == "reference" for d in self.divergences)

    @property
    def overrun(self) -> int:
        """Outputs with tokens past their first stop token or ``max_tokens`` (the endpoint audit)."""
        return sum(d.cls == "overrun" for d in self.divergences)

    @property
    def unattributed(self) -> int:
        """Divergences that could not be attributed (an endpoint audited against a reference server that returned no
        log-probabilities)."""
        return sum(d.cls == "unattributed" for d in self.divergences)

    @property
    def clean(self) -> bool:
        """No synchronization, reference, overrun or unattributed divergence, and the signature says so (the endpoint
        audit also names levels that are not clean for other reasons: failed requests, protocol errors, prompt
        mismatches)."""
        return self.signature == "clean" and not (self.synchronization or self.reference or self.overrun
                                                  or self.unattributed)

    def as_dict(self, outputs: bool = True) -> dict:
        d = {
            "engine": self.engine, "batch_size": self.batch_size, "n": self.n, "exact_match": self.exact_match,
            "partial_match": self.partial_match, "rouge_l": self.rouge_l, "repetition_rate": self.repetition_rate,
            "numerical": self.numerical, "synchronization": self.synchronization, "reference": self.reference,
            "overrun": self.overrun, "unattributed": self.unattributed, "signature": self.signature,
            "first_violated_invariant": self.first_violated_invariant, "tokens_per_second": self.tokens_per_second,
            "divergences": [x.as_dict() for x in self.divergences],
        }
        if outputs:
            d["outputs"] = self.outputs
        return d


def save_png(figure, path) -> Path:
    """``figure`` (matplotlib) written to ``path`` as a PNG, its folder made if need be."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=130)
    return path


def _invariant(v: dict | None) -> str:
    if not v:
        return "none"
    return f"{v['invariant']} {v['kind']}" + (f" ({v['cache']})" if v.get("cache") else "")


COLUMNS = ("engine", "batch", "exact", "partial", "ROUGE-L", "repeat", "num/sync", "signature", "first violated", "tok/s")


@dataclass
class AuditReport:
    rows: list[AuditRow]
    meta: dict
    oracle: list[list[int]] = field(default_factory=list, repr=False)

    def row(self, engine: str, batch_size: int) -> AuditRow:
        for r in self.rows:
            if r.engine == engine and r.batch_size == batch_size:
                return r
        raise KeyError((engine, batch_size))

    def as_dict(self, outputs: bool = True) -> dict:
        d = {"meta": self.meta, "rows": [r.as_dict(outputs) for r in self.rows]}
        if outputs:
            d["oracle"] = self.oracle
        return d

    def to_json(self, path, outputs: bool = True) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(outputs), indent=1))
        return path

    def _cells(self, r: AuditRow) -> list[str]:
        metrics = [f"{v:.3f}" if r.n else "-" for v in (r.exact_match, r.partial_match, r.rouge_l, r.repetition_rate)]
        return [
            r.engine, str(r.batch_size), *metrics,
            f"{r.numerical}/{r.synchronization}" + (f" ({r.reference} ref)" if r.reference else "")
            + (f" ({r.overrun} overrun)" if r.overrun else "")
            + (f" ({r.unattributed} unattributed)" if r.unattributed else ""), r.signature,
            _invariant(r.first_violated_invariant), f"{r.tokens_per_second:.1f}",
        ]

    def to_markdown(self) -> str:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        lines += ["| " + " | ".join(self._cells(r)) + " |" for r in self.rows]
        m = self.meta
        ref = " (ref: the target prefers the engine's token, so the oracle is stale or wrong)" if any(
            r.reference for r in self.rows) else ""
        if any(r.overrun for r in self.rows):
            ref += " (overrun: outputs with tokens past their first stop token or max_tokens)"
        if any(r.unattributed for r in self.rows):
            ref += " (unattributed: no log-probabilities to tell numerical from synchronization)"
        lines += [
            "",
            f"{m.get('n_prompts')} prompts, max_tokens {m.get('max_tokens')}, K={m.get('num_draft_tokens')}, "
            f"oracle: {self.reference_line()}; num/sync: divergences within / beyond the "
            f"margin tolerance{ref}; oracle repetition rate {m.get('oracle_repetition_rate', 0):.3f}.",
        ]
        return "\n".join(lines) + "\n"

    def reference_line(self) -> str:
        """What the outputs were compared with, in words."""
        return self.meta.get("oracle") or f"HF greedy at batch size 1 ({self.meta.get('target_dtype')})"

    def verdict(self) -> tuple[int, str]:
        """The local audit's exit status and verdict in a line: 1 when an engine other than an injected fault is not
        clean at some batch size, else 0."""
        broken = [f"{r.engine} B={r.batch_size}" for r in self.rows
                  if not r.clean and not r.engine.startswith("fault:")]
        if broken:
            return 1, f"not clean: {', '.join(broken)}"
        faults = [r for r in self.rows if r.engine.startswith("fault:")]
        caught = sum(not r.clean for r in faults)
        return 0, "clean" + (f" (injected faults caught: {caught} of {len(faults)} rows)" if faults else "")

    def rich_table(self):
        from rich.table import Table
        from rich.text import Text

        t = Table(title="batchspec audit")
        for c in COLUMNS:
            t.add_column(c, justify="left" if c in ("engine", "signature", "first violated") else "right")
        for r in self.rows:
            cells = [Text(c) for c in self._cells(r)]  # inert text: an engine may be named by a server
            cells[7].stylize("green" if r.signature == "clean" else "red")
            t.add_row(*cells)
        return t

    def plot(self, path) -> Path:
        """Exact match, partial match and ROUGE-L per engine and batch size, with each row's signature (PNG)."""
        return save_png(self.figure(), path)

    def figure(self):
        """The figure of ``plot`` (a matplotlib ``Figure``)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        from ..serve.client import display

        n = len(self.rows)
        fig = Figure(figsize=(max(6.0, 0.9 * n + 2), 5.6), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        width = 0.27
        series = (("exact match", "exact_match", "#2b6cb0"), ("partial match", "partial_match", "#68a0d8"),
                  ("ROUGE-L", "rouge_l", "#c9a227"))
        for j, (label, attr, color) in enumerate(series):
            ax.bar([i + (j - 1) * width for i in range(n)], [getattr(r, attr) for r in self.rows], width,
                   label=label, color=color)
        for i, r in enumerate(self.rows):
            ax.text(i, 1.04, r.signature, rotation=90, ha="center", va="bottom", fontsize=7,
                    color="#2f855a" if r.signature == "clean" else "#c53030")
        ax.set_xticks(range(n), [f"{display(r.engine)}\nB={r.batch_size}" for r in self.rows], rotation=45, ha="right",
                      fontsize=7, parse_math=False, usetex=False)  # a server's model id, as it is
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_ylim(0, 1.9)
        ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        ax.axhline(1.0, color="#999999", lw=0.6, ls=":")
        ax.set_ylabel("fraction / mean over prompts")
        against = "the reference server" if self.meta.get("reference") else "batch-size-1 greedy decoding"
        ax.set_title(f"batchspec audit: agreement with {against}\n(signature above each group)", fontsize=10)
        ax.legend(loc="upper left", ncols=3, fontsize=8, framealpha=0.9)
        return fig
