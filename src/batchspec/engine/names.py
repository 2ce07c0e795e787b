"""Engine names, one grammar for every command (``bench --engines``, ``audit --engines``):

    plain | <layout>[-lookup] | fault:<name> | faults      then optionally  :fixed | :adaptive   then  @<scheduler>

``<layout>``: ``slotmask`` or ``eqspec``, drafting with the run's draft (``-lookup``: prompt lookup instead);
``plain``: no drafter (batched decoding); ``fault:<name>``: the EQSPEC engine with one injected fault
(``faults.FAULTS``), fixed-length like the engines it reproduces unless told otherwise; ``faults``: every injected
fault. ``:fixed`` / ``:adaptive``: the speculation length policy (default: the command's). ``@<scheduler>``:
``static`` (default), ``continuous`` or ``exspec``. Examples: ``slotmask``, ``eqspec-lookup:fixed``,
``slotmask@continuous``, ``fault:bsp-stale-positions``."""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("slotmask", "eqspec")
SCHEDULERS = ("static", "continuous", "exspec")
SPECULATION = ("fixed", "adaptive")
EXAMPLES = "plain, slotmask, eqspec, slotmask-lookup, slotmask:fixed, slotmask@continuous, fault:<name>, faults"


@dataclass(frozen=True)
class EngineSpec:
    """One engine configuration. ``drafter``: "draft" (the run's draft model or head), "lookup" (prompt lookup) or
    None (plain decoding); ``speculation`` None: the caller's default (injected faults: fixed)."""

    name: str
    layout: str = "slotmask"
    drafter: str | None = "draft"
    scheduler: str = "static"
    fault: str | None = None
    speculation: str | None = None

    def draft(self, draft):
        """What ``LLM(draft=...)`` gets for this engine, given the run's ``draft``."""
        return None if self.drafter is None else "prompt-lookup" if self.drafter == "lookup" else draft

    def policy(self, default: str = "adaptive") -> str:
        return self.speculation or ("fixed" if self.fault else default)


def split_speculation(name: str) -> tuple[str, str | None]:
    """``"slotmask:fixed"`` -> ``("slotmask", "fixed")``; a name without a speculation suffix -> ``(name, None)``."""
    base, _, suffix = name.rpartition(":")
    return (base, suffix) if base and suffix in SPECULATION else (name, None)


def parse_engines(names, sampling: bool = False) -> list[EngineSpec]:
    """``EngineSpec``s for a comma list (or list) of names; ``faults`` expands to every injected fault greedy decoding
    can show (with ``sampling``, the rejection sampler's own faults too). Unknown names raise ``ValueError``."""
    from .faults import FAULTS, SAMPLING_FAULTS

    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out = []
    for name in names:
        base, _, scheduler = name.partition("@")
        scheduler = scheduler or "static"
        base, speculation = split_speculation(base)
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler in engine {name!r}; choose one of {', '.join(SCHEDULERS)}")
        tail = (f":{speculation}" if speculation else "") + (f"@{scheduler}" if scheduler != "static" else "")
        if base == "plain":
            out.append(EngineSpec(name, drafter=None, scheduler=scheduler, speculation=speculation))
        elif base == "faults":
            out += [EngineSpec(f"fault:{f}{tail}", "eqspec", scheduler=scheduler, fault=f, speculation=speculation)
                    for f in FAULTS if sampling or f not in SAMPLING_FAULTS]
        elif base.startswith("fault:"):
            fault = base.removeprefix("fault:")
            if fault not in FAULTS:
                raise ValueError(f"unknown fault {fault!r}; choose one of {sorted(FAULTS)}")
            out.append(EngineSpec(name, "eqspec", scheduler=scheduler, fault=fault, speculation=speculation))
        else:
            layout, _, drafter = base.partition("-")
            if layout not in LAYOUTS or drafter not in ("", "lookup"):
                raise ValueError(f"unknown engine {name!r}; e.g. {EXAMPLES}")
            out.append(EngineSpec(name, layout, "lookup" if drafter else "draft", scheduler, None, speculation))
    return out


def with_speculation(name: str, speculation: str) -> str:
    """``name`` with the speculation suffix ``speculation`` where it has none of its own."""
    base, at, scheduler = name.partition("@")
    return name if split_speculation(base)[1] else f"{base}:{speculation}{at}{scheduler}"
