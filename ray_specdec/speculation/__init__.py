"""Speculation: drafting and the proposers (the Mamba drafter's trees, prompt lookup), the choice of how much to draft,
and the judging of a round (acceptance, sampling, logits processing, stopping, trees). Import from the modules."""
