"""The drafter interface, with no-op defaults for drafters that keep no per-row state."""


class Drafter:
    name = "drafter"
    states = ()  # SlotStates a layout must keep aligned

    def add(self, prompts):
        """Rows joining the batch (appended after the current rows)."""

    def propose(self, seqs, k):
        """(drafts [B, k], n_drafts [B], q): up to k proposed tokens per row, and ``q`` [B, k, V] the distributions
        they were sampled from when ``seqs.sampling`` (None for a deterministic drafter: one-hot on its tokens)."""
        raise NotImplementedError

    def commit(self, accepted, k):
        """After verification: row b accepted ``accepted[b]`` drafts."""

    def select_rows(self, rows):
        """Keep only ``rows`` (a 1D index tensor)."""

    def take(self, rows):
        """A drafter for ``rows`` only (a batch drawn from a larger window); stateless drafters return themselves."""
        return self

    def put(self, rows, part):
        """Write back what ``take(rows)`` returned, after a round."""

    def reset(self):
        """The batch emptied."""
