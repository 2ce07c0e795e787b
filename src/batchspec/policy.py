"""How many tokens the rows draft in a round (the speculation length), chosen before the round is drafted."""


class FixedLength:
    """Every row drafts ``num_draft_tokens`` (K) tokens every round: the verification block is K+1 wide."""

    name = "fixed"

    def length(self, batch, k: int) -> int:
        return k
